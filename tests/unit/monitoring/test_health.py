"""RunHealth: a step with a non-finite update is dumped and counted; gradient-norm spikes are flagged."""

from __future__ import annotations

import json
from pathlib import Path

from sharpen.monitoring import NONFINITE_DIR_NAME, RunHealth
from sharpen.types import Example, Message, Rollout

ROLLOUT = Rollout(
    example=Example(task_key="t/0", prompt=(Message(role="user", content="q"),)),
    prompt_ids=[1, 2],
    completion_ids=[3],
    completion_logprobs=[-0.5],
    versions=[0],
)


def test_non_finite_steps_are_dumped_and_counted(tmp_path: Path):
    health = RunHealth(tmp_path, spike_factor=5.0, spike_window=10)
    assert health.check(0, [ROLLOUT], {"train/grad_norm": 1.0, "train/num_nonfinite_updates": 0.0}) == {
        "health/num_nonfinite_steps": 0.0,
        "health/grad_norm_spike": 0.0,
    }
    metrics = health.check(1, [ROLLOUT, ROLLOUT], {"train/grad_norm": float("nan"), "train/num_nonfinite_updates": 1})
    assert metrics["health/num_nonfinite_steps"] == 1.0
    dumped = (tmp_path / NONFINITE_DIR_NAME / "step_1.jsonl").read_text().splitlines()
    assert [json.loads(line)["completion_ids"] for line in dumped] == [[3], [3]]


def test_a_gradient_norm_far_above_its_recent_median_is_a_spike(tmp_path: Path):
    health = RunHealth(tmp_path, spike_factor=5.0, spike_window=10, min_history=3)
    flags = [
        health.check(i, [], {"train/grad_norm": norm})["health/grad_norm_spike"]
        for i, norm in enumerate([1.0, 100.0, 1.2, 0.9, 1.1, 4.9, 6.0, 1.0])
    ]
    # 100 comes before there is history to judge; 4.9 is under 5x the median; 6.0 is over it
    assert flags == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
