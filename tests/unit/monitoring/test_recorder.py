"""The rollout recorder: fields, which rollouts are kept, resume truncation."""

from __future__ import annotations

from pathlib import Path

from sharpen.monitoring import RolloutRecorder, read_jsonl
from sharpen.types import EpisodeRecord, Example, Message, RewardResult, RewardStatus, Rollout, TurnRecord

EXAMPLE = Example(
    task_key="basic_arithmetic/3",
    prompt=(Message(role="system", content="Answer in tags."), Message(role="user", content="1 + 2 = ?")),
    answer="3",
)


def _rollout(index: int, *, reward: RewardResult | None = None) -> Rollout:
    return Rollout(
        example=EXAMPLE,
        prompt_ids=[1, 2, 3],
        completion_ids=[10 + index, 11],
        completion_logprobs=[-0.5, -0.25],
        versions=[4, 4],
        completion_text=f"<answer>{index}</answer>",
        is_truncated=index == 1,
        sample_index=index,
        reward=reward,
        advantage=0.5 * index,
    )


def test_record_fields(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    recorder = RolloutRecorder(path, num_per_step=1)
    reward = RewardResult(score=1.0, status=RewardStatus.OK, components={"correct": 1.0, "format": 1.0}, verifier="m")
    recorder.record(7, [_rollout(0, reward=reward)])
    (record,) = read_jsonl(path)  # flushed per call: readable before close
    recorder.close()
    assert record == {
        "step": 7,
        "task_key": "basic_arithmetic/3",
        "task_hash": EXAMPLE.task_hash,
        "sample_index": 0,
        "prompt": [
            {"role": "system", "content": "Answer in tags."},
            {"role": "user", "content": "1 + 2 = ?"},
        ],
        "prompt_ids": [1, 2, 3],
        "images": [],
        "completion_text": "<answer>0</answer>",
        "completion_ids": [10, 11],
        "completion_logprobs": [-0.5, -0.25],
        "versions": [4, 4],
        "reward": {"score": 1.0, "status": "ok", "components": {"correct": 1.0, "format": 1.0}, "verifier": "m"},
        "advantage": 0.0,
        "is_truncated": False,
        "loss_mask": None,
        "episode": None,
        "segments": [],
    }


def test_multi_turn_records_keep_the_loss_mask_and_the_episode(tmp_path: Path) -> None:
    rollout = _rollout(0)
    rollout.loss_mask = [True, False]
    rollout.episode = EpisodeRecord(
        environment="calculator",
        environment_version="1",
        seed=42,
        turns=[TurnRecord(action_text="a", num_action_tokens=1, observation_ids=[11], info={"tool_calls": []})],
        stop_reason="max_turns",
    )
    recorder = RolloutRecorder(tmp_path / "rollouts.jsonl", num_per_step=1)
    recorder.record(0, [rollout])
    recorder.close()
    (record,) = read_jsonl(tmp_path / "rollouts.jsonl")
    assert record["loss_mask"] == [1, 0]
    assert record["episode"]["seed"] == 42 and record["episode"]["stop_reason"] == "max_turns"
    assert record["episode"]["turns"][0]["observation_ids"] == [11]


def test_records_first_num_per_step_and_unscored(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    recorder = RolloutRecorder(path, num_per_step=2)
    recorder.record(0, [_rollout(i) for i in range(4)])
    recorder.record(1, [_rollout(3)])
    recorder.close()
    records = read_jsonl(path)
    assert [(r["step"], r["sample_index"]) for r in records] == [(0, 0), (0, 1), (1, 3)]
    assert records[1]["is_truncated"] is True
    assert records[0]["reward"] is None


def test_resume_truncates_and_zero_records_nothing(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    recorder = RolloutRecorder(path, num_per_step=1)
    for step in range(3):
        recorder.record(step, [_rollout(0)])
    recorder.close()
    resumed = RolloutRecorder(path, num_per_step=1, resume_from_step=0)
    resumed.record(1, [_rollout(2)])
    resumed.close()
    assert [(r["step"], r["sample_index"]) for r in read_jsonl(path)] == [(0, 0), (1, 2)]

    off = RolloutRecorder(tmp_path / "off.jsonl", num_per_step=0)
    off.record(0, [_rollout(0)])
    off.close()
    assert not (tmp_path / "off.jsonl").exists()


def test_an_image_prompt_is_recorded_with_its_digest_not_its_bytes(tmp_path: Path) -> None:
    import hashlib

    from sharpen.types import ImagePart, TextPart

    image = ImagePart(data=b"\x89PNG fake bytes")
    prompt = (Message(role="user", content=(image, TextPart(text="colour?"))),)
    rollout = _rollout(0)
    rollout.example = Example(task_key="colour/0", prompt=prompt)
    rollout.images = (image,)
    recorder = RolloutRecorder(tmp_path / "rollouts.jsonl", num_per_step=1)
    recorder.record(0, [rollout])
    recorder.close()
    (record,) = read_jsonl(tmp_path / "rollouts.jsonl")
    digest = {"type": "image", "sha256": hashlib.sha256(image.data).hexdigest(), "num_bytes": len(image.data)}
    assert record["prompt"] == [{"role": "user", "content": [digest, {"type": "text", "text": "colour?"}]}]
    assert record["images"] == [digest]  # the rollout's images (observations' too), in order
