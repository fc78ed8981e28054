"""`sharpen inspect`: a run's health from what it wrote (metrics.jsonl, alarms.jsonl, nonfinite/), as a summary,
the stability alarms that fired and warnings.

Owns reading a run directory after the fact and judging it: progress, reward trend, throughput and time per
phase, memory, and warnings, the run doctor's (non-finite steps, gradient-norm spikes, engine replicas lost or
restarted, engine/trainer mismatch close to the tolerance, episodes that mostly hit a limit, abstentions, a reward
flat at 0 or 1, entropy collapse, hack flags, a reward that does not move), each with the metric to read and the key
to change. `sharpen train` prints them when a run ends. It changes nothing and needs no model.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharpen.monitoring.health import read_alarms
from sharpen.monitoring.sinks import METRICS_FILE_NAME, read_jsonl

LOSS_SCALE_FLOOR = 1.0
"""fp16's dynamic loss scale never goes below this (`trainer.precision.MIN_LOSS_SCALE`; not imported: the monitoring
layer imports no trainer): a run there overflows float16 in its forward pass, which no scale fixes."""

PHASES = ("generate", "score", "train", "sync", "evaluate")


@dataclass(kw_only=True, slots=True)
class RunSummary:
    run_dir: str
    num_steps: int
    reward_first: float
    """Mean reward of the first tenth of the steps (at least one step)."""
    reward_last: float
    """Mean reward of the last tenth of the steps."""
    step_seconds: float
    """Median seconds per step."""
    phase_seconds: dict[str, float]
    tokens_per_second: float
    peak_rss_gib: float
    alarms: list[str] = field(default_factory=list[str])
    """The stability guards' alarms that fired (monitoring.guards), each a line naming its step and signal."""
    warnings: list[str] = field(default_factory=list[str])

    def to_text(self) -> str:
        lines = [
            f"run {self.run_dir}: {self.num_steps} steps",
            f"reward: {self.reward_first:.3f} (first tenth) -> {self.reward_last:.3f} (last tenth)",
            f"step time: median {self.step_seconds:.2f} s; "
            + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phase_seconds.items()),
            f"throughput: median {self.tokens_per_second:.0f} tokens/s; peak RSS {self.peak_rss_gib:.2f} GiB",
        ]
        lines += [f"alarm: {alarm}" for alarm in self.alarms]
        lines += [f"warning: {warning}" for warning in self.warnings] or ["no warnings"]
        return "\n".join(lines)


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    values = [row[key] for row in rows if isinstance(row.get(key), int | float) and math.isfinite(row[key])]
    return statistics.fmean(values) if values else float("nan")


def _median(rows: list[dict[str, Any]], key: str) -> float:
    values = [row[key] for row in rows if isinstance(row.get(key), int | float) and math.isfinite(row[key])]
    return statistics.median(values) if values else float("nan")


