"""`evaluate`: sample a model on tasks and measure it (pass@k, maj@k, mean@k) with the training machinery.

Owns the evaluation pass: batches of examples go through the same episode loop as training
(`sharpen.rollout.episodes.EpisodeRunner`, so environments, limits and token handling are identical) and every
sample is scored by the same rule (`sharpen.rewards.scoring.score_rollout`); then only each sample's outcome (score,
status, extracted answer) is kept, so memory stays bounded by one batch of rollouts. It builds no component (the
caller passes a live engine, the run's episode runner and reward function) and never touches a trainer.
The metrics' definitions (correct, abstained, ties) are `sharpen.evaluation.metrics`'.

Sampling seeds: batch b is generated with seed ``"{seed}/eval/{first example index}"``, from which the episode loop
derives one seed per sample; the same seed and ``prompts_per_batch`` give the same samples.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from sharpen.config.evaluation import EvalConfig
from sharpen.config.schema import SharpenConfig
from sharpen.evaluation.metrics import (
    SampleOutcome,
    TaskMetrics,
    aggregate_tasks,
    check_ks,
    compute_task_metrics,
)
from sharpen.evaluation.report import EvalReport
from sharpen.rewards import AnswerFormat, RewardFn, extract_answer
from sharpen.rewards.scoring import score_rollout
from sharpen.rollout.engines import InferenceEngine
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.types import Example, RewardStatus, RolloutGroup, SamplingParams


def eval_sampling(config: SharpenConfig, evaluation: EvalConfig | None = None) -> SamplingParams:
    """The evaluation's sampling: its own temperature and token limit (``evaluation``, default the recipe's
    evaluation section), the rollout's top_p and top_k."""
    evaluation = evaluation or config.evaluation
    return SamplingParams(
        max_new_tokens=evaluation.max_new_tokens or config.rollout.max_new_tokens,
        temperature=evaluation.temperature,
        top_p=config.rollout.top_p,
        top_k=config.rollout.top_k,
    )


def evaluate(
    engine: InferenceEngine,
    examples: Sequence[Example],
    *,
    runner: EpisodeRunner,
    rubric: RewardFn,
    sampling: SamplingParams,
    num_samples: int,
    ks: Sequence[int] = (1,),
    seed: int | str = 0,
    answer_format: AnswerFormat = "answer_tag",
    prompts_per_batch: int = 8,
) -> EvalReport:
    """``num_samples`` samples of every example, ``prompts_per_batch`` examples per call of the episode loop.

    ``ks``: the k of pass@k, maj@k and mean@k (1 is always included; each at most ``num_samples``).
    ``answer_format``: how maj@k reads a sample's final answer (use the rubric's). ``seed`` seeds sampling (the
    environments are seeded by ``runner``'s episode seed). The engine is used as it is (its weights, its policy
    version)."""
    ks = check_ks(ks, num_samples)
    _check_batching(examples, prompts_per_batch)
    started = time.perf_counter()
    tasks: list[TaskMetrics] = []
    statuses: Counter[str] = Counter()
    num_generated_tokens = 0
    generate_seconds = 0.0
    for first in range(0, len(examples), prompts_per_batch):
        batch_started = time.perf_counter()
        groups = runner.generate_groups(
            engine,
            list(examples[first : first + prompts_per_batch]),
            sampling=sampling,
            num_samples=num_samples,
            seed=f"{seed}/eval/{first}",
        )
        generate_seconds += time.perf_counter() - batch_started
        for group in groups:
            num_generated_tokens += sum(r.num_loss_tokens for r in group.rollouts)
            outcomes = _score_group(rubric, group, answer_format=answer_format, statuses=statuses)
            tasks.append(compute_task_metrics(group.example.task_key, outcomes, ks))
    settings = {"seed": seed, "prompts_per_batch": prompts_per_batch, "answer_format": answer_format}
    return EvalReport(
        overall=aggregate_tasks(tasks, ks),
        tasks=tasks,
        ks=ks,
        num_samples_per_task=num_samples,
        status_counts=dict(statuses),
        num_generated_tokens=num_generated_tokens,
        generate_seconds=generate_seconds,
        wall_seconds=time.perf_counter() - started,
        settings={**_sampling_settings(sampling), **settings, "policy_version": engine.policy_version},
    )


def _check_batching(examples: Sequence[Example], prompts_per_batch: int) -> None:
    if not examples:
        raise ValueError("evaluate: no examples to evaluate")
    if prompts_per_batch < 1:
        raise ValueError(f"evaluate: prompts_per_batch must be at least 1, got {prompts_per_batch}")


def _sampling_settings(sampling: SamplingParams) -> dict[str, Any]:
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_new_tokens": sampling.max_new_tokens}


def _score_group(
    rubric: RewardFn, group: RolloutGroup, *, answer_format: AnswerFormat, statuses: Counter[str]
) -> list[SampleOutcome]:
    """Each rollout's outcome, in sample order; counts the reward statuses."""
    outcomes = []
    for rollout in sorted(group.rollouts, key=lambda r: r.sample_index):
        reward = score_rollout(rubric, group.example, rollout)
        statuses[reward.status.value] += 1
        outcomes.append(
            SampleOutcome(
                score=reward.score,
                is_correct=reward.status == RewardStatus.OK,
                answer=extract_answer(rollout.completion_text, answer_format),
            )
        )
    return outcomes
