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


def test_the_run_doctor_names_truncation_a_lost_replica_a_flat_reward_and_entropy_collapse(tmp_path: Path):
    """Runs made to show each condition: the warning names the metric and the key to change."""
    truncated = [_row(0.5, **{"rollout/truncated_fraction": 1.0, "rollout/stop_max_turns": 1.0}) for _ in range(3)]
    _write_run(tmp_path / "truncated", truncated)
    [warning] = inspect_run(tmp_path / "truncated").warnings
    assert warning == (
        "100% of episodes were truncated on average (rollout/truncated_fraction; most often by max_turns: "
        "rollout/stop_max_turns): raise environment.max_turns"
    )
    lost = [_row(0.5 + 0.1 * i) for i in range(3)]
    lost[1]["engine/restarts"] = 1.0
    _write_run(tmp_path / "lost", lost)
    [warning] = inspect_run(tmp_path / "lost").warnings
    assert warning.startswith("engine replicas were lost or restarted at steps [1] (1 restarts")
    _write_run(tmp_path / "flat", [_row(0.0) for _ in range(3)])
    assert inspect_run(tmp_path / "flat").warnings == [
        "the reward was 0 in every step: check the reward on a few rollouts (rollouts.jsonl, reward/status_*)"
    ]
    collapsing = [_row(0.1 * i, **{"train/entropy": 2.0 * 0.5**i}) for i in range(6)]
    _write_run(tmp_path / "collapse", collapsing)
    [warning] = inspect_run(tmp_path / "collapse").warnings
    assert warning.startswith("the policy's entropy collapsed: 2 at the start, 0.0625 at the end (train/entropy;")


def test_train_prints_the_run_doctor_when_the_run_ends(tmp_path: Path, monkeypatch, capsys):
    """`sharpen train` ends with the doctor's warnings (here: a run whose episodes all hit the turn limit)."""
    import sharpen.orchestration.runtime as runtime

    run_dir = tmp_path / "runs" / "run"

    def fake_run(config, *, resume):  # the run's folder exists already: the CLI's log is in it
        rows = [_row(0.5, **{"rollout/truncated_fraction": 1.0, "rollout/stop_length": 1.0})] * 3
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": i, **r}) + "\n" for i, r in enumerate(rows)))
        return run_dir

    monkeypatch.setattr(runtime, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "run.name=run"]) == 0
    err = capsys.readouterr().err
    assert "sharpen: warning: 100% of episodes were truncated" in err and "raise rollout.max_new_tokens" in err


def test_an_fp16_loss_scale_at_its_floor_is_named_and_early_overflows_are_not(tmp_path: Path):
    """Dynamic scaling halves the scale on the first overflows on purpose; a scale down at 1 means float16 overflows
    in the forward pass itself."""
    early = [_row(0.5, **{"train/loss_scale": scale}) for scale in (32768.0, 16384.0, 16384.0)]
    early[0]["train/num_loss_scale_overflows"] = 1.0
    early[1]["train/num_loss_scale_overflows"] = 1.0
    _write_run(tmp_path / "early", early)
    assert inspect_run(tmp_path / "early").warnings == []
    floored = [_row(0.5, **{"train/loss_scale": 2.0, "train/num_loss_scale_overflows": 15.0})]
    floored += [_row(0.5, **{"train/loss_scale": 1.0, "train/num_loss_scale_overflows": 1.0}) for _ in range(2)]
    _write_run(tmp_path / "floored", floored)
    assert inspect_run(tmp_path / "floored").warnings == [
        "the fp16 loss scale reached its floor of 1 at step 1 (train/loss_scale; 17 overflows in all): the forward "
        "pass overflows float16 itself; train in bf16 or float32"
    ]
