"""Hack monitoring: what happens to rollouts whose reward carries hack flags, and batch-level hacking signs.

Verifiers and judges set `RewardResult.hack_flags` (``exit_before_asserts``, ``conftest_created``,
``judge_canary``, ...). This module owns the policy applied to flagged rollouts and the metrics:
- ``screen`` (the default): the rollout keeps its verdict (a failure) for the group's baseline but is left out of
  the gradient (its advantage is cleared after the advantages are computed), and it is counted;
- ``penalise``: its score becomes ``-hack_penalty`` before the advantages, so the policy is pushed away from it.
It also measures the correlation between reward and completion length over the batch: a reward that rises with
length alone is a classic sign of a judge or reward model being gamed by verbosity.
It does not detect hacks itself; verifiers do, where the evidence is.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Literal

from sharpen.types import Rollout

HackPolicy = Literal["screen", "penalise"]


def flagged(rollouts: Sequence[Rollout]) -> list[Rollout]:
    return [r for r in rollouts if r.reward is not None and r.reward.hack_flags]


def penalise_flagged(rollouts: Sequence[Rollout], *, penalty: float) -> None:
    """``penalise``: flagged rollouts score ``-penalty`` (run before the advantages)."""
    for rollout in flagged(rollouts):
        assert rollout.reward is not None
        rollout.reward.components["hack_penalty"] = -penalty
        rollout.reward.score = -penalty


def screen_flagged(rollouts: Sequence[Rollout]) -> int:
    """``screen``: flagged rollouts are left out of the gradient (run after the advantages); returns how many."""
    screened = flagged(rollouts)
    for rollout in screened:
        rollout.advantage = None
    return len(screened)


def hack_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """``hack/flag_<name>`` (fraction of rollouts), ``hack/flagged_fraction`` and ``hack/reward_length_corr``."""
    num = max(len(rollouts), 1)
    counts = Counter(flag for r in flagged(rollouts) for flag in set(r.reward.hack_flags))  # type: ignore[union-attr]
    metrics = {f"hack/flag_{name}": count / num for name, count in sorted(counts.items())}
    metrics["hack/flagged_fraction"] = len(flagged(rollouts)) / num
    scored = [(r.reward.score, float(r.num_loss_tokens)) for r in rollouts if r.reward and r.reward.score is not None]
    if len(scored) > 2:
        scores, lengths = zip(*scored, strict=True)
        if statistics.pstdev(scores) > 0 and statistics.pstdev(lengths) > 0:
            metrics["hack/reward_length_corr"] = statistics.correlation(scores, lengths)
    return metrics
