"""The RL loop, synchronous mode, top to bottom: sample -> generate -> score -> advantages -> train -> sync.

Everything it touches arrives built and wired in `Components` (see `local.py`); the loop knows no process,
device or engine type. Asynchronous mode (overlapped generation) will reuse these phases with a buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sharpen.config.schema import SharpenConfig
from sharpen.data import ExampleSampler
from sharpen.environments import EnvironmentFactory, EpisodeLimits, SingleTurnEnvironment
from sharpen.evaluation import eval_sampling, evaluate
from sharpen.monitoring import MetricSink, PhaseTimer, RolloutRecorder, RunHealth, Timeline, peak_memory_metrics
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
from sharpen.rewards.hack_monitor import hack_metrics, penalise_flagged, screen_flagged
from sharpen.rollout.engines import InferenceEngine
from sharpen.rollout.episodes import generate_groups
from sharpen.trainer import Trainer
from sharpen.types import Example, RolloutGroup, SamplingParams, TrainBatch


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
    timeline: Timeline | None = None
    eval_examples: list[Example] = field(default_factory=list[Example])
    """Tasks of the periodic evaluation (evaluation.every_steps)."""
    """Where phases are recorded as a Chrome-trace timeline (None: off)."""
    """The sandbox pool of environments that run code (None when the environment needs none)."""


def run_loop(c: Components, *, start_step: int = 0) -> None:
    config = c.config
    sampling = SamplingParams(
        max_new_tokens=config.rollout.max_new_tokens,
        temperature=config.rollout.temperature,
        top_p=config.rollout.top_p,
    )
    timer = PhaseTimer(timeline=c.timeline)
    health = RunHealth(
        c.run_dir,
        spike_factor=config.monitoring.grad_norm_spike_factor,
        spike_window=config.monitoring.grad_norm_spike_window,
    )
    for step in range(start_step, config.run.num_steps):
        groups, sampling_metrics = collect_groups(c, step=step, sampling=sampling, timer=timer)
        rollouts = [r for g in groups for r in g.rollouts]
        with timer.phase("score"):
            if config.trainer.algorithm.kl_in_reward:
                add_kl_penalties(c.trainer, groups)
            if config.reward.hack_policy == "penalise":
                penalise_flagged(rollouts, penalty=config.reward.hack_penalty)
            assign_advantages(groups, config.trainer.algorithm)
            num_screened = screen_flagged(rollouts) if config.reward.hack_policy == "screen" else 0
        trained = overlong_filter(rollouts) if config.trainer.algorithm.mask_truncated else rollouts
        with timer.phase("train"):
            train_metrics = c.trainer.step(TrainBatch(rollouts=trained, step=step))
        health_metrics = health.check(step, trained, train_metrics)
        with timer.phase("sync"):
            sync_metrics = c.weight_sync(c.trainer, c.engine, version=step + 1)

        times = timer.pop_metrics()
        num_tokens = sum(r.num_tokens for r in rollouts)
        step_seconds = sum(times.values())
        metrics = {
            **reward_metrics(groups),
            **hack_metrics(rollouts),
            "hack/num_screened": float(num_screened),
            **sampling_metrics,
            **train_metrics,
            **health_metrics,
            **sync_metrics,
            **times,
            "time/step": step_seconds,
            "throughput/tokens_per_second": num_tokens / step_seconds if step_seconds > 0 else 0.0,
            "policy/version": float(c.engine.policy_version),
            **peak_memory_metrics(),
        }
        every = config.evaluation.every_steps
        if every and ((step + 1) % every == 0 or step + 1 == config.run.num_steps):
            with timer.phase("evaluate"):
                metrics.update(evaluate_policy(c))
            metrics.update(timer.pop_metrics())
        c.sink.log(metrics, step=step)
        c.recorder.record(step, rollouts)
        is_last = step + 1 == config.run.num_steps
        if (config.run.checkpoint_every and (step + 1) % config.run.checkpoint_every == 0) or is_last:
            save_checkpoint(c.run_dir, next_step=step + 1, trainer=c.trainer, sampler=c.sampler)


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


def evaluate_policy(c: Components) -> dict[str, float]:
    """Periodic evaluation of the engine's current weights (just synced) on ``c.eval_examples``: ``eval/*``."""
    config, evaluation = c.config, c.config.evaluation
    report = evaluate(
        c.engine,
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
