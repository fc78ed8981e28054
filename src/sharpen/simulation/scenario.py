"""The scenario a simulation runs: a hypothetical cluster and workload, read from TOML into typed sections.

It owns the schema, its checks (one clear message per bad input) and loading. It lives here and not in
`sharpen.config` because a scenario is not a run config: nothing trains from it, `sharpen config --keys` does not
list it, and the recipe schema stays the one source of truth for runs. It reuses `Section` (unknown keys are
errors, a field's docstring is its help). It does not simulate (cluster.py) or price anything (costs.py).
"""

from __future__ import annotations

import math
import random
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from sharpen.config import ConfigError
from sharpen.config.section import Section
from sharpen.simulation.hardware import GPU_KINDS, GpuKind
from sharpen.simulation.parallel import LayerShape


class ScenarioError(ConfigError):
    """A scenario file that cannot be simulated; the message names the key and is meant for the user."""


class Distribution(Section):
    """A positive quantity drawn per item: response tokens, service seconds."""

    kind: Literal["constant", "lognormal"] = "constant"
    """`constant` (always `median`) or `lognormal` (median `median`, log-space standard deviation `sigma`)."""
    median: float = Field(ge=0.0)
    """The median (for `constant`, the value)."""
    sigma: float = Field(default=0.0, ge=0.0)
    """Log-space standard deviation of `lognormal`; 1.0 makes the 99th percentile ~10x the median."""
    max: float | None = Field(default=None, gt=0.0)
    """Cap (e.g. the generation length limit: longer responses are truncated to it)."""

    @model_validator(mode="after")
    def _check(self) -> Distribution:
        if self.kind == "lognormal" and self.median <= 0:
            raise ValueError("a lognormal distribution needs median > 0")
        return self

    def sample(self, rng: random.Random) -> float:
        value = self.median if self.kind == "constant" else rng.lognormvariate(math.log(self.median), self.sigma)
        return value if self.max is None else min(value, self.max)


class CustomGpu(Section):
    peak_tflops: float = Field(gt=0.0)
    """Dense bf16 peak, TFLOP/s."""
    memory_bandwidth_gbps: float = Field(gt=0.0)
    """Memory bandwidth, GB/s."""
    memory_gib: float = Field(gt=0.0)
    """Device memory, GiB."""


class ModelSection(Section):
    num_params: float = Field(gt=0.0)
    """Parameters of the policy (e.g. 1.5e9)."""
    bytes_per_param: float = Field(default=2.0, gt=0.0)
    """Bytes per weight in the engine and in the weight sync (2 for bf16/fp16)."""
    kv_bytes_per_token: float = Field(default=0.0, ge=0.0)
    """KV-cache bytes per token: 2 * layers * kv_heads * head_dim * bytes (0 ignores the KV cache)."""
    num_layers: int | None = Field(default=None, ge=1)
    """Decoder layers (with the four sizes below: needed to price a parallel trainer layout, [trainer])."""
    hidden_size: int | None = Field(default=None, ge=1)
    """Hidden size."""
    intermediate_size: int | None = Field(default=None, ge=1)
    """MLP intermediate size."""
    num_attention_heads: int | None = Field(default=None, ge=1)
    """Attention heads."""
    num_key_value_heads: int | None = Field(default=None, ge=1)
    """Key/value heads."""

    def layer_shape(self) -> LayerShape | None:
        """The layer sizes, when all five are given."""
        sizes = (
            self.num_layers,
            self.hidden_size,
            self.intermediate_size,
            self.num_attention_heads,
            self.num_key_value_heads,
        )
        if any(size is None for size in sizes):
            return None
        layers, hidden, intermediate, heads, kv_heads = (int(size or 0) for size in sizes)
        return LayerShape(
            num_layers=layers,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
        )


