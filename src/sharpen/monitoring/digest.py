"""The episode digest: one hex string that stands for every rollout a run made, to check that two runs made the
same episodes (another concurrency, scheduling, number of replicas, or a resume) without keeping them.

Owns the canonical byte form of a finished rollout and the running hash over them. Each rollout contributes its
task hash, sample index, prompt ids, completion ids, loss mask, per-token policy versions (of each earlier segment
too, for an agent episode split where it rewrote its history) and its reward's score and status. Logprobs and
texts are left out on purpose: the texts follow from the tokens, and a real engine's logprobs differ in their last
bits with the batch a request shared, which is not a different episode.

Order is canonical, not the order episodes finished in: `EpisodeDigest.add_step` takes a step's rollouts in the
order `EpisodeRunner.generate_groups` returns them (example order, each group's samples in order), which the loop
and the rollout recorder also use. The state after each step is a chain, ``state = H(state, step, n, H(step's
rollouts))``, so it is a short string that a resumed run restores (from ``run_dir/episode_digest.jsonl``) and goes
on from: a resume that makes the same rollouts ends with the same digest. Memory is constant: nothing is kept per
rollout or per step.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Iterable

from sharpen.types import Example, Rollout

DIGEST_FILE_NAME = "episode_digest.jsonl"
EMPTY_DIGEST = "0" * 64
"""The state before any step."""

_HEADER = struct.Struct("<16sqqqbd")
"""task hash, sample index, number of earlier segments, length of the reward status, score kind (0: no reward, 1:
abstained, 2: a score), score."""
_TOKENS = struct.Struct("<qqqb")
"""lengths of prompt / completion / versions, loss mask kind (0: None, 1: a mask)."""
_STEP = struct.Struct("<qq")


class EpisodeDigest:
    """A running digest of finished rollouts, step by step; ``state`` continues a digest (a resumed run's)."""

    def __init__(self, state: str = EMPTY_DIGEST, *, num_rollouts: int = 0) -> None:
        if len(state) != 64:
            raise ValueError(f"EpisodeDigest: a state is 64 hex digits, got {state!r}")
        self._state = bytes.fromhex(state)
        self.num_rollouts = num_rollouts
        """Rollouts digested so far (including those before ``state``)."""

    @property
    def hexdigest(self) -> str:
        return self._state.hex()

    def add_step(self, step: int, rollouts: Iterable[Rollout]) -> str:
        """Fold one step's rollouts, in canonical order, into the digest; returns the new `hexdigest`."""
        hasher = hashlib.blake2b(digest_size=32)
        num = 0
        example: Example | None = None
        task_hash = b""
        for rollout in rollouts:
            if rollout.example is not example:  # a group's rollouts share their example: hash its task once
                example = rollout.example
                task_hash = example.task_hash.encode()
            hasher.update(rollout_bytes(rollout, task_hash=task_hash))
            num += 1
        chained = hashlib.blake2b(self._state, digest_size=32)
        chained.update(_STEP.pack(step, num))
        chained.update(hasher.digest())
        self._state = chained.digest()
        self.num_rollouts += num
        return self.hexdigest


def rollout_bytes(rollout: Rollout, *, task_hash: bytes) -> bytes:
    """The canonical bytes of one rollout (``task_hash``: its example's, encoded), its earlier segments (an agent
    episode that rewrote its history) included. Headers give the length of every variable part, so two different
    rollouts never make the same bytes."""
    reward = rollout.reward
    score_kind = 0 if reward is None else 1 if reward.score is None else 2
    status = b"" if reward is None else reward.status.value.encode()
    score = reward.score if reward is not None and reward.score is not None else 0.0
    header = _HEADER.pack(task_hash, rollout.sample_index, len(rollout.segments), len(status), score_kind, score)
    parts: list[bytes | array[int]] = [header, status]
    for sequence in (*rollout.segments, rollout):
        mask = sequence.loss_mask
        lengths = (len(sequence.prompt_ids), len(sequence.completion_ids), len(sequence.versions))
        parts.append(_TOKENS.pack(*lengths, 0 if mask is None else 1))
        parts += (array("q", sequence.prompt_ids), array("q", sequence.completion_ids), array("q", sequence.versions))
        if mask is not None:
            parts.append(bytes(mask))
    return b"".join(parts)
