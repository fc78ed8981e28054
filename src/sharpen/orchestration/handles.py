"""What crosses a process boundary between orchestration and the trainer: named protocols, so the loop, the batch
sources and checkpointing type their trainer as `TrainerHandle` whether it is a `Trainer` in this process or a
proxy of Ray actors, instead of casting proxies to `Trainer` or probing them with ``getattr``.

Owns only the protocols; the in-process `sharpen.trainer.Trainer` and `sharpen.orchestration.ray.proxies`'s
`TrainerProxy` implement them (pyright checks both where they are handed to the loop). A trainer whose ranks run
in other processes is also a `TrainerProcesses`, which storage and checkpoints tell apart from one in this process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from sharpen.types import ProbeScores, Rollout, TrainBatch

if TYPE_CHECKING:
    import torch


class WeightSnapshot(Protocol):
    """The trainer's weights at one version, unchanged by later steps, iterable any number of times (async mode
    publishes one per version; every engine replica may read it)."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class TrainerHandle(Protocol):
    """The trainer as orchestration drives it."""

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step (or several: mini-batches, epochs) on ``batch``; returns ``train/*`` metrics."""
        ...

    def compute_logprobs(self, token_ids: list[int]) -> list[float]:
        """Logprobs of ``token_ids[1:]`` at temperature 1 (the weight-sync and parity probes)."""
        ...

    def probe(self, token_ids: list[int]) -> ProbeScores:
        """`compute_logprobs` for the weight-sync probe, with a Mixture-of-Experts policy's routes when it records
        them (for an engine to replay)."""
        ...

    def kl_penalties(self, rollouts: list[Rollout]) -> list[list[float]]:
        """Per-token KL penalties of each rollout against the reference policy (``kl.type = "reward"``)."""
        ...

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The current full weights (HF checkpoint names), to be read once, now."""
        ...

    def snapshot_weights(self) -> WeightSnapshot:
        """The current weights as a snapshot that later steps do not change."""
        ...

    def save_checkpoint(self, folder: Path) -> None: ...

    def load_checkpoint(self, folder: Path) -> None: ...

    def export(self, folder: Path) -> None:
        """Write the policy as a HF model folder that transformers and vLLM load."""
        ...


@runtime_checkable
class TrainerProcesses(Protocol):
    """A trainer whose ranks run in other processes: each call goes to every rank, and every rank's answer comes
    back in rank order (`LocalTrainerRanks`, the Ray `TrainerProxy`). Besides the trainer's methods, every rank
    serves the start-up marker check (``check_shared_dir``, `storage.answer_marker`) and the object store's file
    calls (`object_store.RANK_CALLS`)."""

    def call_all(self, method: str, *args: Any) -> list[Any]: ...
