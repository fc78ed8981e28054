"""The RL loop, top to bottom: sample -> generate -> score -> advantages -> train -> sync.

Everything it touches arrives built and wired in `Components` (see `local.py`); the loop knows no process,
device or engine type. Where a step's batch comes from is a `BatchSource` (`buffer.py`): generated on demand
(sync mode, `SyncBatches`) or by a producer thread running ahead of the trainer within a staleness bound
(async mode, `AsyncBatches`); everything after the batch is the same code in both modes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sharpen.config.schema import SharpenConfig
from sharpen.data import ExampleSampler
from sharpen.environments import EnvironmentFactory, EpisodeLimits, SingleTurnEnvironment
from sharpen.evaluation import eval_sampling, evaluate
from sharpen.monitoring import (
    MetricSink,
    ParityProbe,
    PhaseTimer,
    RolloutRecorder,
    RunHealth,
    Timeline,
    peak_memory_metrics,
)
from sharpen.orchestration.buffer import (
    AsyncBatches,
    BatchSource,
    ProducedBatch,
    PublishedWeights,
)
from sharpen.orchestration.checkpoint import save_checkpoint
from sharpen.orchestration.filters import DynamicSamplingBuffer, overlong_filter
from sharpen.orchestration.phases import (
    WeightSync,
    add_kl_penalties,
    assign_advantages,
    reward_metrics,
    score_groups,
)
from sharpen.rewards import RewardFn
from sharpen.rewards.canaries import build_canary_monitor
from sharpen.rewards.hack_monitor import hack_metrics, penalise_flagged, screen_flagged
from sharpen.rollout.engines import InferenceEngine, sleepable
from sharpen.rollout.episodes import generate_groups
from sharpen.trainer import Trainer
from sharpen.types import Example, Rollout, RolloutGroup, SamplingParams, TrainBatch

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Components:
    config: SharpenConfig
    run_dir: Path
    tokenizer: Any
    engine: InferenceEngine
    trainer: Trainer
    sampler: ExampleSampler
    rubric: RewardFn
    sink: MetricSink
    recorder: RolloutRecorder
    weight_sync: WeightSync
    make_environment: EnvironmentFactory = SingleTurnEnvironment
    episode_limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    sandbox: Any = None
    """The sandbox pool of environments that run code (None when the environment needs none)."""
    timeline: Timeline | None = None
    """Where phases are recorded as a Chrome-trace timeline (None: off)."""
    eval_examples: list[Example] = field(default_factory=list[Example])
    """Tasks of the periodic evaluation (evaluation.every_steps)."""
    parity_probe: ParityProbe | None = None
    """Fixed probe sequences whose engine and trainer logprobs are compared every monitoring.parity_probe_every
    steps (None: off)."""


def run_loop(c: Components, *, start_step: int = 0, pending: Sequence[ProducedBatch] = ()) -> None:
    """Steps ``start_step .. run.num_steps - 1``. ``pending``: batches a checkpoint kept (async mode) — they are
    trained on first, exactly as they would have been without the interruption."""
    config = c.config
    timer = PhaseTimer(timeline=c.timeline)
    health = RunHealth(
        c.run_dir,
        spike_factor=config.monitoring.grad_norm_spike_factor,
        spike_window=config.monitoring.grad_norm_spike_window,
    )
    source = build_batch_source(c, start_step=start_step, timer=timer, pending=pending)
    canaries = build_canary_monitor(c.rubric)
    try:
        source.publish(c.trainer, version=start_step)  # the engine already holds it: a no-op in sync mode
        step_started = time.perf_counter()
        for step in range(start_step, config.run.num_steps):
            batch = source.take(step)
            groups = batch.groups
            rollouts = [r for g in groups for r in g.rollouts]
            with timer.phase("score"):
                if config.trainer.algorithm.kl_in_reward:
                    add_kl_penalties(c.trainer, groups)
                if config.reward.hack_policy == "penalise":
                    penalise_flagged(rollouts, penalty=config.reward.hack_penalty)
                assign_advantages(groups, config.trainer.algorithm)
                num_screened = screen_flagged(rollouts) if config.reward.hack_policy == "screen" else 0
            trained = overlong_filter(rollouts) if config.trainer.algorithm.mask_truncated else rollouts
            train_started = time.perf_counter()
            with timer.phase("train"):
                train_metrics = c.trainer.step(TrainBatch(rollouts=trained, step=step))
            train_ended = time.perf_counter()
            health_metrics = health.check(step, trained, train_metrics)
            with timer.phase("sync"):
                sync_metrics = source.publish(c.trainer, version=step + 1)

            metrics = {
                **reward_metrics(groups),
                **hack_metrics(rollouts),
                "hack/num_screened": float(num_screened),
                **batch.metrics,
                **train_metrics,
                **health_metrics,
                **sync_metrics,
                "policy/version": float(step + 1),
                **peak_memory_metrics(),
            }
            metrics.update(source.step_metrics(step, trained, train_started=train_started, train_ended=train_ended))
            every = config.evaluation.every_steps
            if every and ((step + 1) % every == 0 or step + 1 == config.run.num_steps):
                with timer.phase("evaluate"), source.exclusive(step + 1) as engine:
                    metrics.update(evaluate_policy(c, engine))
            every = config.monitoring.parity_probe_every
            if c.parity_probe is not None and every and (step + 1) % every == 0:
                with timer.phase("parity"), source.exclusive(step + 1) as engine:
                    metrics.update(c.parity_probe.run(c.trainer, engine))
            if canaries is not None:
                with timer.phase("canaries"):
                    metrics.update(canaries.maybe_run(step))
            add_times(metrics, timer.pop_metrics())
            now = time.perf_counter()
            metrics["time/step"] = now - step_started
            step_started = now
            num_tokens = sum(r.num_tokens for r in rollouts)
            metrics["throughput/tokens_per_second"] = num_tokens / metrics["time/step"]
            c.sink.log(metrics, step=step)
            c.recorder.record(step, rollouts)
            is_last = step + 1 == config.run.num_steps
            if (config.run.checkpoint_every and (step + 1) % config.run.checkpoint_every == 0) or is_last:
                kept = source.pending(step + 1)
                save_checkpoint(
                    c.run_dir,
                    next_step=step + 1,
                    trainer=c.trainer,
                    sampler_state=kept[-1].sampler_state if kept else batch.sampler_state,
                    pending=kept,
                )
    finally:
        source.close()


def add_times(metrics: dict[str, float], times: dict[str, float]) -> None:
    """Adds the trainer thread's phase times to ``metrics``; a phase also timed by the producer (async mode: its
    scoring) adds up."""
    for name, seconds in times.items():
        metrics[name] = metrics.get(name, 0.0) + seconds


def build_batch_source(
    c: Components, *, start_step: int, timer: PhaseTimer, pending: Sequence[ProducedBatch] = ()
) -> BatchSource:
    config = c.config
    sampling = SamplingParams(
        max_new_tokens=config.rollout.max_new_tokens,
        temperature=config.rollout.temperature,
        top_p=config.rollout.top_p,
    )
    if config.rollout.mode == "sync":
        return SyncBatches(c, sampling=sampling, timer=timer, pending=pending)
    if config.trainer.algorithm.off_policy_correction == "none":
        logger.warning("async mode without off-policy correction: stale tokens are trained on as if on-policy")

    def produce(
        step: int, engine: InferenceEngine, producer_timer: PhaseTimer
    ) -> tuple[list[RolloutGroup], dict[str, float]]:
        return collect_groups(replace(c, engine=engine), step=step, sampling=sampling, timer=producer_timer)

    def load(published: PublishedWeights, engine: InferenceEngine) -> dict[str, float]:
        return c.weight_sync.load(
            published.weights, engine, version=published.version, reference=lambda: published.probe
        )

    return AsyncBatches(
        produce=produce,
        engine=c.engine,
        sampler_state=c.sampler.state_dict,
        load=load,
        reference=c.weight_sync.reference,
        make_timer=lambda: PhaseTimer(timeline=c.timeline),
        start_step=start_step,
        num_steps=config.run.num_steps,
        max_staleness=config.rollout.max_staleness,
        updates=config.rollout.weight_updates,
        chunk_tokens=config.rollout.update_chunk_tokens,
        decode=lambda ids: c.tokenizer.decode(ids, skip_special_tokens=True),
        pending=pending,
    )


class SyncBatches:
    """Sync mode: each batch is generated when the loop asks for it, and weights are loaded right after a step.

    Colocated (``runtime.colocate``): once a batch is complete the engine sleeps, so the trainer has the devices to
    itself, and it wakes right before the weights of the step are loaded into it."""

    def __init__(
        self, c: Components, *, sampling: SamplingParams, timer: PhaseTimer, pending: Sequence[ProducedBatch] = ()
    ) -> None:
        self.c = c
        self.sampling = sampling
        self.timer = timer
        self.kept = {batch.step: batch for batch in pending}
        self.sleeper = sleepable(c.engine) if c.config.runtime.colocate else None
        self.is_asleep = False

    def take(self, step: int) -> ProducedBatch:
        if step in self.kept:  # a checkpoint of an async run kept it
            batch = self.kept.pop(step)
        else:
            groups, metrics = collect_groups(self.c, step=step, sampling=self.sampling, timer=self.timer)
            batch = ProducedBatch(step=step, groups=groups, metrics=metrics, sampler_state=self.c.sampler.state_dict())
        if self.sleeper is not None:
            with self.timer.phase("sleep"):
                batch.metrics.update(self.sleeper.sleep())
            self.is_asleep = True
        return batch

    def publish(self, trainer: Trainer, *, version: int) -> dict[str, float]:
        if self.c.engine.policy_version == version and not self.is_asleep:
            return {}
        metrics: dict[str, float] = {}
        if self.sleeper is not None and self.is_asleep:
            with self.timer.phase("wake"):
                metrics.update(self.sleeper.wake_up())
            self.is_asleep = False
        return {**metrics, **self.c.weight_sync(trainer, self.c.engine, version=version)}

    @contextlib.contextmanager
    def exclusive(self, version: int) -> Iterator[InferenceEngine]:
        yield self.c.engine

    def pending(self, next_step: int) -> list[ProducedBatch]:
        return [self.kept[step] for step in sorted(self.kept) if step >= next_step]

    def step_metrics(
        self, step: int, trained: list[Rollout], *, train_started: float, train_ended: float
    ) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def collect_groups(
    c: Components, *, step: int, sampling: SamplingParams, timer: PhaseTimer
) -> tuple[list[RolloutGroup], dict[str, float]]:
    """Generate and score one step's groups. With dynamic sampling (DAPO), keep drawing batches until
    ``prompts_per_step`` informative groups are collected or the cap is reached; the surplus of the last batch is
    dropped (as in DAPO's reference code), so no state crosses steps and resume stays exact."""
    config = c.config
    buffer = None
    if config.rollout.dynamic_sampling:
        buffer = DynamicSamplingBuffer(config.rollout.prompts_per_step, config.rollout.max_sampling_batches)
    for draw in range(config.rollout.max_sampling_batches):
        with timer.phase("generate"):
            groups = generate_groups(
                c.engine,
                c.sampler.next_batch(config.rollout.prompts_per_step),
                tokenizer=c.tokenizer,
                sampling=sampling,
                num_samples=config.rollout.num_samples_per_prompt,
                seed=f"{config.run.seed}/{step}" if draw == 0 else f"{config.run.seed}/{step}/{draw}",
                **episode_options(c),
            )
        with timer.phase("score"):
            score_groups(c.rubric, groups, config=config.reward, max_new_tokens=config.rollout.max_new_tokens)
        if config.trainer.algorithm.advantage == "remax":
            add_greedy_baselines(c, groups, sampling=sampling, timer=timer)
        if buffer is None:
            return groups, {}
        buffer.add(groups)
        if buffer.is_full or buffer.exhausted:
            break
    assert buffer is not None
    metrics = buffer.metrics()
    return buffer.take(), metrics


def evaluate_policy(c: Components, engine: InferenceEngine) -> dict[str, float]:
    """Periodic evaluation of ``engine`` (holding the weights just trained) on ``c.eval_examples``: ``eval/*``."""
    config, evaluation = c.config, c.config.evaluation
    report = evaluate(
        engine,
        c.eval_examples,
        tokenizer=c.tokenizer,
        rubric=c.rubric,
        sampling=eval_sampling(config),
        num_samples=evaluation.num_samples,
        ks=evaluation.ks,
        seed=config.run.seed,
        make_environment=c.make_environment,
        limits=c.episode_limits,
        answer_format=config.reward.answer_format,
        prompts_per_batch=evaluation.prompts_per_batch,
        sandbox=c.sandbox,
    )
    return report.to_metrics()


def episode_options(c: Components) -> dict[str, Any]:
    """The environment side of `generate_groups`: which environment, its limits, seed and sandbox."""
    return {
        "make_environment": c.make_environment,
        "limits": c.episode_limits,
        "episode_seed": c.config.run.seed,
        "sandbox": c.sandbox,
    }


def add_greedy_baselines(
    c: Components, groups: list[RolloutGroup], *, sampling: SamplingParams, timer: PhaseTimer
) -> None:
    """ReMax: one greedy completion per example, scored like the samples; its score is the group's baseline."""
    with timer.phase("generate"):
        greedy = generate_groups(
            c.engine,
            [group.example for group in groups],
            tokenizer=c.tokenizer,
            sampling=replace(sampling, temperature=0.0),
            num_samples=1,
            seed="greedy",
            **episode_options(c),
        )
    with timer.phase("score"):
        score_groups(c.rubric, greedy, config=c.config.reward, max_new_tokens=c.config.rollout.max_new_tokens)
    for group, baseline in zip(groups, greedy, strict=True):
        group.baseline_score = baseline.scores[0]
