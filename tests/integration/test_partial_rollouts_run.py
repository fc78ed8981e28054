"""Partial rollouts (``rollout.partial``) through the real loop with the tiny model on the hf engine: groups really are
carried unfinished into the next step and go on there from their tokens with newer weights, two runs train on
identical batches, and a run that dies after a checkpoint and is run again with ``--resume auto`` trains on what the
uninterrupted run trains on, in sync and in async mode.

The tiny random model almost never samples its EOS token, so every completion would end at the length limit in the
same round and no group would be carried unfinished: `StopTokensEngine` makes every fourth token id a stop token (a
sampled token stops with probability ~1/4), so completion lengths, and the round each group completes in, differ."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_async import RecordingTrainer, comparable, components
from test_tiny_loop import tiny_config, vowel_reward

from sharpen.config import SharpenConfig
from sharpen.config.environments import GuessNumberEnvironmentConfig
from sharpen.config.schema import EnvironmentTasksDataConfig
from sharpen.monitoring import DIGEST_FILE_NAME, read_jsonl
from sharpen.orchestration.embedded import run_embedded
from sharpen.types import Completion, SamplingParams

pytestmark = pytest.mark.slow

STOP_EVERY = 4
PARTIAL = {
    "rollout.partial.enabled": "true",
    "rollout.partial.extra_prompts": "2",
    "rollout.partial.max_steps_spanned": "2",
    "rollout.partial.chunk_tokens": "4",
    "rollout.max_new_tokens": "16",
    "rollout.num_samples_per_prompt": "2",  # small groups: some complete in the first round, some need more
    "trainer.micro_batch_size": "2",
    "run.checkpoint_every": "2",
    "run.export_model": "false",
}
MODES = {"sync": {}, "async": {"rollout.mode": '"async"', "rollout.max_staleness": "1"}}
MULTI_TURN = GuessNumberEnvironmentConfig(max_turns=3, max_episode_tokens=96)
"""The random model writes no number, so each turn is answered "Reply with one whole number." until the third; a turn
ends at a stop token, so episodes are carried within a turn and between turns."""


class StopTokensEngine:
    """An engine whose every request also stops at the token ids divisible by ``every`` (the engine's own
    stop-token handling, as for an EOS token)."""

    def __init__(self, engine: Any, vocab_size: int, *, every: int = STOP_EVERY) -> None:
        self.engine = engine
        self.stop = tuple(range(every, vocab_size, every))

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        return self.engine.generate(
            prompts, [replace(p, stop_token_ids=(*p.stop_token_ids, *self.stop)) for p in params]
        )

    def score(self, token_ids: list[int]) -> list[float]:
        return self.engine.score(token_ids)

    def load_weights(self, weights: Any, *, version: int) -> dict[str, float]:
        return self.engine.load_weights(weights, version=version)

    def close(self) -> None:
        self.engine.close()


def partial_run(
    config: SharpenConfig, *, fail_at: int | None = None, resume: Any = False
) -> tuple[RecordingTrainer, Path]:
    """One run of ``config`` with the stop tokens: its trainer, which recorded what each step trained on, and its
    run directory."""
    trainer, slow = components(config, engine="hf")
    trainer.fail_at = fail_at
    vocab_size = json.loads((Path(config.model.path) / "config.json").read_text())["vocab_size"]
    engine = StopTokensEngine(slow.engine, vocab_size)
    try:
        run_dir = run_embedded(config, reward_fn=vowel_reward, engine=engine, trainer=trainer, resume=resume)  # pyright: ignore
    finally:
        engine.close()
    return trainer, run_dir


@pytest.mark.parametrize(
    ("mode", "environment"), [("sync", "single_turn"), ("async", "single_turn"), ("sync", "guess_number")]
)
def test_partial_runs_carry_groups_repeat_run_to_run_and_resume_exactly(
    tiny_model_path: Path, tmp_path: Path, mode: str, environment: str
) -> None:
    def config(name: str) -> SharpenConfig:
        made = tiny_config(tiny_model_path, tmp_path, name=name, num_steps=4, **PARTIAL, **MODES[mode])
        if environment == "guess_number":
            made.environment, made.data = MULTI_TURN, EnvironmentTasksDataConfig(size=64)
        return made

    full, full_dir = partial_run(config("full"))
    again, again_dir = partial_run(config("again"))
    with pytest.raises(RuntimeError, match="died in step 3"):
        partial_run(config("crash"), fail_at=3)  # after the checkpoint of step 2 (steps 0 and 1 trained)
    resumed, resumed_dir = partial_run(config("crash"), resume="auto")  # the same command, rerun as a job would be

    full_rows = comparable(read_jsonl(full_dir / "metrics.jsonl"))
    # groups were carried, some unfinished: resumed at the next step from their tokens with newer weights
    assert all(row["partial/num_carried_groups"] > 0 for row in full_rows)
    assert sum(row["partial/num_resumed_groups"] for row in full_rows) > 0
    spanning = [r for _, rollouts in full.batches for r in rollouts if len(set(r["versions"])) > 1]
    assert spanning, "no trained completion was generated by two policy versions"
    assert [step for step, _ in full.batches] == [0, 1, 2, 3]
    if environment != "single_turn":  # episodes of several turns were carried and trained
        assert max(row["rollout/num_turns_mean"] for row in full_rows) > 1
    if mode == "async":  # carried tokens are up to max_steps_spanned - 1 versions older than the batch's generation
        bound = 1 + 1
        staleness = [step - v for step, rollouts in full.batches for r in rollouts for v in r["versions"]]
        assert max(staleness) == bound
        assert all(row["async/staleness_max"] <= bound for row in full_rows)
        histogram = [sum(row[f"async/staleness_{s}"] for s in range(bound + 1)) for row in full_rows]
        assert histogram == pytest.approx([1.0] * 4)

    # two runs: the same batches, the same metrics
    assert again.batches == full.batches
    assert comparable(read_jsonl(again_dir / "metrics.jsonl")) == full_rows

    # resumed after the crash: steps 2 and 3 trained on exactly the uninterrupted run's batches
    assert [step for step, _ in resumed.batches] == [2, 3]
    assert resumed.batches == full.batches[2:]
    loads = ("sync/", "async/num_weight_loads")  # async: the resumed engine loads its version at start (test_async)
    resumed_rows = comparable(read_jsonl(resumed_dir / "metrics.jsonl"), drop=loads)
    assert [row["step"] for row in resumed_rows] == [0, 1, 2, 3]
    assert resumed_rows == comparable(read_jsonl(full_dir / "metrics.jsonl"), drop=loads)
    assert read_jsonl(resumed_dir / DIGEST_FILE_NAME) == read_jsonl(full_dir / DIGEST_FILE_NAME)