class TrainerLayoutSection(Section):
    """How the trainer's GPUs split the model (sharpen's ``trainer.parallel``); FSDP2's data shards take the rest
    of cluster.num_trainer_gpus. Any axis above 1 needs the model's layer sizes ([model] num_layers ...)."""

    tp: int = Field(default=1, ge=1)
    """Tensor-parallel GPUs (inside one node)."""
    tp_plan: Literal["gather", "rowwise"] = "gather"
    """sharpen's plans (docs/parallelism.md): which collectives each layer runs."""
    pp: int = Field(default=1, ge=1)
    """Pipeline stages."""
    pp_stages_per_rank: int = Field(default=1, ge=1)
    """Virtual stages per GPU (interleaved 1F1B; 1: plain 1F1B)."""
    micro_batches: int = Field(default=8, ge=1)
    """Micro-batches per optimizer step (the pipeline's bubble shrinks as they grow)."""
    cp: int = Field(default=1, ge=1)
    """Context-parallel (Ulysses) GPUs."""
    sequence_parallel: bool = True
    """With tp > 1, the norms' activations split over the sequence too (sharpen's default)."""
    activation_checkpointing: bool = False
    """Each layer keeps only its input and recomputes the rest in the backward (sharpen's
    trainer.gradient_checkpointing): far less activation memory, one more forward of compute."""

    @property
    def ranks_per_shard(self) -> int:
        return self.tp * self.pp * self.cp


class ClusterSection(Section):
    gpu: str = "H100"
    """A kind from the table in simulation/hardware.py, or `custom` with [cluster.custom_gpu]."""
    custom_gpu: CustomGpu | None = None
    """The device's figures when `gpu = "custom"`."""
    num_engine_gpus: int = Field(ge=1)
    """GPUs running inference engines."""
    num_trainer_gpus: int = Field(ge=1)
    """GPUs running trainer ranks (colocated: the same GPUs as the engines, so equal to num_engine_gpus)."""
    gpus_per_engine: int = Field(default=1, ge=1)
    """Tensor-parallel size of one engine replica."""
    placement: Literal["disaggregated", "colocated"] = "disaggregated"
    """`colocated`: engines and trainer take turns on the same GPUs (the engine sleeps while the trainer steps)."""
    max_sequences_per_engine: int | None = Field(default=None, ge=1)
    """Concurrent sequences per replica; unset: as many as the KV cache holds at the mean context length."""
    memory_utilization: float = Field(default=0.85, gt=0.0, le=1.0)
    """Fraction of device memory an engine uses for weights and KV cache."""

    def gpu_kind(self) -> GpuKind:
        if self.gpu == "custom":
            assert self.custom_gpu is not None  # checked by the validator
            spec = self.custom_gpu
            return GpuKind(
                name="custom",
                peak_flops=spec.peak_tflops * 1e12,
                memory_bandwidth=spec.memory_bandwidth_gbps * 1e9,
                memory_bytes=spec.memory_gib * 2**30,
            )
        return GPU_KINDS[self.gpu]

    @model_validator(mode="after")
    def _check(self) -> ClusterSection:
        if self.gpu != "custom" and self.gpu not in GPU_KINDS:
            raise ValueError(f"gpu {self.gpu!r} is not known; choose one of {sorted(GPU_KINDS)} or 'custom'")
        if self.gpu == "custom" and self.custom_gpu is None:
            raise ValueError("gpu = 'custom' needs a [cluster.custom_gpu] section")
        if self.num_engine_gpus % self.gpus_per_engine:
            raise ValueError(f"num_engine_gpus {self.num_engine_gpus} is not a multiple of {self.gpus_per_engine}")
        if self.placement == "colocated" and self.num_trainer_gpus != self.num_engine_gpus:
            raise ValueError("colocated engines and trainer share GPUs: num_trainer_gpus must equal num_engine_gpus")
        return self


