"""`sharpen inspect`: the summary and warnings of a run, from its metrics.jsonl alone."""

from __future__ import annotations

import json
from pathlib import Path

from sharpen.cli.main import EXIT_USER_ERROR, main
from sharpen.monitoring.inspect import inspect_run


def _write_run(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": i, **row}) + "\n" for i, row in enumerate(rows)))


def _row(reward: float, **extra: float) -> dict:
    return {
        "reward/mean": reward,
        "time/step": 2.0,
        "time/generate": 1.5,
        "time/train": 0.5,
        "throughput/tokens_per_second": 100.0,
        "memory/peak_rss_gib": 1.5,
        "sync/probe_mismatch_mean": 1e-6,
        **extra,
    }


def test_a_healthy_run_summarises_its_trend_and_time(tmp_path: Path, capsys):
    _write_run(tmp_path / "run", [_row(0.1 * i) for i in range(10)])
    summary = inspect_run(tmp_path / "run")
    assert (summary.num_steps, summary.reward_first, summary.reward_last) == (10, 0.0, 0.9)
    assert summary.phase_seconds == {"generate": 1.5, "train": 0.5} and summary.warnings == []
    assert main(["inspect", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "reward: 0.000 (first tenth) -> 0.900 (last tenth)" in out and "no warnings" in out


def test_warnings_name_what_went_wrong(tmp_path: Path, capsys):
    rows = [_row(0.5) for _ in range(4)]
    rows[1].update({"train/num_nonfinite_updates": 1.0})
    rows[2].update({"health/grad_norm_spike": 1.0, "sync/probe_mismatch_mean": 5e-4})
    for row in rows:
        row.update({"reward/status_infra_error": 0.25, "hack/flagged_fraction": 0.125})
    _write_run(tmp_path / "run", rows)
    warnings = inspect_run(tmp_path / "run").warnings
    assert warnings[0].startswith("non-finite gradients at steps [1]")
    assert warnings[1] == "gradient-norm spikes at steps [2]"
    assert "probe mismatch up to 5.00e-04" in warnings[2]
    assert warnings[3].startswith("25% of rollouts abstained") and warnings[4].startswith("12.5% of rollouts carried")
    assert main(["inspect", str(tmp_path / "nothing")]) == EXIT_USER_ERROR
    assert "is not a run directory" in capsys.readouterr().err
