"""One run, from a recipe to its run directory, around a trainer and an engine that a runtime placed.

Owns what every runtime does the same way: user errors first (model, environment, data) before anything slow, the run
directory and its resolved config, where the run starts (`choose_start`: from step 0 or the newest complete checkpoint,
as ``--resume`` asks), the first weight sync, the parity probe set, the loop, the exported model, and closing what the
run opened; the rollbacks the stability guards ask for (`roll_back`: the newest complete checkpoint restored in this
process, by the same `load_checkpoint` as a resume); and the restart of a run that lost a component (`run_restarting`:
the runtime's attempt again, resumed the ``--resume auto`` way, at most ``runtime.max_restarts`` times). Where the
trainer and the engine live is the runtime's choice, handed in as ``place``; the session never knows whether they are
objects in this process or proxies of Ray actors.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sharpen.config import SharpenConfig, dump_config
from sharpen.config.loader import ConfigError
from sharpen.config.models import resolve_model_path
from sharpen.environments.registry import build_environment_factory, build_sandbox, close_environment_factory
from sharpen.monitoring import Timeline
from sharpen.monitoring.guards import Rollback
from sharpen.monitoring.health import record_rollback
from sharpen.monitoring.run_log import LOG_FILE_NAME
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
from sharpen.orchestration.checkpoint import (
    CheckpointError,
    CheckpointScan,
    checkpoint_home,
    export_model,
    latest_checkpoint,
    load_checkpoint,
    scan_checkpoints,
)
from sharpen.orchestration.handles import TrainerHandle
from sharpen.orchestration.loop import Components, run_loop
from sharpen.orchestration.object_store import StoreFolder
from sharpen.rewards import RewardFn
from sharpen.rollout.engines import InferenceEngine

logger = logging.getLogger(__name__)

Place = Callable[[Path, Any], tuple[TrainerHandle, InferenceEngine]]
"""``place(model_path, tokenizer) -> (trainer, engine)``: the runtime's trainer and engine for this run."""

ServeRewards = Callable[[contextlib.ExitStack], Mapping[str, RewardFn]]
"""``serve(stack)``: the reward components the runtime serves elsewhere (Ray actors), by name; closed by ``stack``."""


