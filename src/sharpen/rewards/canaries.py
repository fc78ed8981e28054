"""Judge canaries during a run: every N steps, each judge grades known-bad responses, and a high score raises an alert.

Owns the schedule (steps 0, N, 2N, ...), the run-level metrics (``judge/<name>/canary_*`` per judge component,
``judge/<name>/canary_gated`` and ``hack/judge_canary_alert``, 1.0 when any judge scored any canary above its
threshold, with a warning) and stopping the run: a judge whose ``on_canary_failure`` is ``stop`` raises
`JudgeCanaryError` here. The other gate (``abstain``: every verdict of the judge abstains until a check passes) is
the judge's own (`Judge.is_canary_failed`), set by `Judge.run_canaries`, which also owns what a canary is and how
one is graded; when to call `CanaryMonitor.maybe_run` is the loop's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from sharpen.rewards.base import RewardFn
from sharpen.rewards.judge import Judge, JudgeCanaryError
from sharpen.rewards.rubric import Rubric
from sharpen.types import Example

logger = logging.getLogger(__name__)


class CanaryMonitor:
    """Runs the canaries of ``judges`` (by component name) at every ``every_steps``-th step, the first included;
    ``example`` is the task the canaries answer (None: the judge's default arithmetic task)."""

    def __init__(self, judges: Mapping[str, Judge], every_steps: int, *, example: Example | None = None) -> None:
        if every_steps < 1:
            raise ValueError(f"CanaryMonitor: every_steps must be >= 1, got {every_steps}")
        if not judges:
            raise ValueError("CanaryMonitor: no judges to check")
        self.judges = dict(judges)
        self.every_steps = every_steps
        self.example = example

    def maybe_run(self, step: int) -> dict[str, float]:
        """The canary metrics at a scheduled step, else ``{}``. Raises `JudgeCanaryError` when a judge configured to
        stop (``on_canary_failure = "stop"``) failed its check."""
        if step % self.every_steps:
            return {}
        metrics: dict[str, float] = {}
        for name, judge in self.judges.items():
            for key, value in judge.run_canaries(self.example).items():
                metrics[f"judge/{name}/{key.removeprefix('judge/')}"] = value
            metrics[f"judge/{name}/canary_gated"] = float(judge.is_canary_failed)
        alerting = [name for name in self.judges if metrics[f"judge/{name}/canary_alert"]]
        metrics["hack/judge_canary_alert"] = float(bool(alerting))
        if alerting:
            logger.warning(
                "step %d: judge canary alert: %s scored a known-bad response above its threshold; see judge/*/canary_*",
                step,
                ", ".join(alerting),
            )
        stopping = [name for name in alerting if self.judges[name].on_canary_failure == "stop"]
        if stopping:
            scores = ", ".join(f"{name} {metrics[f'judge/{name}/canary_max_score']:.2f}" for name in stopping)
            raise JudgeCanaryError(
                f"step {step}: judge canary check failed ({scores} on a known-bad response, threshold "
                f'{", ".join(str(self.judges[n].canary_threshold) for n in stopping)}) and on_canary_failure = "stop"; '
                "the run stops rather than train on a judge that can be fooled (see judge/*/canary_*)"
            )
        return metrics


def build_canary_monitor(reward_fn: RewardFn) -> CanaryMonitor | None:
    """The monitor of a `Rubric` with judge components, on the schedule `RewardConfig.canary_every_steps` (every 50
    steps unless ``reward.judge_canary_every`` says otherwise); None otherwise (any other reward function, no judge,
    or canaries off with ``judge_canary_every = 0``)."""
    if not isinstance(reward_fn, Rubric):
        return None
    every_steps = reward_fn.config.canary_every_steps()
    judges = reward_fn.judges()
    if every_steps == 0 or not judges:
        return None
    return CanaryMonitor(judges, every_steps)
