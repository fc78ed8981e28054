"""The order in which examples are drawn for training: seeded, epoch-wise shuffling that resumes exactly.

Owns only the order. Each epoch is a fresh permutation derived from (seed, epoch), so the position in the stream
(epoch, position) is the whole state: a sampler restored from `state_dict()` yields the same batches the original
would have. Uses `random.Random`, not torch, so orchestration and tests need no tensors to draw examples.
"""

from __future__ import annotations

import random
from typing import Any

from sharpen.types import Example


class ExampleSampler:
    """Yields examples in batches, each epoch in a new seeded order; batches run across epoch boundaries."""

    def __init__(self, examples: list[Example], *, seed: int) -> None:
        if not examples:
            raise ValueError("ExampleSampler: no examples to sample from")
        self._examples = list(examples)
        self._seed = seed
        self._epoch = 0
        self._position = 0
        self._order = self._permutation(0)

    @property
    def epoch(self) -> int:
        """Number of complete passes over the examples so far."""
        return self._epoch

    def next_batch(self, num: int) -> list[Example]:
        """The next ``num`` examples; an epoch that runs out mid-batch continues with the next epoch's order."""
        if num < 0:
            raise ValueError(f"ExampleSampler.next_batch: num must be >= 0, got {num}")
        batch = []
        while len(batch) < num:
            if self._position == len(self._examples):
                self._epoch += 1
                self._position = 0
                self._order = self._permutation(self._epoch)
            take = min(num - len(batch), len(self._examples) - self._position)
            batch.extend(self._examples[i] for i in self._order[self._position : self._position + take])
            self._position += take
        return batch

    def state_dict(self) -> dict[str, int]:
        """Where the sampler is in its stream (plain ints, JSON-serialisable)."""
        return {"epoch": self._epoch, "position": self._position, "num_examples": len(self._examples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()`; the sampler must hold the same examples and seed as the one saved."""
        epoch, position = int(state["epoch"]), int(state["position"])
        num_examples = int(state.get("num_examples", len(self._examples)))
        if num_examples != len(self._examples):
            raise ValueError(
                f"ExampleSampler: the saved state is for {num_examples} examples, "
                f"this sampler has {len(self._examples)}"
            )
        if epoch < 0 or not 0 <= position <= len(self._examples):
            raise ValueError(f"ExampleSampler: invalid state epoch={epoch}, position={position}")
        self._epoch, self._position = epoch, position
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        # random.Random hashes a string seed with SHA-512: the same in every process (PYTHONHASHSEED plays no
        # part), and (seed, epoch) pairs never collide the way seed + epoch would.
        order = list(range(len(self._examples)))
        random.Random(f"sharpen-sampler/{self._seed}/{epoch}").shuffle(order)
        return order
