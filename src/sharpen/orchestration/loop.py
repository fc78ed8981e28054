"""The RL loop, top to bottom: sample -> generate -> score -> advantages -> train -> sync.

Everything it touches arrives built and wired in `Components` (see `build.py`); the loop knows no process,
device or engine type: the trainer is a `TrainerHandle` and the engine an `InferenceEngine`, in this process or
proxies of Ray actors. Where a step's batch comes from is a `BatchSource` (`batches/`): generated on demand (sync
mode) or by a producer thread running ahead of the trainer within a staleness bound (async mode); everything after
the batch is the same code in both modes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sharpen.config.schema import SharpenConfig
from sharpen.data import ExampleSampler
from sharpen.environments.base import EnvironmentCodeError
from sharpen.environments.tool_formats.decode import completion_text
from sharpen.evaluation import eval_sampling, evaluate
from sharpen.monitoring import (
    MetricSink,
    ParityProbe,
    PhaseTimer,
    RolloutRecorder,
    RunHealth,
    RunStopped,
    Timeline,
    peak_memory_metrics,
)
from sharpen.monitoring.guards import Rollback
from sharpen.orchestration.batches import GroupCollector, ProducedBatch, build_batch_source
from sharpen.orchestration.checkpoint import checkpoint_home, save_checkpoint
from sharpen.orchestration.handles import TrainerHandle
from sharpen.orchestration.phases import compute_step_advantages, reward_metrics
from sharpen.orchestration.weight_sync import WeightSync
from sharpen.rewards import RewardFn
from sharpen.rewards.canaries import build_canary_monitor
from sharpen.rewards.hack_monitor import PolicyErrorMonitor, hack_metrics
from sharpen.rollout.engines import InferenceEngine
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.types import Example, Rollout, TrainBatch, with_segments

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Components:
    """What the loop drives, built and wired (`build.build_components`)."""

    config: SharpenConfig
    run_dir: Path
    tokenizer: Any
    engine: InferenceEngine
    trainer: TrainerHandle
    sampler: ExampleSampler
    rubric: RewardFn
    sink: MetricSink
    recorder: RolloutRecorder
    weight_sync: WeightSync
    runner: EpisodeRunner
    """Runs the episodes of training, periodic evaluation and ReMax baselines."""
    timeline: Timeline | None = None
    """Where phases are recorded as a Chrome-trace timeline (None: off)."""
    eval_examples: list[Example] = field(default_factory=list[Example])
    """Tasks of the periodic evaluation (evaluation.every_steps)."""
    parity_probe: ParityProbe | None = None
    """Fixed probe sequences whose engine and trainer logprobs are compared every monitoring.parity_probe_every
    steps (None: off)."""


def run_loop(
    components: Components, *, start_step: int = 0, pending: Sequence[ProducedBatch] = (), rolled_back: bool = False
) -> Rollback | None:
    """Steps ``start_step .. run.num_steps - 1``. ``pending``: batches a checkpoint kept (async mode) — they are
    trained on first, exactly as they would have been without the interruption. ``rolled_back``: the session just
    rolled the run back to the checkpoint of ``start_step``. Returns the `Rollback` a guard asked for at the step it
    ended on, unsaved (the session restores the newest checkpoint, `session.roll_back`), or None."""
    config = components.config
    timer = PhaseTimer(timeline=components.timeline)
    health = RunHealth(
        components.run_dir,
        spike_factor=config.monitoring.grad_norm_spike_factor,
        spike_window=config.monitoring.grad_norm_spike_window,
        guards=config.monitoring.guards,
    )
    if start_step:
        health.resume(start_step, rolled_back=rolled_back)  # the spike median and alarm streaks of the steps before
    source = build_batch_source(
        config,
        GroupCollector(config, runner=components.runner, rubric=components.rubric, sampler=components.sampler),
        engine=components.engine,
        weight_sync=components.weight_sync,
        start_step=start_step,
        timer=timer,
        timeline=components.timeline,
        decode=lambda ids: completion_text(components.tokenizer, ids),
        pending=pending,
    )
    canaries = build_canary_monitor(components.rubric)
    policy_errors = PolicyErrorMonitor()
    trainer = components.trainer
    try:
        source.publish(trainer, version=start_step)  # the engine already holds it: a no-op in sync mode
        step_started = time.perf_counter()
        # Where each stage lives. sample -> generate -> score: the batch source (`batches/`; `collect.py` draws
        # examples from the sampler, has the episode runner generate them and `phases.score_groups` reward them;
        # async mode runs it ahead in a thread). advantages: `phases.compute_step_advantages` (KL reward penalties,
        # hack policy, estimator, overlong filter). train: the trainer (`trainer/trainer.py`: its `Objective`, the
        # step schedule, the rank lockstep). sync: the source's `publish` (`weight_sync.py`: load, then the probe).
        for step in range(start_step, config.run.num_steps):
            canary_metrics: dict[str, float] = {}
            if canaries is not None:  # before the step's rollouts are scored: a fooled judge is gated from them
                with timer.phase("canaries"):
                    canary_metrics = canaries.maybe_run(step)
            batch = source.scored_batch(step)
            groups = batch.groups
            rollouts = [r for g in groups for r in g.rollouts]
            check_environment_failures(step, rollouts)
            policy_error_metrics = policy_errors.observe(rollouts)
            with timer.phase("advantages"):
                advantages = compute_step_advantages(trainer, groups, config)
            train_started = time.perf_counter()
            with timer.phase("train"):
                trained = TrainBatch(
                    rollouts=with_segments(advantages.trained), step=step, skip_grad_norm_above=health.skip_above()
                )
                train_metrics = trainer.step(trained)
            train_ended = time.perf_counter()
            with timer.phase("sync"):
                sync_metrics = source.publish(trainer, version=step + 1)

            metrics = {
                **reward_metrics(groups),
                **hack_metrics(rollouts),
                **policy_error_metrics,
                "hack/num_screened": float(advantages.num_screened),
                **batch.metrics,
                **train_metrics,
                **sync_metrics,
                "policy/version": float(step + 1),
                **peak_memory_metrics(),
            }
            metrics.update(
                source.step_metrics(step, advantages.trained, train_started=train_started, train_ended=train_ended)
            )
            every = config.evaluation.every_steps
            if every and ((step + 1) % every == 0 or step + 1 == config.run.num_steps):
                with timer.phase("evaluate"), source.exclusive(step + 1) as engine:
                    metrics.update(evaluate_policy(components, engine))
            every = config.monitoring.parity_probe_every
            if components.parity_probe is not None and every and (step + 1) % every == 0:
                with timer.phase("parity"), source.exclusive(step + 1) as engine:
                    metrics.update(components.parity_probe.run(trainer, engine))
            metrics.update(canary_metrics)
            metrics.update(health.check(step, advantages.trained, metrics))  # every signal of the step, parity's too
            add_times(metrics, timer.pop_metrics())
            now = time.perf_counter()
            metrics["time/step"] = now - step_started
            step_started = now
            num_tokens = sum(r.num_tokens for r in rollouts)
            metrics["throughput/tokens_per_second"] = num_tokens / metrics["time/step"]
            components.sink.log(metrics, step=step)
            components.recorder.record(step, rollouts)
            if health.rollback is not None:  # its step is not checkpointed: the rollback goes on after its batch
                return replace(health.rollback, sampler_state=batch.sampler_state)
            is_last = step + 1 == config.run.num_steps or health.stop_reason is not None
            if (config.run.checkpoint_every and (step + 1) % config.run.checkpoint_every == 0) or is_last:
                kept = source.pending(step + 1)
                save_checkpoint(
                    checkpoint_home(config.run, components.run_dir),
                    next_step=step + 1,
                    trainer=trainer,
                    sampler_state=kept[-1].sampler_state if kept else batch.sampler_state,
                    pending=kept,
                )
                health.checkpointed(step + 1)
            if health.stop_reason is not None:
                raise RunStopped(f"{health.stop_reason}: run stopped after a checkpoint of step {step + 1} (--resume)")
    finally:
        source.close()
    return None


def check_environment_failures(step: int, rollouts: Sequence[Rollout]) -> None:
    """Stop the run when every episode of ``step`` ended because the environment's own code raised (an error in the
    user's environment or agent, not the policy's doing): an `EnvironmentCodeError` naming the first error."""
    failed = [r for r in rollouts if r.episode is not None and r.episode.stop_reason == "environment_error"]
    if rollouts and len(failed) == len(rollouts):
        first = failed[0].episode
        assert first is not None
        raise EnvironmentCodeError(
            f"step {step}: all {len(rollouts)} episodes failed in the environment's code ({first.environment}); the "
            f"first raised {first.error} (the run's log has each traceback)"
        )


def add_times(metrics: dict[str, float], times: dict[str, float]) -> None:
    """Adds the trainer thread's phase times to ``metrics``; a phase also timed by the producer (async mode: its
    scoring) adds up."""
    for name, seconds in times.items():
        metrics[name] = metrics.get(name, 0.0) + seconds


def evaluate_policy(components: Components, engine: InferenceEngine) -> dict[str, float]:
    """Periodic evaluation of ``engine`` (holding the weights just trained) on ``components.eval_examples``:
    ``eval/*``."""
    config, evaluation = components.config, components.config.evaluation
    report = evaluate(
        engine,
        components.eval_examples,
        runner=components.runner,
        rubric=components.rubric,
        sampling=eval_sampling(config),
        num_samples=evaluation.num_samples,
        ks=evaluation.ks,
        seed=config.run.seed,
        answer_format=config.reward.answer_format,
        prompts_per_batch=evaluation.prompts_per_batch,
    )
    return report.to_metrics()
