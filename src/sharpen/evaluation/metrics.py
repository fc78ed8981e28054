"""Evaluation metrics: pass@k, maj@k and mean@k of one task's samples, and their average over tasks.

Owns the definitions, as pure functions over plain data; it does not generate or score anything (what a sample is
worth is decided before it arrives here, as a `SampleOutcome`). The definitions, fixed so that numbers stay
comparable across runs:

* A sample is *correct* when its reward status is ``ok`` (the verifier accepted it in full).
* A sample *abstains* when its reward's score is None: the scorer or the environment could not judge it
  (infra_error, timeout). Abstentions are not failures: they are left out of their task's sample count ``n`` and
  reported as ``num_abstained``. A task with fewer than k answered samples has no value at k (None) and is left out
  of that k's average over tasks; ``num_tasks_at_k`` says how many tasks each average covers.
* pass@k: the unbiased estimator of Chen et al. 2021, ``1 - C(n-c, k) / C(n, k)`` over a task's n answered samples
  of which c are correct: the chance that k samples drawn without replacement hold at least one correct one.
* maj@k and mean@k are averaged over the ``n // k`` disjoint blocks of k consecutive answered samples (in sample
  order): each block is an independent draw of k samples, so the average is unbiased and uses as many samples as
  possible without reusing one (a task's leftover ``n % k`` samples are not used at that k).
* maj@k: a majority vote over the final answers of a block. Answers vote together when their `vote_key`s are
  equal. A sample without an extracted answer (a format error) casts no vote but still takes one of the k places.
  The winning answer is worth the fraction of its voters that were correct (1 or 0 for a deterministic verifier).
  A tie is worth the mean over the tied answers: the expected value of breaking the tie uniformly at random, so
  a block's value does not depend on the order of its samples. A block without any vote is worth 0.
* mean@k: the mean score of the samples of the blocks (with 0/1 scores, mean@1 is pass@1).
* Over tasks: the unweighted mean of the per-task values (every task counts once, whatever its n).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

_EXACT_MAX_SAMPLES = 1024
"""Up to this n, pass@k is computed in exact integer arithmetic (then rounded once); above, by Chen's product."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SampleOutcome:
    """What evaluation keeps of one sample."""

    score: float | None
    """The reward's score; None when it abstained."""
    is_correct: bool
    """The reward's status was ``ok``."""
    answer: str | None = None
    """The final answer extracted from the completion (None: none found), for maj@k."""

    @property
    def is_abstained(self) -> bool:
        return self.score is None


@dataclass(kw_only=True, slots=True)
class TaskMetrics:
    """One task's row: its sample counts and its value at each k (None where it has fewer than k answered)."""

    task_key: str
    num_samples: int
    """Samples generated, abstained ones included."""
    num_abstained: int
    num_correct: int
    pass_at_k: dict[int, float | None]
    maj_at_k: dict[int, float | None]
    mean_at_k: dict[int, float | None]

    @property
    def num_answered(self) -> int:
        """Samples that count (n in pass@k): the generated ones less the abstentions."""
        return self.num_samples - self.num_abstained


@dataclass(kw_only=True, slots=True)
class AggregateMetrics:
    """The averages over tasks, and the totals they stand on."""

    num_tasks: int
    num_samples: int
    num_abstained: int
    num_correct: int
    pass_at_k: dict[int, float | None]
    maj_at_k: dict[int, float | None]
    mean_at_k: dict[int, float | None]
    num_tasks_at_k: dict[int, int]
    """Tasks with at least k answered samples: the ones each k's averages cover."""


