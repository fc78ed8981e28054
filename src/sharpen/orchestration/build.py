"""Building: config in, live components out. Every component of a run is built here, the same way whichever runtime
runs it (the Ray actors build their trainer and engine with these functions too).

Owns the mapping from config sections to constructors and the wiring of `Components`. It has no process knowledge:
it does not decide where a component lives (the runtimes do, and hand in the trainer and engine they placed), opens
no run directory and starts no thread.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sharpen.config import ConfigError, SharpenConfig
from sharpen.config.browser import BrowserEnvironmentConfig
from sharpen.config.engines import VllmEngineConfig
from sharpen.config.models import resolve_model_path
from sharpen.data import ExampleSampler, load_examples, render_prompt
from sharpen.data.humaneval import humaneval_examples
from sharpen.data.vision import VisionProcessor, is_vision_model, text_only_error
from sharpen.environments.base import EnvironmentFactory
from sharpen.environments.registry import environment_tasks, episode_limits, open_sandbox, sandbox_for_run
from sharpen.environments.sandbox import SandboxPool
from sharpen.environments.sandbox.remote import RemoteSandboxPool
from sharpen.expert_routes import REPLAY_MODEL_TYPES
from sharpen.monitoring import (
    DIGEST_FILE_NAME,
    ParityProbe,
    RolloutRecorder,
    build_probe_set,
    build_sinks,
    build_timeline,
)
from sharpen.orchestration.handles import TrainerHandle
from sharpen.orchestration.loop import Components
from sharpen.orchestration.weight_sync import WeightSync
from sharpen.rewards import RewardFn, Rubric
from sharpen.rewards.code_tests import HumanEvalReward
from sharpen.rollout.engines import InferenceEngine, build_engine
from sharpen.rollout.engines.router import EngineRouter
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.rollout.weight_sync.verify import FLOAT32_TOLERANCE, ProbeTolerance
from sharpen.trainer import ReferencePolicy, SingleDeviceBackend, Trainer, ValueModel
from sharpen.trainer.algorithms.sampling_mask import SamplingMask
from sharpen.trainer.backends.base import ReferenceScorer, TrainerBackend
from sharpen.trainer.backends.frozen import LoraReferencePolicy
from sharpen.trainer.backends.single_device import resolve_device
from sharpen.trainer.backends.teacher import TeacherPolicy, TeacherPrompt, check_same_vocabulary
from sharpen.trainer.layout import ModelShape
from sharpen.trainer.precision import PrecisionChoice, resolve_precision
from sharpen.types import Example, prompt_images


def load_run_examples(config: SharpenConfig) -> list[Example]:
    """The run's tasks: from its data source, or made by its environment (``data.type = "environment"``); checked
    against the model (`check_image_inputs`) before anything slow is built."""
    if config.data.type == "environment":
        examples = environment_tasks(config.environment, size=config.data.size, seed=config.run.seed)
    elif config.data.type == "humaneval":
        examples = humaneval_examples(config.data.limit)
    else:
        examples = load_examples(config.data, seed=config.run.seed)
    check_image_inputs(config, examples)
    return examples


IMAGE_ENGINE_TYPES = ("hf", "vllm")
"""The engines that generate from image prompts (`ImageEngine`): vLLM's in-process engine for the architectures its
build here can load (`check_vllm_loads`)."""


def check_image_inputs(config: SharpenConfig, examples: list[Example]) -> None:
    """A vision-language model needs an engine that takes images (a `ConfigError` otherwise, whatever the data: the
    other engines' weight sync and generation do not know its vision tower); prompts with images, and a browser that
    shows screenshots, need a vision-language model (the `ImageInputError` of `data.vision.text_only_error`). What the
    trainer cannot do with images yet (packing, a critic, a teacher) it refuses at its first step."""
    model_path = resolve_model_path(config.model.path)
    engine = config.rollout.engine
    if is_vision_model(model_path):
        if engine.type not in IMAGE_ENGINE_TYPES:
            raise ConfigError(
                f'rollout.engine.type = "{engine.type}" cannot run the vision-language model {model_path}; '
                'set rollout.engine.type = "hf" or "vllm" (the engines that generate from image prompts)'
            )
        if isinstance(engine, VllmEngineConfig):
            check_vllm_loads(model_path)
        return
    with_images = next((example for example in examples if prompt_images(example.prompt)), None)
    if with_images is not None:
        raise text_only_error(
            f"task {with_images.task_key}", len(prompt_images(with_images.prompt)), f"model.path {model_path}"
        )
    environment = config.environment
    if isinstance(environment, BrowserEnvironmentConfig) and environment.observation != "text":
        where = f'environment.observation = "{environment.observation}" (browser screenshots)'
        raise text_only_error(where, 1, f"model.path {model_path}")


def check_moe(config: SharpenConfig) -> None:
    """One line (a `ConfigError`) before anything starts when ``trainer.moe`` cannot run: routing replay or load
    balancing on a dense model or a family whose routers sharpen cannot replay, R3 with an engine that returns no
    routes, an expert-bias update on routers without a bias or with LoRA (the bias would not reach the engine), any of
    them with context and pipeline parallelism together (docs/moe.md)."""
    moe = config.trainer.moe
    asked = [
        f"{key} = {value}"
        for key, value, is_on in (
            ("trainer.moe.routing_replay", f'"{moe.routing_replay}"', moe.routing_replay != "none"),
            ("trainer.moe.aux_loss_coef", moe.aux_loss_coef, moe.aux_loss_coef > 0),
            ("trainer.moe.expert_bias_update_rate", moe.expert_bias_update_rate, moe.expert_bias_update_rate > 0),
        )
        if is_on
    ]
    if not asked:
        return
    model_path = resolve_model_path(config.model.path)
    model_config = json.loads((model_path / "config.json").read_text())
    text = model_config.get("text_config") or model_config
    model_type = text.get("model_type", "")
    if not ModelShape.from_hf_config(model_config).num_experts:
        raise ConfigError(f"{asked[0]} needs a Mixture-of-Experts model; {model_path} ({model_type}) is dense")
    if model_type not in REPLAY_MODEL_TYPES:
        raise ConfigError(
            f"{asked[0]}: sharpen knows the routers of {', '.join(REPLAY_MODEL_TYPES)}, not {model_type} ({model_path})"
        )
    cannot = _why_no_engine_routes(config) if moe.routing_replay == "r3" else None
    if cannot is not None:
        raise ConfigError(
            f'trainer.moe.routing_replay = "r3" replays the engine\'s routes, and {cannot}; use rollout.engine.type = '
            '"hf", or r2'
        )
    if moe.expert_bias_update_rate > 0:
        if model_type != "deepseek_v3":
            raise ConfigError(
                f"trainer.moe.expert_bias_update_rate moves DeepSeek-V3's expert bias; {model_type} routers have none"
            )
        if config.trainer.lora.enabled:
            raise ConfigError(
                "trainer.moe.expert_bias_update_rate with trainer.lora: the bias is not an adapter weight and would "
                "not reach the engine; set the rate to 0 or train without LoRA"
            )
    parallel = config.trainer.parallel
    if parallel.pp > 1 and parallel.cp > 1:
        raise ConfigError(
            f"{asked[0]} runs with context or pipeline parallelism, not both yet (trainer.parallel cp = {parallel.cp}, "
            f"pp = {parallel.pp})"
        )


def _why_no_engine_routes(config: SharpenConfig) -> str | None:
    """Why the configured engine returns no expert routes (R3), or None: the `hf` engine always does; vLLM does
    with ``enable_return_routed_experts`` on a GPU, not on its CPU build (docs/moe.md); a vLLM server at a URL is
    trusted to (its first reply without routes is an error); SGLang's routed experts are not read yet."""
    engine = config.rollout.engine
    if engine.type == "hf":
        return None
    if engine.type not in ("vllm", "vllm_server"):
        return f'rollout.engine.type = "{engine.type}" returns none'
    if engine.type == "vllm_server" and engine.url is not None:
        return None
    import torch

    on_gpu = config.runtime.engine_gpus > 0 if config.runtime.type == "ray" else torch.cuda.is_available()
    if on_gpu:
        return None
    return (
        f'rollout.engine.type = "{engine.type}" would run on vLLM\'s CPU build, which cannot return them (its '
        "routed-experts output needs Model Runner V2, which needs Triton: docs/moe.md)"
    )


def check_vllm_loads(model_path: Path) -> None:
    """A `ConfigError` unless the installed vLLM can import its module for the model's architecture (vLLM's CPU build
    here lacks torchvision, which its Qwen2-VL module imports; its Idefics3 module loads)."""
    from sharpen.rollout.engines.vllm import why_vllm_cannot_load

    reason = why_vllm_cannot_load(model_path)
    if reason is not None:
        raise ConfigError(
            f'rollout.engine.type = "vllm" cannot run {reason}; set rollout.engine.type = "hf", or use an '
            "architecture this vLLM loads (e.g. Idefics3)"
        )


def load_vision(config: SharpenConfig) -> VisionProcessor | None:
    """The run model's tokenizer and image processor when it is a vision-language model, else None."""
    model_path = resolve_model_path(config.model.path)
    return VisionProcessor.from_pretrained(model_path) if is_vision_model(model_path) else None


def load_tokenizer(model_path: Path) -> Any:
    """The model folder's tokenizer (and chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def uses_ray_reward_models(config: SharpenConfig) -> bool:
    """Whether a reward component is a reward model served by Ray actors (the runtime starts them)."""
    return any(c.type == "reward_model" and c.backend == "ray" for c in config.reward.components)


def build_reward_fn(
    config: SharpenConfig, stack: contextlib.ExitStack, *, served: Mapping[str, RewardFn] | None = None
) -> RewardFn:
    """The run's reward function: the `Rubric`, whose default component is HumanEval's own tests in a sandbox for
    HumanEval data, else the verifier rubric, plus the configured ``reward.components``. ``served``: components,
    by name, that the runtime started elsewhere (reward models on Ray actors). What it opens (the sandbox) is
    closed with ``stack``."""
    base = None
    if config.data.type == "humaneval":
        base = HumanEvalReward(stack.enter_context(open_sandbox(sandbox_for_run(config))))  # pytest bound in
    count_tokens = None
    if any(c.type == "length" and c.unit == "tokens" for c in config.reward.components):
        tokenizer = load_tokenizer(resolve_model_path(config.model.path))
        count_tokens = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    return Rubric(config.reward, base=base, components=dict(served or {}), count_tokens=count_tokens)


def run_precision(config: SharpenConfig) -> PrecisionChoice:
    """trainer.precision resolved on the trainer's device with its threads: probed once per process, so the
    trainer, the engine and the weight sync's tolerance built in one process follow one choice. (In the Ray
    runtime each actor resolves "auto" on its own machine.)"""
    trainer = config.trainer
    return resolve_precision(
        trainer.precision, resolve_device(trainer.device), num_threads=trainer.resolved_num_threads
    )


def probe_tolerance(config: SharpenConfig) -> ProbeTolerance:
    """The weight-sync check's bound: weight_sync.tolerance when set, else 1e-3 when the engine and the trainer's
    probe both compute in float32, and measured at the first sync when either is in bfloat16 or float16 (the
    engine's dtype; master weights in bfloat16; FSDP2 computes in bf16 or fp16 parameters under bf16 or fp16)."""
    tolerance = config.weight_sync.tolerance
    if tolerance != "auto":
        return ProbeTolerance(fixed=tolerance)
    precision = run_precision(config).precision
    is_engine_bf16 = config.model.engine_dtype(precision) != "float32"  # bfloat16 or float16
    is_probe_bf16 = config.model.master_dtype == "bfloat16" or (
        precision != "float32" and config.runtime.trainer_ranks > 1
    )
    return ProbeTolerance() if is_engine_bf16 or is_probe_bf16 else ProbeTolerance(fixed=FLOAT32_TOLERANCE)


def build_run_engine(config: SharpenConfig, *, model_path: Path, tokenizer: Any, device: str) -> InferenceEngine:
    """The recipe's inference engine (rollout.engine) on ``model_path``, behind a router (with rollout.failover)
    when rollout.num_engines asks for replicas; ``device`` is used by the hf engine."""
    replicas = [
        build_engine(
            config.rollout.engine,
            model_path=model_path,
            dtype=config.model.engine_dtype(run_precision(config).precision),
            seed=config.run.seed,
            device=device,
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
            eos_token_id=tokenizer.eos_token_id,
            bucket_bytes=config.weight_sync.bucket_mb << 20,
            sleep_mode=config.runtime.colocate,
            request_timeout_s=config.rollout.request_timeout_s,
            log_dir=Path(config.run.output_dir) / config.run.name / "engine-logs",
            lora=config.trainer.lora if config.trainer.lora.syncs_adapter else None,
            route_experts=_route_experts(config, model_path),
            lm_head_float32=config.trainer.lm_head_float32,
        )
        for _ in range(config.rollout.num_engines)
    ]
    return replicas[0] if len(replicas) == 1 else EngineRouter(replicas, failover=config.rollout.failover)


def _route_experts(config: SharpenConfig, model_path: Path) -> int | None:
    """The model's routed experts per layer when the engine must return each completion's routes (R3), else None."""
    if config.trainer.moe.routing_replay != "r3":
        return None
    return ModelShape.from_hf_config(json.loads((model_path / "config.json").read_text())).num_experts or None


def _sharded_reference(config: SharpenConfig, *, model_path: Path, backend: TrainerBackend) -> ReferenceScorer:
    """The reference policy of a sharded trainer, split by its backend's layout (imported here: FSDP2's packages
    cost ~1 s to import)."""
    from sharpen.trainer.backends.fsdp2 import FSDP2Backend
    from sharpen.trainer.backends.sharded_reference import ShardedReference

    if not isinstance(backend, FSDP2Backend):
        raise TypeError(f"runtime.trainer_ranks > 1 trains with FSDP2Backend, not {type(backend).__name__}")
    return ShardedReference(
        config.trainer,
        model_path=model_path,
        dtype=config.model.master_dtype,
        layout=backend.layout,
        seed=config.run.seed,
    )


def build_trainer(
    config: SharpenConfig, *, model_path: Path, tokenizer: Any, backend: TrainerBackend | None = None
) -> Trainer:
    """The recipe's trainer: the policy ``backend`` (default: one device), and the reference policy and critic
    when the algorithm needs them."""
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    backend = backend or SingleDeviceBackend(config.trainer, model_path=model_path, dtype=config.model.master_dtype)
    precision = run_precision(config).precision
    reference: ReferenceScorer | None = None
    lora = backend.lora if isinstance(backend, SingleDeviceBackend) else None  # set when trainer.lora.enabled
    needs_reference = config.trainer.algorithm.kl.needs_reference
    if needs_reference and isinstance(backend, SingleDeviceBackend) and lora is not None:
        reference = LoraReferencePolicy(  # no second model copy
            lora,
            device=backend.device,
            precision=precision,
            vision=backend.vision,
            model_path=model_path,
            router=backend.router,
        )
    elif needs_reference and config.runtime.trainer_ranks > 1:  # split like the policy, not a copy a rank
        reference = _sharded_reference(config, model_path=model_path, backend=backend)
    elif needs_reference:
        reference = ReferencePolicy(
            model_path=model_path,
            dtype=config.model.master_dtype,
            device=backend.device,
            precision=precision,
            replay_routes=config.trainer.moe.routing_replay != "none",
            router_float32=config.trainer.moe.router_float32,
        )
    critic = None
    if config.trainer.algorithm.advantage.needs_critic:
        critic = ValueModel(
            config.trainer.critic,
            model_path=model_path,
            dtype=config.model.master_dtype,
            device=backend.device,
            precision=precision,
            gradient_checkpointing=config.trainer.gradient_checkpointing,
            betas=config.trainer.betas,
            weight_decay=config.trainer.weight_decay,
        )
    return Trainer(
        config.trainer,
        backend=backend,
        pad_token_id=pad_token_id,
        temperature=config.rollout.temperature,
        sampling_mask=SamplingMask(top_k=config.rollout.top_k, top_p=config.rollout.top_p),
        max_new_tokens=config.rollout.max_new_tokens,
        reference=reference,
        critic=critic,
        teacher=build_teacher(config, model_path=model_path, tokenizer=tokenizer, backend=backend),
    )


def build_teacher(
    config: SharpenConfig, *, model_path: Path, tokenizer: Any, backend: TrainerBackend
) -> TeacherPolicy | None:
    """The distillation teacher (``trainer.distillation``): frozen, on the policy's device, from teacher_path (or
    the student's own folder), seeing the teacher_prompt when one is set; None when distillation is off."""
    distillation = config.trainer.distillation
    if not distillation.enabled:
        return None
    teacher_path = resolve_model_path(distillation.teacher_path) if distillation.teacher_path else model_path
    check_same_vocabulary(model_path, teacher_path)
    prompt = None
    if distillation.teacher_prompt is not None:
        prompt = TeacherPrompt(distillation.teacher_prompt, render=lambda messages: render_prompt(tokenizer, messages))
    return TeacherPolicy(
        model_path=teacher_path,
        dtype=config.model.master_dtype,
        device=backend.device,
        precision=run_precision(config).precision,
        prompt=prompt,
        temperature=distillation.teacher_temperature,
    )


def build_episode_runner(
    config: SharpenConfig,
    *,
    tokenizer: Any,
    sandbox: SandboxPool | RemoteSandboxPool | None,
    make_environment: EnvironmentFactory,
) -> EpisodeRunner:
    """The run's episode runner: its environment factory (the caller's: it closes it), limits and sandbox;
    environments are seeded from the run seed. A vision-language model's prompts with images are rendered by its
    `VisionProcessor` (`load_vision`)."""
    return EpisodeRunner(
        tokenizer=tokenizer,
        make_environment=make_environment,
        limits=episode_limits(config.environment),
        episode_seed=config.run.seed,
        sandbox=sandbox,
        scheduling=config.rollout.episode_scheduling,
        max_concurrent=config.rollout.max_concurrent_episodes,
        request_timeout_s=config.rollout.request_timeout_s,
        episode_timeout_s=config.rollout.episode_timeout_s,
        vision=load_vision(config),
    )


def build_components(
    config: SharpenConfig,
    run_dir: Path,
    *,
    examples: list[Example],
    resume_from_step: int | None,
    tokenizer: Any,
    trainer: TrainerHandle,
    engine: InferenceEngine,
    reward_fn: RewardFn,
    runner: EpisodeRunner,
) -> Components:
    """Everything the loop drives, around the trainer and engine the runtime placed. The trainer's precision choice
    is written to ``run_dir/precision.json`` and given to the trackers with the config."""
    precision = run_precision(config)
    (run_dir / "precision.json").write_text(json.dumps(precision.to_dict(), indent=2) + "\n")
    return Components(
        config=config,
        run_dir=run_dir,
        tokenizer=tokenizer,
        engine=engine,
        trainer=trainer,
        sampler=ExampleSampler(examples, seed=config.run.seed),
        rubric=reward_fn,
        sink=build_sinks(
            config.monitoring,
            run_dir,
            num_steps=config.run.num_steps,
            resume_from_step=resume_from_step,
            run_config={**config.model_dump(mode="json"), "precision_choice": precision.to_dict()},
        ),
        timeline=build_timeline(config.monitoring, run_dir),
        eval_examples=examples[: config.evaluation.num_tasks] if config.evaluation.every_steps else [],
        recorder=RolloutRecorder(
            run_dir / "rollouts.jsonl",
            num_per_step=config.monitoring.num_recorded_rollouts,
            resume_from_step=resume_from_step,
            digest_path=run_dir / DIGEST_FILE_NAME,
        ),
        runner=runner,
        weight_sync=WeightSync(
            probe_ids=tokenizer.encode(config.weight_sync.probe_text),
            tolerance=probe_tolerance(config),
            verify=config.weight_sync.verify,
        ),
    )


def build_parity_probe(config: SharpenConfig, components: Components, examples: list[Example]) -> ParityProbe | None:
    """The run's parity probes: its first tasks' prompts, completed greedily by the engine once (at the start, or
    at the resumed weights). Prompts with images are rendered as the episode runner renders them (its
    `VisionProcessor`) and carry their images to the engine and the trainer."""
    monitoring = config.monitoring
    if not monitoring.parity_probe_every:
        return None
    probed = examples[: monitoring.parity_probe_size]
    images = [prompt_images(example.prompt) for example in probed]
    vision = components.runner.vision
    prompts = [
        vision.render_prompt(example.prompt)
        if vision is not None and found
        else render_prompt(components.tokenizer, example.prompt)
        for example, found in zip(probed, images, strict=True)
    ]
    return build_probe_set(
        prompts,
        components.engine,
        max_new_tokens=monitoring.parity_probe_max_new_tokens,
        images=images if any(images) else None,
    )
