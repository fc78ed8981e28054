"""The rollout recorder: a few whole rollouts per step, written as JSON lines, to read what the policy actually did.

Owns the on-disk record of a rollout (prompt, completion text and tokens, logprobs, policy versions, reward,
advantage, loss mask, and the episode record that `sharpen replay` re-runs). Does not choose what is trained on or
compute anything; it reads `Rollout`s after they are scored. Which rollouts are kept is deterministic: the first
``num_per_step`` of the step's list, in order, so a group's samples appear side by side (with their advantages)
and a rerun with the same seed records the same rollouts.

With a ``digest_path`` it also keeps the run's `EpisodeDigest` over every rollout of every step (not only the
recorded ones) and appends ``{"step", "num_rollouts", "digest"}`` per step: the last line identifies everything the
run generated, so two runs (another concurrency, a resume) can be compared by one string.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from sharpen.monitoring.digest import EpisodeDigest
from sharpen.monitoring.sinks import read_jsonl, truncate_jsonl_after
from sharpen.types import Rollout

ROLLOUTS_FILE_NAME = "rollouts.jsonl"


def rollout_record(step: int, rollout: Rollout) -> dict[str, Any]:
    """The JSON-serialisable record of one rollout of ``step``."""
    reward = rollout.reward
    return {
        "step": step,
        "task_key": rollout.example.task_key,
        "task_hash": rollout.example.task_hash,
        "sample_index": rollout.sample_index,
        "prompt": [{"role": m.role, "content": m.to_json()} for m in rollout.example.prompt],
        "prompt_ids": list(rollout.prompt_ids),
        "images": [image.to_json() for image in rollout.images],  # digests (or paths), never the bytes
        "completion_text": rollout.completion_text,
        "completion_ids": list(rollout.completion_ids),
        "completion_logprobs": list(rollout.completion_logprobs),
        "versions": list(rollout.versions),
        "reward": None
        if reward is None
        else {
            "score": reward.score,
            "status": reward.status.value,
            "components": dict(reward.components),
            "verifier": reward.verifier,
        },
        "advantage": rollout.advantage,
        "is_truncated": rollout.is_truncated,
        "loss_mask": None if rollout.loss_mask is None else [int(m) for m in rollout.loss_mask],
        "episode": None if rollout.episode is None else dataclasses.asdict(rollout.episode),
        "segments": [_segment_record(s) for s in rollout.segments],
    }


def _segment_record(segment: Rollout) -> dict[str, Any]:
    """An earlier segment of an agent episode (trained with the rollout's advantage)."""
    return {
        "prompt_ids": list(segment.prompt_ids),
        "completion_ids": list(segment.completion_ids),
        "completion_logprobs": list(segment.completion_logprobs),
        "versions": list(segment.versions),
        "loss_mask": None if segment.loss_mask is None else [int(m) for m in segment.loss_mask],
    }


class RolloutRecorder:
    """Appends up to ``num_per_step`` rollouts of each step to a JSONL file, flushed per call.

    ``num_per_step = 0`` records no rollouts and creates no rollouts file. Like `JsonlSink`, existing files are
    continued (the digest from its last line), and ``resume_from_step`` drops what an interrupted run recorded after
    that step. ``rollouts`` are a step's, in the loop's order (example order, each group's samples in order).
    """

    def __init__(
        self,
        path: Path,
        *,
        num_per_step: int,
        resume_from_step: int | None = None,
        digest_path: Path | None = None,
    ) -> None:
        if num_per_step < 0:
            raise ValueError(f"num_per_step must be >= 0, got {num_per_step}")
        self.path = Path(path)
        self.num_per_step = num_per_step
        self._file = None
        if num_per_step > 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            truncate_jsonl_after(self.path, resume_from_step)
            self._file = self.path.open("a", encoding="utf-8")
        self.digest: EpisodeDigest | None = None
        self._digest_file = None
        if digest_path is not None:
            digest_path = Path(digest_path)
            digest_path.parent.mkdir(parents=True, exist_ok=True)
            truncate_jsonl_after(digest_path, resume_from_step)
            done = read_jsonl(digest_path) if digest_path.exists() else []
            num_done = sum(record["num_rollouts"] for record in done)
            self.digest = EpisodeDigest(done[-1]["digest"], num_rollouts=num_done) if done else EpisodeDigest()
            self._digest_file = digest_path.open("a", encoding="utf-8")

    def record(self, step: int, rollouts: list[Rollout]) -> None:
        if self.digest is not None and self._digest_file is not None:
            digest = self.digest.add_step(step, rollouts)
            line = {"step": step, "num_rollouts": len(rollouts), "digest": digest}
            self._digest_file.write(json.dumps(line) + "\n")
            self._digest_file.flush()
        if self._file is None:
            return
        for rollout in rollouts[: self.num_per_step]:
            self._file.write(json.dumps(rollout_record(step, rollout)) + "\n")
        self._file.flush()

    def close(self) -> None:
        for file in (self._file, self._digest_file):
            if file is not None:
                file.close()
