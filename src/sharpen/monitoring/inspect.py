"""`sharpen inspect`: a run's health from what it wrote (metrics.jsonl, nonfinite/), as a summary and warnings.

Owns reading a run directory after the fact and judging it: progress, reward trend, throughput and time per
phase, memory, and warnings (non-finite steps, gradient-norm spikes, abstentions, hack flags, engine/trainer
mismatch close to the tolerance, a reward that does not move). It changes nothing and needs no model.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharpen.monitoring.sinks import METRICS_FILE_NAME, read_jsonl

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
    warnings: list[str] = field(default_factory=list[str])

    def to_text(self) -> str:
        lines = [
            f"run {self.run_dir}: {self.num_steps} steps",
            f"reward: {self.reward_first:.3f} (first tenth) -> {self.reward_last:.3f} (last tenth)",
            f"step time: median {self.step_seconds:.2f} s; "
            + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phase_seconds.items()),
            f"throughput: median {self.tokens_per_second:.0f} tokens/s; peak RSS {self.peak_rss_gib:.2f} GiB",
        ]
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
    summary.warnings = run_warnings(rows, probe_tolerance=probe_tolerance)
    return summary


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


def run_warnings(rows: list[dict[str, Any]], *, probe_tolerance: float) -> list[str]:
    """What a user should look at, most serious first."""
    warnings = []
    nonfinite = [row["step"] for row in rows if row.get("train/num_nonfinite_updates", 0) > 0]
    if nonfinite:
        warnings.append(f"non-finite gradients at steps {nonfinite} (skipped; batches in nonfinite/)")
    spikes = [row["step"] for row in rows if row.get("health/grad_norm_spike", 0) > 0]
    if spikes:
        warnings.append(f"gradient-norm spikes at steps {spikes}")
    probe = _probe_warning(rows, probe_tolerance=probe_tolerance)
    if probe:
        warnings.append(probe)
    abstaining = ("reward/status_infra_error", "reward/status_timeout", "reward/status_judge_unparseable")
    abstained = statistics.fmean(sum(row.get(key, 0.0) for key in abstaining) for row in rows)
    if abstained > 0.1:
        warnings.append(f"{abstained:.0%} of rollouts abstained on average (reward/status_* says why)")
    flagged = _mean(rows, "hack/flagged_fraction")
    if flagged > 0:
        warnings.append(f"{flagged:.1%} of rollouts carried hack flags on average (hack/flag_*)")
    if len(rows) >= 10 and _mean(rows, "rollout/groups_all_equal_fraction") > 0.9:
        warnings.append("over 90% of groups had all-equal rewards: little learning signal (dynamic sampling?)")
    return warnings
