"""The stability alarms and the guards' policies on synthetic metric sequences: each alarm fires at the step
computed by hand, once, and again only after its signal came back; a stable run stays silent; the policies set
the skip bound and the stop reason; a resumed run's health is the uninterrupted run's; inspect lists the alarms."""

from __future__ import annotations

import json
from pathlib import Path

from sharpen.config.guards import GuardsConfig
from sharpen.monitoring import ALARMS_FILE_NAME, RunHealth, StabilityAlarms, read_alarms
from sharpen.monitoring.inspect import inspect_run


def fired_steps(config: GuardsConfig, rows: list[dict[str, float]]) -> list[tuple[int, str, str]]:
    alarms = StabilityAlarms(config=config)
    return [(a.step, a.name, a.signal) for step, row in enumerate(rows) for a in alarms.observe(step, row)]


def entropy_rows(values: list[float]) -> list[dict[str, float]]:
    return [{"train/entropy": value} for value in values]


def test_entropy_below_the_floor_for_patience_steps_fires_once():
    rows = entropy_rows([1.0, 0.9, 0.4, 0.6, 0.45, 0.3, 0.2, 0.1])
    # below 0.5 at steps 2, 4, 5, 6, 7; step 3 breaks the first streak; the third in a row is step 6
    assert fired_steps(GuardsConfig(entropy_floor=0.5, patience=3), rows) == [(6, "entropy_collapse", "train/entropy")]


def test_entropy_dropping_by_a_factor_from_its_early_median_fires_and_rearms():
    rows = entropy_rows([2.0, 1.0, 1.5, 0.5, 0.3, 0.2, 1.0, 0.1, 0.1])
    # early median of [2.0, 1.0, 1.5] = 1.5, bound 1.5 / 4 = 0.375: steps 4, 5 below (fires at 5), 6 recovers,
    # 7, 8 below (fires again at 8)
    config = GuardsConfig(entropy_drop_factor=4.0, early_steps=3, patience=2)
    assert [step for step, _, _ in fired_steps(config, rows)] == [5, 8]
    alarms = StabilityAlarms(config=config)
    for step, row in enumerate(rows[:6]):
        fired = alarms.observe(step, row)
    assert fired[0].threshold == 0.375 and fired[0].value == 0.2
    assert fired[0].message.startswith("step 5: entropy_collapse alarm: train/entropy = 0.2 below 0.375 for 2 steps")


def test_early_steps_are_not_judged_against_themselves():
    # a low start is the early median itself: no drop, no alarm
    rows = entropy_rows([0.01, 0.01, 0.01, 0.01, 0.01, 0.01])
    assert fired_steps(GuardsConfig(entropy_drop_factor=2.0, early_steps=3, patience=1), rows) == []


def test_entropy_rising_by_a_factor_from_its_early_median_fires_and_rearms():
    # train/entropy of benchmarks/turn_credit.py's tiny Llama at learning rate 2e-3 (steps 0 to 9), where the policy
    # turned to noise (10.2 nats: uniform over its 49k words), then a recovery and a second rise
    rows = entropy_rows([0.99, 1.0, 1.07, 1.83, 4.08, 5.9, 7.04, 10.22, 10.22, 10.22, 1.2, 3.5, 3.6])
    # early median of [0.99, 1.0, 1.07] = 1.0, ceiling 1.0 x 3 = 3.0: steps 4, 5 above (fires at 5), on above
    # without a second alarm; step 10 comes back; 11, 12 above (fires again at 12)
    config = GuardsConfig(entropy_rise_factor=3.0, early_steps=3, patience=2)
    assert fired_steps(config, rows) == [
        (5, "entropy_blowup", "train/entropy"),
        (12, "entropy_blowup", "train/entropy"),
    ]
    alarms = StabilityAlarms(config=config)
    for step, row in enumerate(rows[:6]):
        fired = alarms.observe(step, row)
    assert fired[0].threshold == 3.0 and fired[0].value == 5.9
    assert fired[0].message.startswith("step 5: entropy_blowup alarm: train/entropy = 5.9 above 3 for 2 steps")
    # the collapse alarm on the same signal does not fire on a rise, nor the blow-up on a drop
    both = GuardsConfig(entropy_rise_factor=3.0, entropy_drop_factor=3.0, early_steps=3, patience=2)
    assert [name for _, name, _ in fired_steps(both, rows)] == ["entropy_blowup", "entropy_blowup"]
    assert fired_steps(both, entropy_rows([1.0, 1.0, 1.0, 0.2, 0.2])) == [(4, "entropy_collapse", "train/entropy")]


def test_early_steps_are_not_judged_against_themselves_for_a_rise():
    # a blow-up inside the early steps raises the median itself: 10.2 is not 3 x the median of [1, 5, 10.2] = 5
    rows = entropy_rows([1.0, 5.0, 10.2, 10.2, 10.2])
    assert fired_steps(GuardsConfig(entropy_rise_factor=3.0, early_steps=3, patience=1), rows) == []


def test_mismatch_over_the_ceiling_fires_on_the_offpolicy_or_the_parity_signal():
    rows = [
        {"offpolicy/kl_k3": 0.001},
        {"offpolicy/kl_k3": 0.02},  # over: streak 1
        {"offpolicy/kl_k3": 0.005},  # back: streak broken
        {"offpolicy/kl_k3": 0.02},  # streak 1
        {"offpolicy/kl_k3": 0.003, "parity/k3": 0.05},  # the probe is over: streak 2, fires
        {},  # nothing measured: the streak holds
        {"offpolicy/kl_k3": 0.02},  # streak 3: no second alarm
    ]
    assert fired_steps(GuardsConfig(mismatch_ceiling=0.01, patience=2), rows) == [(4, "mismatch", "parity/k3")]