def check_ks(ks: Iterable[int], num_samples: int) -> list[int]:
    """``ks`` sorted and deduplicated, with 1 added (pass@1 is always reported); every k in 1..num_samples."""
    if num_samples < 1:
        raise ValueError(f"evaluation needs at least one sample per task, got num_samples = {num_samples}")
    values = sorted({1, *ks})
    bad = [k for k in values if not 1 <= k <= num_samples]
    if bad:
        raise ValueError(f"ks: every k must be between 1 and num_samples = {num_samples}, got {bad}")
    return values


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k for a task with ``num_samples`` (n) answered samples, ``num_correct`` (c) of
    them correct: ``1 - C(n-c, k) / C(n, k)``. Exact (correctly rounded) for n up to 1024; above, the numerically
    stable product ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` of the paper's code."""
    if k < 1:
        raise ValueError(f"pass@k: k must be at least 1, got k = {k}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"pass@k: num_correct = {num_correct} must be between 0 and num_samples = {num_samples}")
    if num_samples < k:
        raise ValueError(
            f"pass@{k} needs at least {k} answered samples of the task, got {num_samples} "
            "(generate more samples, or lower k)"
        )
    num_wrong = num_samples - num_correct
    if num_wrong < k:
        return 1.0  # every draw of k samples holds a correct one
    if num_samples <= _EXACT_MAX_SAMPLES:
        total = math.comb(num_samples, k)
        return float(Fraction(total - math.comb(num_wrong, k), total))
    return 1.0 - math.prod(1.0 - k / i for i in range(num_wrong + 1, num_samples + 1))


def vote_key(answer: str) -> str:
    """What makes two answers one vote: whitespace collapsed and case folded; finite numbers by value, so "19",
    "19.0" and "1.9e1" vote together."""
    text = " ".join(answer.split()).casefold()
    if "_" in text:  # float() reads "1_000" as 1000; an answer with underscores is text
        return text
    try:
        number = float(text)
    except ValueError:
        return text
    return repr(number + 0.0) if math.isfinite(number) else text  # + 0.0 folds -0.0 into 0.0


def maj_at_k(samples: Sequence[SampleOutcome], k: int) -> float:
    """The majority vote's correctness, averaged over the blocks of k answered samples (see the module docstring
    for ties, abstentions and samples without an answer)."""
    return statistics.fmean(_vote(block) for block in _blocks(samples, k))


def mean_at_k(samples: Sequence[SampleOutcome], k: int) -> float:
    """The mean score of the blocks of k answered samples."""
    return statistics.fmean(s.score for block in _blocks(samples, k) for s in block if s.score is not None)


def _vote(block: Sequence[SampleOutcome]) -> float:
    votes: dict[str, list[bool]] = {}
    for sample in block:
        if sample.answer is not None:
            votes.setdefault(vote_key(sample.answer), []).append(sample.is_correct)
    if not votes:
        return 0.0
    most = max(len(voters) for voters in votes.values())
    winners = [voters for voters in votes.values() if len(voters) == most]
    return statistics.fmean(sum(voters) / len(voters) for voters in winners)


def _blocks(samples: Sequence[SampleOutcome], k: int) -> list[list[SampleOutcome]]:
    """The ``n // k`` disjoint blocks of k consecutive answered samples."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got k = {k}")
    answered = [s for s in samples if not s.is_abstained]
    if len(answered) < k:
        raise ValueError(f"@{k} needs at least {k} answered samples of the task, got {len(answered)}")
    return [answered[i : i + k] for i in range(0, len(answered) - k + 1, k)]


def compute_task_metrics(task_key: str, samples: Sequence[SampleOutcome], ks: Sequence[int]) -> TaskMetrics:
    """One task's row; a k above its number of answered samples gives None."""
    answered = [s for s in samples if not s.is_abstained]
    num_correct = sum(s.is_correct for s in answered)
    fits = [k for k in ks if k <= len(answered)]
    return TaskMetrics(
        task_key=task_key,
        num_samples=len(samples),
        num_abstained=len(samples) - len(answered),
        num_correct=num_correct,
        pass_at_k={k: pass_at_k(len(answered), num_correct, k) if k in fits else None for k in ks},
        maj_at_k={k: maj_at_k(answered, k) if k in fits else None for k in ks},
        mean_at_k={k: mean_at_k(answered, k) if k in fits else None for k in ks},
    )


def aggregate_tasks(tasks: Sequence[TaskMetrics], ks: Sequence[int]) -> AggregateMetrics:
    """The unweighted mean over tasks at each k, of the tasks that have a value there (None when none has)."""

    def mean(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.fmean(present) if present else None

    return AggregateMetrics(
        num_tasks=len(tasks),
        num_samples=sum(t.num_samples for t in tasks),
        num_abstained=sum(t.num_abstained for t in tasks),
        num_correct=sum(t.num_correct for t in tasks),
        pass_at_k={k: mean([t.pass_at_k[k] for t in tasks]) for k in ks},
        maj_at_k={k: mean([t.maj_at_k[k] for t in tasks]) for k in ks},
        mean_at_k={k: mean([t.mean_at_k[k] for t in tasks]) for k in ks},
        num_tasks_at_k={k: sum(t.pass_at_k[k] is not None for t in tasks) for k in ks},
    )
