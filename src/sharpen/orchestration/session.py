"""One run, from a recipe to its run directory, around a trainer and an engine that a runtime placed.

Owns what every runtime does the same way: user errors first (model, environment, data) before anything slow,
the run directory and its resolved config, resume from the last checkpoint, the first weight sync, the parity
probe set, the loop, the exported model, and closing what the run opened. Where the trainer and the engine live is
the runtime's choice, handed in as ``place``; the session never knows whether they are objects in this process or
proxies of Ray actors.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sharpen.config import SharpenConfig, dump_config
from sharpen.config.loader import ConfigError
from sharpen.config.models import resolve_model_path
from sharpen.environments.registry import build_environment_factory, build_sandbox, close_environment_factory
from sharpen.monitoring import Timeline
from sharpen.orchestration.batches import ProducedBatch
from sharpen.orchestration.build import (
    build_components,
    build_episode_runner,
    build_parity_probe,
    build_reward_fn,
    check_moe,
    load_run_examples,
    load_tokenizer,
    uses_ray_reward_models,
)
from sharpen.orchestration.checkpoint import latest_checkpoint, load_checkpoint
from sharpen.orchestration.handles import TrainerHandle
from sharpen.orchestration.loop import run_loop
from sharpen.rewards import RewardFn
from sharpen.rollout.engines import InferenceEngine

logger = logging.getLogger(__name__)

Place = Callable[[Path, Any], tuple[TrainerHandle, InferenceEngine]]
"""``place(model_path, tokenizer) -> (trainer, engine)``: the runtime's trainer and engine for this run."""

ServeRewards = Callable[[contextlib.ExitStack], Mapping[str, RewardFn]]
"""``serve(stack)``: the reward components the runtime serves elsewhere (Ray actors), by name; closed by ``stack``."""


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


def run_session(
    config: SharpenConfig,
    *,
    place: Place,
    resume: bool = False,
    reward_fn: RewardFn | None = None,
    serve_rewards: ServeRewards | None = None,
    attach_timeline: Callable[[Timeline | None], None] | None = None,
) -> Path:
    """Run (or resume) ``config`` with the trainer and engine ``place`` gives; returns the run directory.

    ``reward_fn`` replaces the configured rubric (any callable ``(example, completion) -> RewardResult``);
    ``serve_rewards`` starts the reward models the recipe serves on Ray actors (needed only when it asks for them).
    ``attach_timeline`` is called with the run's `Timeline` (None when monitoring.timeline is off) before the first
    weight sync, and with None before the timeline is closed: the Ray runtime adds its actors' spans in between."""
    attach = attach_timeline or (lambda timeline: None)
    # user errors first: before any folder or slow component exists
    model_path = resolve_model_path(config.model.path)
    make_environment = build_environment_factory(config.environment)
    with contextlib.ExitStack() as stack:
        stack.callback(close_environment_factory, make_environment)  # its browsers, its replica client
        examples = load_run_examples(config)
        check_moe(config)
        sandbox = build_sandbox(config.environment, config.sandbox)  # probes the host's isolation now
        if sandbox is not None:
            stack.callback(sandbox.close)
        if reward_fn is None:
            served: Mapping[str, RewardFn] = {}
            if uses_ray_reward_models(config):
                if serve_rewards is None:
                    raise ConfigError("this runtime cannot serve reward models on Ray actors (reward.components)")
                served = serve_rewards(stack)
            reward_fn = build_reward_fn(config, stack, served=served)
        run_dir, checkpoint = prepare_run_dir(config, resume=resume)
        (run_dir / "config.toml").write_text(dump_config(config))
        next_step = 0 if checkpoint is None else int(checkpoint.name.removeprefix("step_"))
        tokenizer = load_tokenizer(model_path)
        trainer, engine = place(model_path, tokenizer)
        components = build_components(
            config,
            run_dir,
            examples=examples,
            resume_from_step=next_step - 1 if checkpoint else None,
            tokenizer=tokenizer,
            trainer=trainer,
            engine=engine,
            reward_fn=reward_fn,
            runner=build_episode_runner(
                config, tokenizer=tokenizer, sandbox=sandbox, make_environment=make_environment
            ),
        )
        attach(components.timeline)
        try:
            pending: list[ProducedBatch] = []
            if checkpoint is not None:
                next_step, pending = load_checkpoint(checkpoint, trainer=components.trainer, sampler=components.sampler)
                logger.info("resuming %s at step %d", run_dir, next_step)
            # The engine starts from the base model (or a caller's engine from anything): give it the trainer's
            # weights and check them before the first rollout.
            components.weight_sync(components.trainer, components.engine, version=next_step)
            components.parity_probe = build_parity_probe(config, components, examples)
            run_loop(components, start_step=next_step, pending=pending)
            if config.run.export_model:
                components.trainer.export(run_dir / "model")
        finally:
            components.sink.close()
            components.recorder.close()
            attach(None)
            if components.timeline is not None:
                components.timeline.close()
    return run_dir