def test_a_stable_run_stays_silent():
    rows = [
        {"train/entropy": 1.2 + 0.1 * (-1) ** step, "offpolicy/kl_k3": 2e-4, "parity/k3": 1e-4} for step in range(50)
    ]
    config = GuardsConfig(
        entropy_floor=0.3, entropy_drop_factor=3.0, entropy_rise_factor=3.0, mismatch_ceiling=1e-3, patience=1
    )
    assert fired_steps(config, rows) == []


def test_alarms_are_logged_recorded_and_flagged_in_the_step_metrics(tmp_path: Path, caplog):
    health = RunHealth(tmp_path, spike_factor=5.0, spike_window=10, guards=GuardsConfig(entropy_floor=0.5, patience=2))
    flags = [
        health.check(step, [], {"train/grad_norm": 1.0, "train/entropy": entropy})["health/alarm_entropy_collapse"]
        for step, entropy in enumerate([1.0, 0.4, 0.3, 0.2])
    ]
    assert flags == [0.0, 0.0, 1.0, 0.0]
    assert "step 2: entropy_collapse alarm: train/entropy = 0.3 below 0.5 for 2 steps" in caplog.text
    assert [(r["step"], r["alarm"], r["value"]) for r in read_alarms(tmp_path)] == [(2, "entropy_collapse", 0.3)]
    assert health.stop_reason is None  # on_alarm = "warn"


def test_without_guards_the_health_metrics_are_unchanged(tmp_path: Path):
    health = RunHealth(tmp_path, spike_factor=5.0, spike_window=10)
    assert health.check(0, [], {"train/grad_norm": 1.0, "train/entropy": 0.0}) == {
        "health/num_nonfinite_steps": 0.0,
        "health/grad_norm_spike": 0.0,
    }
    assert health.skip_above() is None and not (tmp_path / ALARMS_FILE_NAME).exists()


def test_stop_policies_set_the_reason(tmp_path: Path):
    stop_on_alarm = RunHealth(
        tmp_path,
        spike_factor=5.0,
        spike_window=10,
        guards=GuardsConfig(mismatch_ceiling=0.01, patience=1, on_alarm="stop"),
    )
    stop_on_alarm.check(3, [], {"offpolicy/kl_k3": 0.5})
    assert stop_on_alarm.stop_reason is not None and stop_on_alarm.stop_reason.startswith("step 3: mismatch alarm")
    stop_on_bad = RunHealth(tmp_path, spike_factor=5.0, spike_window=10, guards=GuardsConfig(on_bad_step="stop"))
    stop_on_bad.check(0, [], {"train/grad_norm": 1.0})
    assert stop_on_bad.stop_reason is None
    stop_on_bad.check(1, [], {"train/grad_norm": float("nan"), "train/num_nonfinite_updates": 1.0})
    assert stop_on_bad.stop_reason == 'step 1: a non-finite gradient; monitoring.guards.on_bad_step = "stop"'


def test_skip_bound_is_the_spike_bound_once_there_is_history(tmp_path: Path):
    health = RunHealth(
        tmp_path, spike_factor=4.0, spike_window=3, min_history=2, guards=GuardsConfig(on_bad_step="skip")
    )
    bounds = []
    for step, norm in enumerate([1.0, 3.0, 2.0, 40.0, 5.0]):
        bounds.append(health.skip_above())
        health.check(step, [], {"train/grad_norm": norm})
    # medians of [1, 3] = 2, of [1, 3, 2] = 2, of the last 3 [3, 2, 40] = 3: bounds 8, 8, 12; 40 counts in the median
    assert bounds == [None, None, 8.0, 8.0, 12.0]
    assert health.check(5, [], {"train/grad_norm": 9.0})["health/grad_norm_spike"] == 0.0  # median 5: bound 20


def test_a_resumed_run_continues_the_streaks_and_records_the_alarms_once(tmp_path: Path):
    config = GuardsConfig(entropy_floor=0.5, patience=3)
    rows = [{"step": step, "train/grad_norm": 1.0, "train/entropy": e} for step, e in enumerate([0.9, 0.4, 0.3, 0.2])]
    whole = RunHealth(tmp_path / "whole", spike_factor=5.0, spike_window=10, guards=config)
    (tmp_path / "whole").mkdir()
    assert [whole.check(r["step"], [], r)["health/alarm_entropy_collapse"] for r in rows] == [0.0, 0.0, 0.0, 1.0]
    # the interrupted run had logged steps 0..2 and then step 3 (its alarm too) after its last checkpoint (step 2)
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    (resumed_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    (resumed_dir / ALARMS_FILE_NAME).write_text(json.dumps({"step": 3, "alarm": "entropy_collapse"}) + "\n")
    resumed = RunHealth(resumed_dir, spike_factor=5.0, spike_window=10, guards=config)
    resumed.resume(3)
    assert resumed.check(3, [], rows[3])["health/alarm_entropy_collapse"] == 1.0
    assert [r["step"] for r in read_alarms(resumed_dir)] == [3]
    assert list(resumed.history) == list(whole.history)


def test_inspect_lists_the_alarms_with_their_steps(tmp_path: Path):
    rows = [{"step": 0, "reward/mean": 0.1}, {"step": 1, "reward/mean": 0.1, "health/alarm_mismatch": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert inspect_run(tmp_path).alarms == ["step 1: mismatch alarm (health/alarm_mismatch)"]
    (tmp_path / ALARMS_FILE_NAME).write_text(json.dumps({"step": 1, "message": "step 1: mismatch alarm: ..."}) + "\n")
    summary = inspect_run(tmp_path)
    assert summary.alarms == ["step 1: mismatch alarm: ..."]
    assert "alarm: step 1: mismatch alarm: ..." in summary.to_text()
