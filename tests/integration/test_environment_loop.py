"""The whole loop with environments: tiny random model, scripted multi-turn policy, real trainer; the recorded
episodes replay exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tiny_loop import tiny_config, vowel_reward

from sharpen.cli.main import main
from sharpen.config.engines import ScriptedEngineConfig
from sharpen.config.environments import (
    CalculatorEnvironmentConfig,
    GuessNumberEnvironmentConfig,
    PythonEnvironmentConfig,
)
from sharpen.config.schema import EnvironmentTasksDataConfig
from sharpen.monitoring import read_jsonl
from sharpen.orchestration.embedded import run_embedded

TOOL_CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "3 + 4"}}</tool_call>'


@pytest.mark.slow
def test_grpo_on_the_calculator_environment_trains_on_generated_tokens_only(
    tiny_model_path: Path, tmp_path: Path, capsys
) -> None:
    config = tiny_config(tiny_model_path, tmp_path, name="tools", num_steps=2, **{"weight_sync.verify": "false"})
    config.rollout.engine = ScriptedEngineConfig(completions=[TOOL_CALL, "<answer>7</answer>", "aeiou"])
    config.environment = CalculatorEnvironmentConfig(max_turns=3)
    config.rollout.max_new_tokens = 40
    config.monitoring.num_recorded_rollouts = 8
    run_dir = run_embedded(config, reward_fn=vowel_reward)

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1]
    recorded = read_jsonl(run_dir / "rollouts.jsonl")
    multi_turn = [r for r in recorded if r["loss_mask"] is not None]
    assert multi_turn, "some episodes called the tool"
    for record in multi_turn:
        turns = record["episode"]["turns"]
        assert len(turns) >= 2 and turns[0]["observation_ids"]
        assert sum(record["loss_mask"]) == sum(t["num_action_tokens"] for t in turns)
    for row, step in zip(rows, (0, 1), strict=True):
        generated = sum(
            sum(r["loss_mask"]) if r["loss_mask"] else len(r["completion_ids"]) for r in recorded if r["step"] == step
        )
        assert row["train/num_loss_tokens"] == generated  # all 8 rollouts of the step are recorded
        assert row["rollout/num_turns_mean"] > 1.0

    step_1 = [r for r in recorded if r["step"] == 1]
    index = next(i for i, r in enumerate(step_1) if r["loss_mask"] is not None)
    assert main(["replay", str(run_dir), "--step", "1", "--index", str(index)]) == 0
    assert "reproduced: " in capsys.readouterr().out


@pytest.mark.slow
def test_a_game_that_makes_its_own_tasks_rewards_from_the_environment(tiny_model_path: Path, tmp_path: Path) -> None:
    config = tiny_config(tiny_model_path, tmp_path, name="game", num_steps=1, **{"weight_sync.verify": "false"})
    config.environment = GuessNumberEnvironmentConfig(max_turns=4, low=1, high=4)
    config.data = EnvironmentTasksDataConfig(size=16)
    config.rollout.engine = ScriptedEngineConfig(completions=["1", "2", "3", "4"])
    run_dir = run_embedded(config)
    [row] = read_jsonl(run_dir / "metrics.jsonl")
    assert row["reward/num_abstained"] == 0
    assert 0.0 < row["reward/mean"] <= 1.0
    recorded = read_jsonl(run_dir / "rollouts.jsonl")
    assert {r["reward"]["verifier"] for r in recorded} == {"environment:guess_number"}


@pytest.mark.slow
def test_grpo_on_the_python_environment_runs_code_in_the_sandbox(tiny_model_path: Path, tmp_path: Path, capsys) -> None:
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(3 + 4)"}}</tool_call>'
    config = tiny_config(tiny_model_path, tmp_path, name="python", num_steps=2, **{"weight_sync.verify": "false"})
    config.rollout.engine = ScriptedEngineConfig(completions=[call, "<answer>7</answer>", "aeiou"])
    config.environment = PythonEnvironmentConfig(max_turns=3)
    config.rollout.max_new_tokens = 40
    config.monitoring.num_recorded_rollouts = 8
    run_dir = run_embedded(config, reward_fn=vowel_reward)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 2 and all(row["reward/num_abstained"] == 0 for row in rows)
    recorded = read_jsonl(run_dir / "rollouts.jsonl")
    tool_turns = [r for r in recorded if r["loss_mask"] is not None]
    assert tool_turns and {r["episode"]["sandbox_backend"] for r in recorded} == {"bwrap"}
    step_1 = [r for r in recorded if r["step"] == 1]
    index = next(i for i, r in enumerate(step_1) if r["loss_mask"] is not None)
    assert main(["replay", str(run_dir), "--step", "1", "--index", str(index)]) == 0  # the program runs again
    assert "reproduced" in capsys.readouterr().out
