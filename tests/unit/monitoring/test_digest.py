"""The episode digest: every field it covers changes it, the order of a step's rollouts is part of it, logprobs are
not, and the rollout recorder's running digest survives a resume."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sharpen.monitoring import DIGEST_FILE_NAME, EpisodeDigest, RolloutRecorder, read_jsonl
from sharpen.types import Example, Message, RewardResult, RewardStatus, Rollout

EXAMPLES = [Example(task_key=f"t/{i}", prompt=(Message(role="user", content=f"task {i}"),), answer="3") for i in (0, 1)]


def rollout(task: int = 0, sample: int = 0, **changes) -> Rollout:
    fields = {
        "example": EXAMPLES[task],
        "prompt_ids": [1, 2, 3],
        "completion_ids": [10, 11, 12, 13],
        "completion_logprobs": [-0.5, 0.0, 0.0, -0.25],
        "versions": [4, 4, 4, 5],
        "loss_mask": [True, False, False, True],
        "sample_index": sample,
        "reward": RewardResult(score=1.0, status=RewardStatus.OK),
    }
    return Rollout(**{**fields, **changes})


def step_rollouts() -> list[Rollout]:
    return [rollout(e, s) for e in (0, 1) for s in (0, 1)]


def digest_of(*steps: list[Rollout]) -> str:
    digest = EpisodeDigest()
    for step, rollouts in enumerate(steps):
        digest.add_step(step, rollouts)
    return digest.hexdigest


def test_the_same_rollouts_give_the_same_digest_and_each_covered_field_changes_it() -> None:
    reference = digest_of(step_rollouts(), step_rollouts())
    assert reference == digest_of(step_rollouts(), step_rollouts()) and len(reference) == 64
    variants = {
        "one prompt token": {"prompt_ids": [1, 2, 4]},
        "one completion token": {"completion_ids": [10, 11, 12, 14]},
        "a token moved from completion to prompt": {
            "prompt_ids": [1, 2, 3, 10],
            "completion_ids": [11, 12, 13],
            "completion_logprobs": [0.0, 0.0, -0.25],
            "versions": [4, 4, 5],
            "loss_mask": [False, False, True],
        },
        "one loss-mask entry": {"loss_mask": [True, True, False, True]},
        "no loss mask (single-turn)": {"loss_mask": None},
        "one token's version": {"versions": [4, 4, 5, 5]},
        "the score": {"reward": RewardResult(score=0.5, status=RewardStatus.OK)},
        "the status": {"reward": RewardResult(score=1.0, status=RewardStatus.WRONG)},
        "an abstention": {"reward": RewardResult(score=None, status=RewardStatus.OK)},
        "no reward": {"reward": None},
        "the sample index": {"sample_index": 7},
        "the task": {"example": dataclasses.replace(EXAMPLES[0], answer="4")},
        "an earlier segment": {
            "segments": [rollout(completion_ids=[9], completion_logprobs=[0.0], versions=[4], loss_mask=None)]
        },
    }
    seen = {reference}
    for name, change in variants.items():
        changed = step_rollouts()
        changed[2] = rollout(1, 0, **change)
        digest = digest_of(step_rollouts(), changed)
        assert digest not in seen, f"{name} did not change the digest"
        seen.add(digest)


def test_order_and_step_boundaries_are_part_of_the_digest_logprobs_and_text_are_not() -> None:
    reference = digest_of(step_rollouts())
    assert digest_of(step_rollouts()[::-1]) != reference
    assert digest_of(step_rollouts()[:2], step_rollouts()[2:]) != reference
    assert digest_of([], step_rollouts()) != reference  # the step index is hashed too
    unweighted = [dataclasses.replace(r, completion_logprobs=[-9.0] * 4, completion_text="x") for r in step_rollouts()]
    assert digest_of(unweighted) == reference


def test_a_state_continues_a_digest() -> None:
    first = EpisodeDigest()
    first.add_step(0, step_rollouts())
    resumed = EpisodeDigest(first.hexdigest, num_rollouts=first.num_rollouts)
    resumed.add_step(1, step_rollouts())
    assert resumed.hexdigest == digest_of(step_rollouts(), step_rollouts()) and resumed.num_rollouts == 8
    with pytest.raises(ValueError, match="64 hex digits"):
        EpisodeDigest("abc")


def test_the_recorder_keeps_a_running_digest_of_every_rollout_that_survives_a_resume(tmp_path: Path) -> None:
    path = tmp_path / DIGEST_FILE_NAME
    recorder = RolloutRecorder(tmp_path / "rollouts.jsonl", num_per_step=0, digest_path=path)
    for step in range(3):
        recorder.record(step, step_rollouts())
    recorder.close()
    records = read_jsonl(path)
    assert [r["step"] for r in records] == [0, 1, 2] and [r["num_rollouts"] for r in records] == [4, 4, 4]
    assert records[-1]["digest"] == digest_of(step_rollouts(), step_rollouts(), step_rollouts())
    assert not (tmp_path / "rollouts.jsonl").exists()  # num_per_step = 0 still records no rollouts

    interrupted = tmp_path / "interrupted"
    recorder = RolloutRecorder(interrupted / "rollouts.jsonl", num_per_step=1, digest_path=interrupted / "d.jsonl")
    for step in range(3):  # steps 1 and 2 were made but not checkpointed
        recorder.record(step, [rollout(completion_ids=[0, 0, 0, 0])] if step == 2 else step_rollouts())
    recorder.close()
    resumed = RolloutRecorder(
        interrupted / "rollouts.jsonl", num_per_step=1, resume_from_step=0, digest_path=interrupted / "d.jsonl"
    )
    assert resumed.digest is not None and resumed.digest.num_rollouts == 4
    for step in (1, 2):
        resumed.record(step, step_rollouts())
    resumed.close()
    assert read_jsonl(interrupted / "d.jsonl")[-1] == records[-1]