def inspect_run(run_dir: Path, *, probe_tolerance: float = 1e-3) -> RunSummary:
    """Summarise ``run_dir``; ValueError when it holds no metrics."""
    path = Path(run_dir) / METRICS_FILE_NAME
    if not path.is_file():
        raise ValueError(f"{run_dir} is not a run directory: it has no {METRICS_FILE_NAME}")
    rows = read_jsonl(path)
    if not rows:
        raise ValueError(f"{path} holds no steps yet")
    tenth = max(len(rows) // 10, 1)
    summary = RunSummary(
        run_dir=str(run_dir),
        num_steps=len(rows),
        reward_first=_mean(rows[:tenth], "reward/mean"),
        reward_last=_mean(rows[-tenth:], "reward/mean"),
        step_seconds=_median(rows, "time/step"),
        phase_seconds={p: _median(rows, f"time/{p}") for p in PHASES if any(f"time/{p}" in r for r in rows)},
        tokens_per_second=_median(rows, "throughput/tokens_per_second"),
        peak_rss_gib=max((row.get("memory/peak_rss_gib", 0.0) for row in rows), default=0.0),
    )
    summary.alarms = run_alarms(Path(run_dir), rows)
    summary.warnings = run_warnings(rows, probe_tolerance=probe_tolerance)
    return summary


def run_alarms(run_dir: Path, rows: list[dict[str, Any]]) -> list[str]:
    """The alarms that fired, from ``alarms.jsonl`` (their console lines); a run directory without it (copied
    without it, say) still names them from its metrics (``health/alarm_<name>`` = 1)."""
    records = read_alarms(run_dir)
    if records:
        return [str(record["message"]) for record in records]
    return [
        f"step {row['step']}: {key.removeprefix('health/alarm_')} alarm ({key})"
        for row in rows
        for key, value in row.items()
        if key.startswith("health/alarm_") and value == 1
    ]


def _probe_warning(rows: list[dict[str, Any]], *, probe_tolerance: float) -> str | None:
    """The worst weight-sync probe mismatch when it came close to its tolerance: past a tenth of a fixed tolerance
    (float32: ~1e-5 is normal), past twice the first sync's mismatch under a measured one (bfloat16, whose rows
    carry ``sync/probe_baseline``); ``probe_tolerance`` stands in for rows that do not say theirs."""
    worst: tuple[float, float] | None = None
    for row in rows:
        mismatch = row.get("sync/probe_mismatch_mean")
        if mismatch is None:
            continue
        tolerance = row.get("sync/probe_tolerance", probe_tolerance)
        baseline = row.get("sync/probe_baseline")
        if mismatch > (2 * baseline if baseline is not None else tolerance / 10):
            worst = max(worst or (mismatch, tolerance), (mismatch, tolerance))
    if worst is None:
        return None
    return f"engine/trainer probe mismatch up to {worst[0]:.2e} nats/token (tolerance {worst[1]:.3g})"


_LIMIT_KEYS = {
    "length": "rollout.max_new_tokens",
    "max_turns": "environment.max_turns",
    "max_tokens": "environment.max_episode_tokens",
    "wall_clock": "environment.wall_seconds",
    "episode_timeout": "rollout.episode_timeout_s",
    "engine_refused": "rollout.engine.max_model_len (the engine refused prompts past it)",
}
"""The key that bounds each ``rollout/stop_<reason>`` of a truncated episode."""


def _flat_reward(rows: list[dict[str, Any]]) -> str | None:
    """A reward at exactly 0 or exactly 1 in every step (nothing to learn from), with what to look at."""
    rewards = [row.get("reward/mean") for row in rows]
    if len(rows) < 3 or any(not isinstance(r, int | float) for r in rewards):
        return None
    if all(r == 0.0 for r in rewards):
        return "the reward was 0 in every step: check the reward on a few rollouts (rollouts.jsonl, reward/status_*)"
    if all(r == 1.0 for r in rewards):
        return "the reward was 1 in every step: the task is solved already or the reward is too lenient"
    return None


def _abstained_fraction(row: dict[str, Any]) -> float:
    """The step's share of rollouts whose reward abstained (score None: any reward, environment or grader); runs
    written before ``reward/abstained_fraction`` existed count the abstaining statuses instead."""
    if "reward/abstained_fraction" in row:
        return row["reward/abstained_fraction"]
    abstaining = ("reward/status_infra_error", "reward/status_timeout", "reward/status_judge_unparseable")
    return sum(row.get(key, 0.0) for key in abstaining)


def run_warnings(rows: list[dict[str, Any]], *, probe_tolerance: float) -> list[str]:
    """What a user should look at, most serious first."""
    warnings = []
    nonfinite = [row["step"] for row in rows if row.get("train/num_nonfinite_updates", 0) > 0]
    if nonfinite:
        warnings.append(f"non-finite gradients at steps {nonfinite} (skipped; batches in nonfinite/)")
    floor = [row["step"] for row in rows if row.get("train/loss_scale", math.inf) <= LOSS_SCALE_FLOOR]
    if floor:
        overflows = sum(row.get("train/num_loss_scale_overflows", 0.0) for row in rows)
        warnings.append(
            f"the fp16 loss scale reached its floor of {LOSS_SCALE_FLOOR:g} at step {floor[0]} (train/loss_scale; "
            f"{overflows:.0f} overflows in all): the forward pass overflows float16 itself; train in bf16 or float32"
        )
    spikes = [row["step"] for row in rows if row.get("health/grad_norm_spike", 0) > 0]
    if spikes:
        warnings.append(f"gradient-norm spikes at steps {spikes}")
    probe = _probe_warning(rows, probe_tolerance=probe_tolerance)
    if probe:
        warnings.append(probe)
    restarts = sum(row.get("engine/restarts", 0.0) for row in rows)
    failed = sum(row.get("sync/num_failed_replicas", 0.0) for row in rows)
    if restarts or failed:
        lost = [
            row["step"] for row in rows if row.get("engine/restarts", 0.0) or row.get("sync/num_failed_replicas", 0.0)
        ]
        warnings.append(
            f"engine replicas were lost or restarted at steps {lost} ({restarts:.0f} restarts, {failed:.0f} failed "
            "weight loads: engine/restarts, sync/num_failed_replicas; the run's log says why)"
        )
    truncated = _mean(rows, "rollout/truncated_fraction")
    if truncated > 0.5:
        reasons = {
            key.removeprefix("rollout/stop_"): _mean(rows, key)
            for key in {k for row in rows for k in row if k.startswith("rollout/stop_")} - {"rollout/stop_terminated"}
        }
        reason = max(reasons, key=lambda r: reasons[r]) if reasons else ""
        change = _LIMIT_KEYS.get(reason, "rollout.max_new_tokens or environment.max_turns")
        warnings.append(
            f"{truncated:.0%} of episodes were truncated on average (rollout/truncated_fraction"
            + (f"; most often by {reason}: rollout/stop_{reason}" if reason else "")
            + f"): raise {change}"
        )
    abstained = statistics.fmean(_abstained_fraction(row) for row in rows)
    if abstained > 0.1:
        warnings.append(
            f"{abstained:.0%} of rollouts abstained on average (reward/abstained_fraction; reward/status_* and "
            "rollouts.jsonl say why): they are not trained on"
        )
    flat = _flat_reward(rows)
    if flat is not None:
        warnings.append(flat)
    entropy = [row["train/entropy"] for row in rows if isinstance(row.get("train/entropy"), int | float)]
    if (
        len(entropy) >= 5
        and entropy[0] > 0
        and statistics.fmean(entropy[-max(len(entropy) // 10, 1) :]) < 0.1 * entropy[0]
    ):
        warnings.append(
            f"the policy's entropy collapsed: {entropy[0]:.3g} at the start, {entropy[-1]:.3g} at the end "
            "(train/entropy; trainer.algorithm.entropy_coef, or a lower learning rate)"
        )
    flagged = _mean(rows, "hack/flagged_fraction")
    if flagged > 0:
        warnings.append(f"{flagged:.1%} of rollouts carried hack flags on average (hack/flag_*)")
    if len(rows) >= 10 and _mean(rows, "rollout/groups_all_equal_fraction") > 0.9:
        warnings.append("over 90% of groups had all-equal rewards: little learning signal (dynamic sampling?)")
    return warnings
