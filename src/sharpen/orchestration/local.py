"""The embedded runtime: build every component in this process (the engine's own workers may be child
processes), wire them into `Components`, and run the loop; handles the run directory, resume and export.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sharpen.config import SharpenConfig, dump_config
from sharpen.config.loader import ConfigError
from sharpen.config.models import resolve_model_path
from sharpen.data import ExampleSampler, load_examples, render_prompt
from sharpen.data.humaneval import humaneval_examples
from sharpen.environments import EnvironmentFactory
from sharpen.environments.registry import build_environment_factory, build_sandbox, environment_tasks, episode_limits
from sharpen.environments.sandbox import Sandbox, SandboxPool
from sharpen.monitoring import ParityProbe, RolloutRecorder, Timeline, build_probe_set, build_sinks, build_timeline
from sharpen.orchestration.buffer import ProducedBatch
from sharpen.orchestration.checkpoint import latest_checkpoint, load_checkpoint
from sharpen.orchestration.loop import Components, run_loop
from sharpen.orchestration.phases import WeightSync
from sharpen.rewards import RewardFn, Rubric
from sharpen.rewards.code_tests import HumanEvalReward, pytest_ro_binds
from sharpen.rollout.engines import InferenceEngine, build_engine
from sharpen.rollout.engines.router import EngineRouter
from sharpen.trainer import ReferencePolicy, SingleDeviceBackend, Trainer, ValueModel
from sharpen.trainer.backends.base import TrainerBackend
from sharpen.types import Example

logger = logging.getLogger(__name__)


def load_run_examples(config: SharpenConfig) -> list[Example]:
    """The run's tasks: from its data source, or made by its environment (``data.type = "environment"``)."""
    if config.data.type == "environment":
        return environment_tasks(config.environment, size=config.data.size, seed=config.run.seed)
    if config.data.type == "humaneval":
        return humaneval_examples(config.data.limit)
    return load_examples(config.data, seed=config.run.seed)


def build_reward_fn(config: SharpenConfig, stack: contextlib.ExitStack) -> RewardFn:
    """The run's reward function: the `Rubric`, whose default component is HumanEval's own tests in a sandbox for
    HumanEval data, else the verifier rubric, plus the configured ``reward.components``. Anything it opens (the
    sandbox, reward-model actors) is closed with ``stack``."""
    base = None
    if config.data.type == "humaneval":
        sandbox_config = config.reward.sandbox.model_copy(
            update={"extra_ro_binds": [*config.reward.sandbox.extra_ro_binds, *pytest_ro_binds()]}
        )
        base = HumanEvalReward(stack.enter_context(Sandbox(sandbox_config)))
    started: dict[str, RewardFn] = {}
    for component in config.reward.components:
        if component.type == "reward_model" and component.backend == "ray":
            from sharpen.orchestration.ray.reward_actors import start_reward_model_pool  # needs ray only here

            started[component.name] = start_reward_model_pool(component, runtime=config.runtime, stack=stack)
    count_tokens = None
    if any(c.type == "length" and c.unit == "tokens" for c in config.reward.components):
        tokenizer = load_tokenizer(resolve_model_path(config.model.path))
        count_tokens = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    return Rubric(config.reward, base=base, components=started, count_tokens=count_tokens)


def prepare_run_dir(config: SharpenConfig, *, resume: bool) -> tuple[Path, Path | None]:
    """The run directory, and the checkpoint to resume from (None for a fresh run)."""
    run_dir = Path(config.run.output_dir) / config.run.name
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if resume and checkpoint is None:
        raise ConfigError(f"--resume: {run_dir} has no checkpoint to resume from")
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"run directory {run_dir} already holds a run; pass --resume or choose another run.name")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, checkpoint