class NetworkSection(Section):
    gpus_per_node: int = Field(default=8, ge=1)
    """GPUs per node: collectives within a node use the intra-node link, across nodes the inter-node one."""
    intra_node_gbps: float = Field(default=400.0, gt=0.0)
    """Per-GPU bandwidth within a node (NVLink), GB/s."""
    inter_node_gbps: float = Field(default=50.0, gt=0.0)
    """Per-GPU bandwidth between nodes (InfiniBand/RoCE), GB/s."""
    latency_us: float = Field(default=10.0, ge=0.0)
    """Latency of one message (the alpha of the alpha-beta model), microseconds."""
    algorithm: Literal["ring", "tree"] = "ring"
    """Broadcast of the weights to the engines: a pipelined ring (chain) or a binary tree."""
    bucket_mb: float = Field(default=128.0, gt=0.0)
    """Weight-sync bucket size, MiB (the ring pipelines buckets)."""


class WorkloadSection(Section):
    prompts_per_step: int = Field(ge=1)
    """Prompts per training batch."""
    samples_per_prompt: int = Field(default=1, ge=1)
    """Responses per prompt (the group size)."""
    prompt_tokens: Distribution
    """Prompt length, tokens."""
    response_tokens: Distribution
    """Response length, tokens, summed over turns; `max` is the generation limit."""
    num_turns: int = Field(default=1, ge=1)
    """Engine turns per episode; between two turns the episode waits for the environment fleet."""


class RolloutSection(Section):
    mode: Literal["sync", "async"] = "sync"
    """`async` generates later batches while the trainer trains, up to `max_staleness` versions ahead."""
    max_staleness: int = Field(default=1, ge=0)
    """Batch s starts generating once version s - max_staleness is published (async only; 0 is sync)."""
    continuous_batching: bool = False
    """Let the next admitted batch fill engine slots while the current batch's tail runs (AReaL-style);
    sharpen today starts a batch only when the previous one has finished generating."""


class CostsSection(Section):
    """Efficiencies that turn peaks into rates, and measured costs that replace the model where given."""

    decode_bandwidth_efficiency: float = Field(default=0.6, gt=0.0, le=1.0)
    """Fraction of memory bandwidth one decode round achieves (weights + KV cache read once per round)."""
    decode_round_overhead_s: float = Field(default=0.0, ge=0.0)
    """Fixed seconds per decode round (scheduler, sampling, kernel launches)."""
    prefill_mfu: float = Field(default=0.5, gt=0.0, le=1.0)
    """Model FLOP utilisation of prefill."""
    train_mfu: float = Field(default=0.35, gt=0.0, le=1.0)
    """Model FLOP utilisation of the trainer."""
    train_flops_per_token: float = Field(default=6.0, gt=0.0)
    """FLOPs per parameter per trained token (6 = forward + backward; 8 adds a logprob recompute)."""
    decode_round_seconds: float | None = Field(default=None, gt=0.0)
    """Measured seconds of one decode round (replaces the bandwidth model)."""
    decode_round_seconds_per_sequence: float = Field(default=0.0, ge=0.0)
    """Measured extra seconds per concurrent sequence in a round (with `decode_round_seconds`)."""
    train_seconds_per_step: float | None = Field(default=None, gt=0.0)
    """Measured trainer seconds per step (replaces the FLOP model)."""
    sync_seconds: float | None = Field(default=None, ge=0.0)
    """Measured weight-sync seconds (replaces the alpha-beta model)."""
    step_overhead_s: float = Field(default=0.0, ge=0.0)
    """Seconds per step on the trainer's critical path besides training (advantages, packing, logging)."""
    sleep_wake_seconds: float = Field(default=0.0, ge=0.0)
    """Colocated only: seconds to put engines to sleep and wake them, per step."""


class FleetSection(Section):
    num_workers: int = Field(default=0, ge=0)
    """Workers serving the fleet (0: the fleet is not modelled, calls take no time)."""
    service_seconds: Distribution = Distribution(median=0.0)
    """Seconds one call takes on a worker."""


class FailuresSection(Section):
    engine_mtbf_hours: float | None = Field(default=None, gt=0.0)
    """Mean time between failures of one engine replica (exponential); its running sequences restart."""
    restart_seconds: float = Field(default=60.0, ge=0.0)
    """Seconds a failed replica is down."""
    straggler_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    """Fraction of engine replicas and trainer GPUs that are slow."""
    straggler_slowdown: float = Field(default=1.0, ge=1.0)
    """How many times slower a straggler is."""