Resume = bool | Literal["auto"]
"""Where a run starts: False, a fresh run (refused when the run directory already holds steps); True (``--resume``),
the newest complete checkpoint (refused when there is none); ``"auto"`` (``--resume auto``), the newest complete
checkpoint when there is one, else from step 0 (`choose_start`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunStart:
    """Where a run starts: from ``checkpoint``, or from step 0 (None); ``set_aside``: first move the files of an
    earlier attempt that left steps but no complete checkpoint to ``run_dir/attempts/N`` (`set_aside_attempt`)."""

    checkpoint: Path | StoreFolder | None = None
    set_aside: bool = False


def choose_start(
    resume: Resume, *, run_dir: Path, holds_steps: bool, scan: CheckpointScan, home: Path | StoreFolder | None = None
) -> RunStart:
    """The rule of where a run starts, from what its run directory holds (``holds_steps``: it has ``metrics.jsonl``;
    ``scan``: its checkpoints, under ``home``, the run directory unless they are in an object store); raises
    `ConfigError` when ``resume`` cannot be honoured. Pure: decides, moves nothing."""
    skipped = f" (incomplete: {'; '.join(scan.skipped)})" if scan.skipped else ""
    if resume is False:
        if holds_steps:
            raise ConfigError(
                f"run directory {run_dir} already holds a run; pass --resume (or --resume auto) or choose another "
                "run.name"
            )
        return RunStart()
    if scan.latest is not None:
        return RunStart(checkpoint=scan.latest)
    if resume is True:
        raise ConfigError(f"--resume: {home or run_dir} has no complete checkpoint to resume from{skipped}")
    return RunStart(set_aside=holds_steps)


def run_restarting(
    config: SharpenConfig,
    attempt: Callable[[Resume], Path],
    *,
    resume: Resume,
    lost: Callable[[BaseException], str | None],
) -> Path:
    """``attempt(resume)`` (one run of a runtime: its components placed, `run_session`, torn down); after an attempt
    that failed because the runtime lost a component (``lost(error)`` says which and how, e.g. "ray actor 'trainer
    rank 1' died during step()"; None for any other error, which ends the run), ``attempt("auto")`` again: the run
    continues from its newest complete checkpoint (`choose_start`), at most ``runtime.max_restarts`` times, each
    restart announced in one line of the log. Past that the last attempt's error ends the run."""
    max_restarts = config.runtime.max_restarts
    restart = 0
    while True:
        try:
            return attempt(resume)
        except Exception as error:
            what = lost(error)
            if what is None or max_restarts == 0:
                raise
            done, start = _progress(config)
            if restart == max_restarts:
                logger.error(
                    "%s with %d step(s) done; no restart left (runtime.max_restarts = %d)", what, done, restart
                )
                raise
            restart += 1
            logger.warning(
                "%s with %d step(s) done; restart %d of %d from %s", what, done, restart, max_restarts, start
            )
            resume = "auto"


def _progress(config: SharpenConfig) -> tuple[int, str]:
    """How far an interrupted attempt got: the steps its metrics record, and where a resume starts (the newest
    complete checkpoint, or step 0)."""
    run_dir = run_directory(config)
    metrics = run_dir / "metrics.jsonl"
    done = metrics.read_text(encoding="utf-8").count("\n") if metrics.exists() else 0
    latest = scan_checkpoints(checkpoint_home(config.run, run_dir)).latest
    return done, "step 0 (no complete checkpoint)" if latest is None else f"the checkpoint {latest.name}"


def run_directory(config: SharpenConfig) -> Path:
    return Path(config.run.output_dir) / config.run.name


def prepare_run_dir(config: SharpenConfig, *, resume: Resume) -> tuple[Path, Path | StoreFolder | None]:
    """The run directory, and the checkpoint to resume from (None for a run from step 0), on the disk or in the
    object store (``run.checkpoint_uri``)."""
    run_dir = run_directory(config)
    home = checkpoint_home(config.run, run_dir)
    scan = scan_checkpoints(home) if resume is not False else CheckpointScan()
    holds_steps = (run_dir / "metrics.jsonl").exists()
    start = choose_start(resume, run_dir=run_dir, holds_steps=holds_steps, scan=scan, home=home)
    if start.checkpoint is not None:
        for reason in scan.skipped:
            logger.warning("skipping incomplete checkpoint %s", reason)
    if start.set_aside:
        moved_to = set_aside_attempt(run_dir)
        logger.warning(
            "--resume auto: %s held steps but no complete checkpoint%s; moved them to %s and starting from step 0",
            run_dir,
            f" ({'; '.join(scan.skipped)})" if scan.skipped else "",
            moved_to,
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, start.checkpoint


def set_aside_attempt(run_dir: Path) -> Path:
    """Move everything of ``run_dir`` but the run log (the command appends to it) and earlier set-aside attempts
    into ``run_dir/attempts/N`` (N = 1, 2, ...); returns that folder. Nothing is deleted."""
    attempts = run_dir / "attempts"
    numbers = [int(p.name) for p in attempts.iterdir() if p.name.isdigit()] if attempts.is_dir() else []
    target = attempts / str(max(numbers, default=0) + 1)
    target.mkdir(parents=True)
    for entry in sorted(run_dir.iterdir()):
        if entry.name not in (LOG_FILE_NAME, "attempts"):
            entry.rename(target / entry.name)
    return target


def run_session(
    config: SharpenConfig,
    *,
    place: Place,
    resume: Resume = False,
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
    make_environment = build_environment_factory(config.environment, model_path=model_path)
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
            rollback = run_loop(components, start_step=next_step, pending=pending)
            while rollback is not None:  # bounded: the guards stop the run past monitoring.guards.max_rollbacks
                rollback = run_loop(components, start_step=roll_back(components, rollback), rolled_back=True)
            if config.run.export_model:
                export_model(checkpoint_home(config.run, run_dir), trainer=components.trainer)
        finally:
            components.sink.close()
            components.recorder.close()
            attach(None)
            if components.timeline is not None:
                components.timeline.close()
    return run_dir


def roll_back(components: Components, rollback: Rollback) -> int:
    """Do what a ``rollback`` policy asked (`Rollback`): restore the newest complete checkpoint with the resume's
    `load_checkpoint` (every trainer rank's weights and optimizer state, the RNG states), move the data to after the
    bad step's batch, sync the engine with the restored weights (and check them), and record the rollback (one log
    line, a record in ``alarms.jsonl``); returns the step to run next.

    The data skips ahead because a rollback that replayed the same batches on the same weights would meet the same
    bad step again (the loop is deterministic): the batches from the checkpoint's step through the bad one, the
    checkpoint's pending ones (async mode) included, are left out, as PaLM and OLMo skip the data around a spike.
    A run resumed later from a checkpoint written after the rollback holds that data position; one resumed from the
    checkpoint rolled back to replays its steps exactly, meets the bad step again and rolls back the same way."""
    config, run_dir = components.config, components.run_dir
    home = checkpoint_home(config.run, run_dir)
    checkpoint = latest_checkpoint(home)
    if checkpoint is None:
        raise CheckpointError(f"{rollback.reason}: {home} has no complete checkpoint to roll back to")
    next_step, _ = load_checkpoint(checkpoint, trainer=components.trainer, sampler=components.sampler)
    assert next_step <= rollback.step, f"{checkpoint} is newer than the step rolled back ({rollback.step})"
    components.sampler.load_state_dict(rollback.sampler_state)
    components.weight_sync(components.trainer, components.engine, version=next_step)
    guards = config.monitoring.guards
    record_rollback(
        run_dir, rollback, checkpoint=checkpoint.name, next_step=next_step, max_rollbacks=guards.max_rollbacks
    )
    return next_step
