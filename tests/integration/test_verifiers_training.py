"""Environments of the verifiers package train through the agent endpoint, unchanged: a single-turn taskset scored by
its ``@vf.reward``s and a multi-turn one whose verifiers `Env` plays the user turn by turn each train two steps
(scripted policy, tiny random model, real trainer). verifiers' own chat program, interception server and scoring run
each episode; the trainer steps on the engine's tokens and the tasks' rewards.

The environments are tests/unit/environments/vf_arithmetic.py and vf_guessing.py, importable by id while that folder
is on sys.path (an installed hub environment is imported the same way)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1", reason="the agents extra is not installed")

from sharpen.config import load_config
from sharpen.monitoring import read_jsonl

ENVIRONMENTS = Path(__file__).resolve().parents[1] / "unit" / "environments"


def _train(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taskset: str, completions: list[str]
):
    import torch

    from sharpen.orchestration.runtime import run

    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    monkeypatch.chdir(tmp_path)
    overrides = {
        "run.name": json.dumps(taskset),
        "run.num_steps": "2",
        "model.path": json.dumps(str(tiny_model_path)),
        "environment": f'{{type = "verifiers", taskset = "{taskset}"}}',
        "environment.max_turns": "4",
        "data": '{type = "environment", size = 4}',
        "rollout.engine": f"{{type = 'scripted', completions = {json.dumps(completions)}}}",
        "rollout.prompts_per_step": "2",
        "rollout.num_samples_per_prompt": "2",
        "rollout.max_new_tokens": "16",
        "trainer.micro_batch_size": "2",
        "weight_sync.verify": "false",
        "monitoring.progress": "false",
        "monitoring.num_recorded_rollouts": "4",
    }
    config = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    previous_threads = torch.get_num_threads()
    try:
        run_dir = run(config)
    finally:
        torch.set_num_threads(previous_threads)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(row["train/loss"]) for row in rows)
    return rows, read_jsonl(run_dir / "rollouts.jsonl")


@pytest.mark.slow
def test_a_single_turn_verifiers_environment_trains_on_its_rubric(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the first sums are 1 + 3 and 2 + 2: "It is 4" is right for both, "It is 5" for neither
    rows, recorded = _train(tiny_model_path, tmp_path, monkeypatch, "vf-arithmetic", ["It is 4", "It is 5"])
    assert all(row["train/num_sequences"] == 4 for row in rows)
    assert recorded
    for record in recorded:
        [turn] = record["episode"]["turns"]  # one model call
        assert turn["info"]["rewards"]["correct"] == turn["reward"]
        assert sum(record["loss_mask"] or [1] * len(record["completion_ids"])) == turn["num_action_tokens"]
    assert {r["episode"]["turns"][0]["reward"] for r in recorded} == {0.0, 1.0}


@pytest.mark.slow
def test_a_multi_turn_verifiers_environment_trains_on_every_turn(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # secrets 6 and 3; guesses 5, 7, 6, ... get "Higher."/"Lower." from the environment between calls
    rows, recorded = _train(tiny_model_path, tmp_path, monkeypatch, "vf-guessing", ["5", "7", "6", "3"])
    assert all(row["train/num_sequences"] == 4 for row in rows)  # one sequence per episode: its turns continue
    multi_turn = [r for r in recorded if len(r["episode"]["turns"]) > 1]
    assert multi_turn, "no episode took more than one turn"
    for record in multi_turn:
        mask, turns = record["loss_mask"], record["episode"]["turns"]
        # generated tokens (mask 1) are the calls' tokens; the environment's replies between them are inputs (mask 0)
        assert sum(mask) == sum(t["num_action_tokens"] for t in turns)
        assert sum(1 - m for m in mask) == sum(len(t["observation_ids"]) for t in turns)
        assert record["segments"] == []
        assert turns[-1]["reward"] in (0.0, 1.0) and "solved" in turns[-1]["info"]["rewards"]