class SimulationSection(Section):
    num_steps: int = Field(default=12, ge=1)
    """Training steps to simulate."""
    warmup_steps: int = Field(default=2, ge=0)
    """Steps left out of the steady-state step time (the pipeline filling)."""
    seed: int = 0
    """Seed of every random draw (lengths, service times, failures, stragglers)."""


class Scenario(Section):
    name: str = "scenario"
    """Shown in the report."""
    model: ModelSection
    cluster: ClusterSection
    network: NetworkSection = NetworkSection()
    workload: WorkloadSection
    rollout: RolloutSection = RolloutSection()
    costs: CostsSection = CostsSection()
    trainer: TrainerLayoutSection = TrainerLayoutSection()
    """The trainer's parallel layout (all 1: FSDP2 alone)."""
    environment: FleetSection = FleetSection()
    """Serves the environment step between two turns."""
    reward: FleetSection = FleetSection()
    """Scores each finished episode."""
    failures: FailuresSection = FailuresSection()
    simulation: SimulationSection = SimulationSection()

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        if self.rollout.mode == "async" and self.cluster.placement == "colocated":
            raise ValueError("async mode needs disaggregated placement: colocated engines and trainer take turns")
        if self.simulation.warmup_steps >= self.simulation.num_steps:
            raise ValueError("simulation.warmup_steps must be below simulation.num_steps")
        check_layout(self.trainer, self.model.layer_shape(), num_gpus=self.cluster.num_trainer_gpus)
        return self

    @property
    def staleness(self) -> int:
        return self.rollout.max_staleness if self.rollout.mode == "async" else 0


def check_layout(layout: TrainerLayoutSection, shape: LayerShape | None, *, num_gpus: int) -> None:
    """Raise ValueError (one line) unless ``layout`` divides ``num_gpus`` and the model's sizes."""
    if num_gpus % layout.ranks_per_shard:
        raise ValueError(
            f"trainer: tp {layout.tp} x pp {layout.pp} x cp {layout.cp} = {layout.ranks_per_shard} does not divide "
            f"cluster.num_trainer_gpus = {num_gpus}"
        )
    if layout.ranks_per_shard == 1:
        return
    if shape is None:
        raise ValueError(
            "trainer: a parallel layout needs the model's layer sizes (model.num_layers, hidden_size, "
            "intermediate_size, num_attention_heads, num_key_value_heads)"
        )
    if shape.num_attention_heads % (layout.tp * layout.cp) or shape.num_key_value_heads % layout.tp:
        raise ValueError(
            f"trainer: {shape.num_attention_heads} heads / {shape.num_key_value_heads} key/value heads do not "
            f"divide by tp x cp = {layout.tp * layout.cp} / tp = {layout.tp}"
        )
    if layout.pp * layout.pp_stages_per_rank > shape.num_layers:
        raise ValueError(
            f"trainer: {layout.pp * layout.pp_stages_per_rank} pipeline stages for {shape.num_layers} layers"
        )
    if layout.pp > 1 and layout.micro_batches < layout.pp:
        raise ValueError(f"trainer: {layout.micro_batches} micro-batches for pp {layout.pp}: need at least pp")


def parse_scenario(data: dict[str, object]) -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as error:
        raise ScenarioError("; ".join(_describe(item) for item in error.errors())) from None


def _describe(item: object) -> str:
    assert isinstance(item, dict)
    key = ".".join(str(part) for part in item["loc"]) or "<scenario>"
    if item["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    message = str(item["msg"]).removeprefix("Value error, ")
    return f"{key}: {message}"


def load_scenario(path: Path) -> Scenario:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"scenario {str(path)!r} does not exist") from None
    except OSError as error:
        raise ScenarioError(f"scenario {str(path)!r} cannot be read: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ScenarioError(f"scenario {str(path)!r} is not valid TOML: {error}") from None
    scenario = parse_scenario(data)
    return scenario if "name" in data else scenario.model_copy(update={"name": path.stem})