def load_tokenizer(model_path: Path) -> Any:
    """The model folder's tokenizer (and chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def build_run_engine(config: SharpenConfig, *, model_path: Path, tokenizer: Any, device: str) -> InferenceEngine:
    """The recipe's inference engine (rollout.engine) on ``model_path``, behind a router when rollout.num_engines
    asks for replicas; ``device`` is used by the hf engine."""
    replicas = [
        build_engine(
            config.rollout.engine,
            model_path=model_path,
            dtype=config.model.dtype,
            seed=config.run.seed,
            device=device,
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
            eos_token_id=tokenizer.eos_token_id,
            bucket_bytes=config.weight_sync.bucket_mb << 20,
            sleep_mode=config.runtime.colocate,
        )
        for _ in range(config.rollout.num_engines)
    ]
    return replicas[0] if len(replicas) == 1 else EngineRouter(replicas)


def build_trainer(
    config: SharpenConfig, *, model_path: Path, tokenizer: Any, backend: TrainerBackend | None = None
) -> Trainer:
    """The recipe's trainer: the policy ``backend`` (default: one device), and the reference policy and critic
    when the algorithm needs them."""
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    backend = backend or SingleDeviceBackend(config.trainer, model_path=model_path, dtype=config.model.dtype)
    reference = None
    if config.trainer.algorithm.kl_coef > 0:
        reference = ReferencePolicy(
            model_path=model_path,
            dtype=config.model.dtype,
            device=backend.device,
            bf16_autocast=config.trainer.bf16_autocast,
        )
    critic = None
    if config.trainer.algorithm.advantage == "gae":
        critic = ValueModel(
            config.trainer.critic,
            model_path=model_path,
            dtype=config.model.dtype,
            device=backend.device,
            bf16_autocast=config.trainer.bf16_autocast,
            gradient_checkpointing=config.trainer.gradient_checkpointing,
            betas=config.trainer.betas,
            weight_decay=config.trainer.weight_decay,
        )
    return Trainer(
        config.trainer,
        backend=backend,
        pad_token_id=pad_token_id,
        temperature=config.rollout.temperature,
        max_new_tokens=config.rollout.max_new_tokens,
        reference=reference,
        critic=critic,
    )


def build_components(
    config: SharpenConfig,
    run_dir: Path,
    *,
    examples: list[Example],
    resume_from_step: int | None,
    reward_fn: RewardFn,
    engine: InferenceEngine | None = None,
    make_environment: EnvironmentFactory | None = None,
    trainer: Trainer | None = None,
) -> Components:
    model_path = resolve_model_path(config.model.path)
    tokenizer = load_tokenizer(model_path)
    trainer = trainer or build_trainer(config, model_path=model_path, tokenizer=tokenizer)
    engine = engine or build_run_engine(
        config, model_path=model_path, tokenizer=tokenizer, device=str(trainer.backend.device)
    )
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
            run_config=config.model_dump(mode="json"),
        ),
        timeline=build_timeline(config.monitoring, run_dir),
        eval_examples=examples[: config.evaluation.num_tasks] if config.evaluation.every_steps else [],
        recorder=RolloutRecorder(
            run_dir / "rollouts.jsonl",
            num_per_step=config.monitoring.num_recorded_rollouts,
            resume_from_step=resume_from_step,
        ),
        make_environment=make_environment or build_environment_factory(config.environment),
        episode_limits=episode_limits(config.environment),
        weight_sync=WeightSync(
            probe_ids=tokenizer.encode(config.weight_sync.probe_text),
            tolerance=config.weight_sync.tolerance,
            verify=config.weight_sync.verify,
        ),
    )


def build_parity_probe(config: SharpenConfig, c: Components, examples: list[Example]) -> ParityProbe | None:
    """The run's parity probes: its first tasks' prompts, completed greedily by the engine once (at the start, or
    at the resumed weights)."""
    monitoring = config.monitoring
    if not monitoring.parity_probe_every:
        return None
    prompts = [render_prompt(c.tokenizer, example.prompt) for example in examples[: monitoring.parity_probe_size]]
    return build_probe_set(prompts, c.engine, max_new_tokens=monitoring.parity_probe_max_new_tokens)


def run_local(
    config: SharpenConfig,
    *,
    resume: bool = False,
    reward_fn: RewardFn | None = None,
    engine: InferenceEngine | None = None,
    trainer: Trainer | None = None,
    attach_timeline: Callable[[Timeline | None], None] | None = None,
) -> Path:
    """Run (or resume) a recipe in this process; returns the run directory.

    ``reward_fn`` replaces the configured rubric (any callable ``(example, completion) -> RewardResult``);
    ``engine`` reuses an engine the caller owns (it is not closed here), e.g. one engine for a test session;
    ``trainer`` likewise (the Ray runtime passes proxies of its actors as both). ``attach_timeline`` is called with
    the run's `Timeline` (None when monitoring.timeline is off) before the first weight sync, and with None before
    the timeline is closed: the Ray runtime adds its actors' spans to it in between.
    """
    # user errors first: before any folder or slow component exists
    resolve_model_path(config.model.path)
    make_environment = build_environment_factory(config.environment)
    examples = load_run_examples(config)
    with contextlib.ExitStack() as stack:
        sandbox = build_sandbox(config.environment)  # probes the host's isolation now
        if sandbox is not None:
            stack.callback(sandbox.close)
        reward_fn = reward_fn or build_reward_fn(config, stack)
        return _run(
            config,
            resume,
            examples,
            make_environment,
            sandbox,
            reward_fn=reward_fn,
            engine=engine,
            trainer=trainer,
            attach_timeline=attach_timeline or (lambda timeline: None),
        )


def _run(
    config: SharpenConfig,
    resume: bool,
    examples: list[Example],
    make_environment: EnvironmentFactory,
    sandbox: SandboxPool | None,
    *,
    reward_fn: RewardFn,
    engine: InferenceEngine | None,
    trainer: Trainer | None,
    attach_timeline: Callable[[Timeline | None], None],
) -> Path:
    run_dir, checkpoint = prepare_run_dir(config, resume=resume)
    (run_dir / "config.toml").write_text(dump_config(config))
    next_step = 0
    if checkpoint is not None:
        next_step = int(checkpoint.name.removeprefix("step_"))
    c = build_components(
        config,
        run_dir,
        examples=examples,
        resume_from_step=next_step - 1 if checkpoint else None,
        reward_fn=reward_fn,
        engine=engine,
        make_environment=make_environment,
        trainer=trainer,
    )
    c.sandbox = sandbox
    attach_timeline(c.timeline)
    try:
        pending: list[ProducedBatch] = []
        if checkpoint is not None:
            next_step, pending = load_checkpoint(checkpoint, trainer=c.trainer, sampler=c.sampler)
            logger.info("resuming %s at step %d", run_dir, next_step)
        # The engine starts from the base model (or a caller's engine from anything): give it the trainer's
        # weights and check them before the first rollout.
        c.weight_sync(c.trainer, c.engine, version=next_step)
        c.parity_probe = build_parity_probe(config, c, examples)
        run_loop(c, start_step=next_step, pending=pending)
        if config.run.export_model:
            c.trainer.export(run_dir / "model")
    finally:
        c.sink.close()
        c.recorder.close()
        attach_timeline(None)
        if c.timeline is not None:
            c.timeline.close()
        if engine is None:
            c.engine.close()
    return run_dir
