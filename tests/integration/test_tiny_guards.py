"""The stability guards in a real loop with the tiny random model: with the suggested thresholds a healthy run's
alarms stay silent; an alarm under ``on_alarm = "stop"`` ends the run after its step with one line and a
checkpoint of that step."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tiny_loop import run_in_this_process, tiny_config

from sharpen.monitoring import ALARMS_FILE_NAME, RunStopped, read_jsonl

GUARDS = {
    "monitoring.guards.entropy_floor": "0.3",
    "monitoring.guards.entropy_drop_factor": "3.0",
    "monitoring.guards.entropy_rise_factor": "3.0",
}
"""docs/algorithms.md's starting thresholds for the entropy; the mismatch ceiling is 1e-3 nats (float32 here)."""


@pytest.mark.slow
def test_guards_stay_silent_on_a_healthy_run_and_stop_on_an_alarm(tiny_model_path: Path, tmp_path: Path) -> None:
    healthy = tiny_config(
        tiny_model_path,
        tmp_path,
        name="healthy",
        num_steps=3,
        **GUARDS,
        **{
            "monitoring.guards.mismatch_ceiling": "1e-3",
            "monitoring.guards.patience": "1",
            "monitoring.guards.early_steps": "1",  # the drop and the rise are judged at steps 1 and 2
        },
    )
    run_dir = run_in_this_process(healthy)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    alarms = ("health/alarm_entropy_collapse", "health/alarm_entropy_blowup", "health/alarm_mismatch")
    assert [tuple(row[name] for name in alarms) for row in rows] == [(0.0, 0.0, 0.0)] * 3
    assert not (run_dir / ALARMS_FILE_NAME).exists()

    # a floor above the random model's entropy (~log(49152) = 10.8 nats at most): the alarm fires at step 1
    stopped = tiny_config(
        tiny_model_path,
        tmp_path,
        name="stopped",
        num_steps=3,
        **{
            "monitoring.guards.entropy_floor": "100.0",
            "monitoring.guards.patience": "2",
            "monitoring.guards.on_alarm": '"stop"',
        },
    )
    with pytest.raises(
        RunStopped, match=r"^step 1: entropy_collapse alarm: .*run stopped after a checkpoint of step 2"
    ):
        run_in_this_process(stopped)
    stopped_dir = tmp_path / "stopped"
    assert [row["step"] for row in read_jsonl(stopped_dir / "metrics.jsonl")] == [0, 1]
    assert [record["step"] for record in read_jsonl(stopped_dir / ALARMS_FILE_NAME)] == [1]
    assert [path.name for path in (stopped_dir / "checkpoints").iterdir()] == ["step_000002"]
