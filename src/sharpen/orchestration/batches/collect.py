"""`GroupCollector`: one step's batch, generated and scored — what sync and async mode both train on.

Owns the order of a step's generation: draw examples, run their episodes (`EpisodeRunner`), score them (each group
in a worker thread as soon as its episodes have ended, while the others still run), add ReMax's greedy baselines,
and under dynamic sampling (DAPO) draw again until enough informative groups are collected. The engine is an
argument, so the async producer can pass its versioned view of the run's engine. It does not decide when a batch is
made (the batch sources do) and holds no state across steps, so resume stays exact.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

from sharpen.orchestration.batches.base import ProducedBatch
from sharpen.orchestration.filters import DynamicSamplingBuffer
from sharpen.orchestration.phases import score_groups
from sharpen.types import RolloutGroup, SamplingParams

if TYPE_CHECKING:
    from sharpen.config.schema import SharpenConfig
    from sharpen.data import ExampleSampler
    from sharpen.monitoring import PhaseTimer
    from sharpen.rewards import RewardFn
    from sharpen.rollout.engines import InferenceEngine
    from sharpen.rollout.episodes import EpisodeRunner


def rollout_sampling(config: SharpenConfig) -> SamplingParams:
    """The sampling of training rollouts (``rollout.*``)."""
    rollout = config.rollout
    return SamplingParams(
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
    )


class GroupCollector:
    """Makes the batch of a step from the run's sampler, episode runner and reward function."""

    def __init__(
        self, config: SharpenConfig, *, runner: EpisodeRunner, rubric: RewardFn, sampler: ExampleSampler
    ) -> None:
        self.config = config
        self.runner = runner
        self.rubric = rubric
        self.sampler = sampler
        self.sampling = rollout_sampling(config)

    def collect(self, engine: InferenceEngine, *, step: int, timer: PhaseTimer) -> ProducedBatch:
        """Generate and score one step's groups. With dynamic sampling, keep drawing batches until
        ``prompts_per_step`` informative groups are collected or the cap is reached; the surplus of the last batch
        is dropped (as in DAPO's reference code)."""
        groups, metrics = self._collect_groups(engine, step=step, timer=timer)
        return ProducedBatch(step=step, groups=groups, metrics=metrics, sampler_state=self.sampler.state_dict())

    def _score(self, group: RolloutGroup) -> None:
        score_groups(self.rubric, [group], config=self.config.reward, max_new_tokens=self.config.rollout.max_new_tokens)

    def _collect_groups(
        self, engine: InferenceEngine, *, step: int, timer: PhaseTimer
    ) -> tuple[list[RolloutGroup], dict[str, float]]:
        config = self.config
        rollout = config.rollout
        buffer = None
        if rollout.dynamic_sampling:
            buffer = DynamicSamplingBuffer(rollout.prompts_per_step, rollout.max_sampling_batches)
        for draw in range(rollout.max_sampling_batches):
            with _GroupScorer(self._score) as scorer:
                with timer.phase("generate"):
                    groups = self.runner.generate_groups(
                        engine,
                        self.sampler.next_batch(rollout.prompts_per_step),
                        sampling=self.sampling,
                        num_samples=rollout.num_samples_per_prompt,
                        seed=f"{config.run.seed}/{step}" if draw == 0 else f"{config.run.seed}/{step}/{draw}",
                        on_group=scorer.submit,
                    )
                with timer.phase("score"):  # what is left once the last episode has ended
                    scorer.wait()
            if config.trainer.algorithm.advantage.needs_greedy_baseline:
                self.add_greedy_baselines(engine, groups, timer=timer)
            if buffer is None:
                return groups, {}
            buffer.add(groups)
            if buffer.is_full or buffer.exhausted:
                break
        assert buffer is not None
        metrics = buffer.metrics()
        return buffer.take(), metrics

    def add_greedy_baselines(self, engine: InferenceEngine, groups: list[RolloutGroup], *, timer: PhaseTimer) -> None:
        """ReMax: one greedy completion per example, scored like the samples; its score is the group's baseline."""
        with timer.phase("generate"):
            greedy = self.runner.generate_groups(
                engine,
                [group.example for group in groups],
                sampling=replace(self.sampling, temperature=0.0),
                num_samples=1,
                seed="greedy",
            )
        with timer.phase("score"):
            score_groups(
                self.rubric, greedy, config=self.config.reward, max_new_tokens=self.config.rollout.max_new_tokens
            )
        for group, baseline in zip(groups, greedy, strict=True):
            group.baseline_score = baseline.scores[0]


class _GroupScorer:
    """Scores each group in a worker thread as soon as its episodes have ended, while the others still run; `wait`
    returns once every submitted group is scored (and raises the first scoring error)."""

    def __init__(self, score: Callable[[RolloutGroup], None]) -> None:
        self._score = score
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sharpen-score")
        self._scored: list[Future[None]] = []

    def submit(self, group: RolloutGroup) -> None:
        self._scored.append(self._pool.submit(self._score, group))

    def wait(self) -> None:
        for future in self._scored:
            future.result()

    def __enter__(self) -> _GroupScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=exc_info[0] is not None)
