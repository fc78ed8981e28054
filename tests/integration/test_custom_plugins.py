"""A new environment and a new reward need no edit of sharpen: both load from the user's file, and a tiny run
trains with them on a Hugging Face dataset file (scripted policy, tiny random model, real trainer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sharpen.config import load_config
from sharpen.monitoring import read_jsonl

PLUGINS = '''
from sharpen.environments import EpisodeContext, StepResult
from sharpen.types import Example, Message


class AskTwice:
    """Two turns: the policy answers, is asked again, and its second answer is scored by the run's rubric."""

    name = "ask_twice"
    version = "1"

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        self.num_turns = 0
        return list(example.prompt)

    async def step(self, action: str) -> StepResult:
        self.num_turns += 1
        if self.num_turns < 2:
            return StepResult(observation=[Message(role="user", content=self.follow_up)])
        return StepResult(terminated=True)


def ask_twice(*, follow_up: str) -> AskTwice:
    environment = AskTwice()
    environment.follow_up = follow_up
    return environment


def vowels(example: Example, completion: str, *, scale: float) -> float:
    return scale * sum(ch in "aeiou" for ch in completion) / max(len(completion), 1)
'''


@pytest.mark.slow
def test_a_custom_environment_and_a_custom_reward_from_a_file_train(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets
    import torch

    from sharpen.orchestration.runtime import run

    (tmp_path / "plugins.py").write_text(PLUGINS)
    words = ["apple", "river", "cloud", "stone"]
    datasets.Dataset.from_dict(
        {"question": [f"Say {w}." for w in words], "answer": words, "level": [1, 2, 3, 4]}
    ).to_parquet(tmp_path / "words.parquet")
    monkeypatch.chdir(tmp_path)  # the recipe's paths are relative to where sharpen runs
    overrides = {
        "run.name": json.dumps("plugins"),
        "run.num_steps": "2",
        "model.path": json.dumps(str(tiny_model_path)),
        "data": '{type = "hf", path = "words.parquet", prompt_field = "question"}',
        "environment": '{type = "custom", factory = "plugins.py:ask_twice", kwargs = {follow_up = "Again?"}}',
        "environment.max_turns": "2",
        "reward.correct_weight": "0.0",
        "reward.components": '[{type = "custom", function = "plugins.py:vowels", kwargs = {scale = 2.0}}]',
        "rollout.engine": '{type = "scripted", completions = ["aeiou", "xyz", "hello", "brr", "oi"]}',
        "rollout.prompts_per_step": "2",
        "rollout.num_samples_per_prompt": "4",
        "rollout.max_new_tokens": "8",
        "trainer.micro_batch_size": "4",
        "weight_sync.verify": "false",
        "monitoring.progress": "false",
        "monitoring.num_recorded_rollouts": "8",
    }
    config = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    previous_threads = torch.get_num_threads()
    try:
        run_dir = run(config)
    finally:
        torch.set_num_threads(previous_threads)

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 2 and all(row["reward/num_abstained"] == 0 for row in rows)
    assert all(0.0 < row["reward/custom"] <= 2.0 and row["reward/mean"] == row["reward/custom"] for row in rows)
    recorded = read_jsonl(run_dir / "rollouts.jsonl")
    assert all(r["reward"]["verifier"] == "exact_match+custom:vowels" for r in recorded)
    assert all(len(r["episode"]["turns"]) == 2 for r in recorded)  # the environment asked again
    assert {r["task_key"] for r in recorded} <= {f"words/{i}" for i in range(4)}
