"""The run doctor on a real run made to go wrong (the tiny model, the transformers engine): completions cut at two
tokens, a reward that abstains on half the rollouts and scores the rest 0. `sharpen inspect` and the end of
`sharpen train` must name each condition with its metric and the key to change."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from sharpen.config import load_config
from sharpen.monitoring import read_jsonl
from sharpen.monitoring.inspect import inspect_run
from sharpen.orchestration.embedded import run_embedded
from sharpen.types import Example, RewardResult, RewardStatus


class HalfAbstaining:
    """Abstains (score None) on every other rollout it sees, and scores the others 0 (counted under a lock: rewards
    may be scored on several threads)."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, example: Example, completion: str) -> RewardResult:
        with self.lock:
            self.calls += 1
            abstains = self.calls % 2 == 1
        if abstains:
            return RewardResult(score=None, status=RewardStatus.FORMAT_ERROR, verifier="half")
        return RewardResult(score=0.0, status=RewardStatus.WRONG, verifier="half")


@pytest.mark.slow
def test_the_doctor_names_truncation_abstention_and_a_flat_reward_of_a_real_run(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    overrides = {
        "run.name": json.dumps("doctor"),
        "run.output_dir": json.dumps(str(tmp_path)),
        "run.num_steps": "3",
        "model.path": json.dumps(str(tiny_model_path)),
        "rollout.engine.type": '"hf"',
        "rollout.prompts_per_step": "2",
        "rollout.num_samples_per_prompt": "4",
        "rollout.max_new_tokens": "2",
        "trainer.micro_batch_size": "4",
        "monitoring.progress": "false",
    }
    config = load_config(None, [f"{key}={value}" for key, value in overrides.items()])
    run_dir = run_embedded(config, reward_fn=HalfAbstaining())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["reward/abstained_fraction"] for row in rows] == [0.5, 0.5, 0.5]  # 4 of 8 rollouts each step
    warnings = inspect_run(run_dir).warnings
    truncated = next(w for w in warnings if "truncated" in w)
    assert "(rollout/truncated_fraction): raise rollout.max_new_tokens" in truncated
    assert any(w.startswith("50% of rollouts abstained on average (reward/abstained_fraction;") for w in warnings)
    assert (
        "the reward was 0 in every step: check the reward on a few rollouts (rollouts.jsonl, reward/status_*)"
        in warnings
    )
