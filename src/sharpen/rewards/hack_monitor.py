"""Hack monitoring: what happens to rollouts whose reward carries hack flags, and batch-level hacking signs.

Verifiers and judges set `RewardResult.hack_flags` (``grader_patched``, ``equality_override``,
``judge_canary``, ...). This module owns the policy applied to flagged rollouts and the metrics:
- ``screen`` (the default): the rollout keeps its verdict (a failure) for the group's baseline but is left out of
  the gradient (its advantage is cleared after the advantages are computed), and it is counted;
- ``penalise``: its score becomes ``-hack_penalty`` before the advantages, so the policy is pushed away from it.
It also measures the correlation between reward and completion length over the batch: a reward that rises with
length alone is a classic sign of a judge or reward model being gamed by verbosity.
It does not detect hacks itself; verifiers do, where the evidence is. The one sign it watches across steps is
`PolicyErrorMonitor`'s: a per-task rise in grading failures the policy caused.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Literal

from sharpen.types import Rollout

HackPolicy = Literal["screen", "penalise"]
_log = logging.getLogger(__name__)


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


class PolicyErrorMonitor:
    """Watches, per task, the rollouts whose reward says the policy caused a failure of the grading itself
    (`RewardResult.is_policy_error`: a program that hung, crashed or broke the grader's protocol). Those already
    score as failures; a task where their rate suddenly rises is where a policy is probing the grader, so each step
    the monitor compares a task's rate with its own running baseline and, when it rose by at least ``min_rise``
    with at least ``min_errors`` such rollouts, flags them ``policy_error_rise`` (the hack policy then screens or
    penalises them) and logs a warning naming the tasks. Run it before the hack policy is applied."""

    def __init__(self, *, min_rise: float = 0.25, min_errors: int = 2, decay: float = 0.8) -> None:
        if not 0.0 < min_rise <= 1.0 or min_errors < 1 or not 0.0 <= decay < 1.0:
            raise ValueError("PolicyErrorMonitor: min_rise in (0, 1], min_errors >= 1, decay in [0, 1)")
        self.min_rise, self.min_errors, self.decay = min_rise, min_errors, decay
        self.baselines: dict[str, float] = {}
        """Per task key: the running rate of policy-caused errors over the steps the task appeared in."""

    def observe(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """Flag this step's rising tasks; returns ``hack/policy_error_fraction`` and ``hack/policy_error_rising``."""
        by_task: dict[str, list[Rollout]] = {}
        for rollout in rollouts:
            if rollout.reward is not None and rollout.reward.score is not None:
                by_task.setdefault(rollout.example.task_key, []).append(rollout)
        rising, num_errors = [], 0
        for task, scored in by_task.items():
            errors = [r for r in scored if r.reward is not None and r.reward.is_policy_error]
            num_errors += len(errors)
            rate, baseline = len(errors) / len(scored), self.baselines.get(task, 0.0)
            if len(errors) >= self.min_errors and rate - baseline >= self.min_rise:
                rising.append(task)
                for rollout in errors:
                    assert rollout.reward is not None
                    if "policy_error_rise" not in rollout.reward.hack_flags:
                        rollout.reward.hack_flags.append("policy_error_rise")
            self.baselines[task] = self.decay * baseline + (1.0 - self.decay) * rate
        if rising:
            _log.warning("policy-caused grading errors rose on %d task(s): %s", len(rising), ", ".join(rising[:5]))
        num_scored = sum(len(scored) for scored in by_task.values())
        return {
            "hack/policy_error_fraction": num_errors / max(num_scored, 1),
            "hack/policy_error_rising": float(len(rising)),
        }
