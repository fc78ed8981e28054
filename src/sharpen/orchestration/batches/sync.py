"""Sync mode's batch source: each batch is generated when the loop asks for it, and the trainer's weights are
loaded into the engine right after each step.

Colocated (``runtime.colocate``): once a batch is complete the engine sleeps, so the trainer has the devices to
itself, and it wakes right before the weights of the step are loaded into it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from sharpen.orchestration.batches.base import ProducedBatch, with_carried
from sharpen.rollout.engines import pop_engine_metrics, sleepable
from sharpen.types import PolicyVersion, Rollout

if TYPE_CHECKING:
    from sharpen.monitoring import PhaseTimer
    from sharpen.orchestration.batches.producer import BatchMaker
    from sharpen.orchestration.handles import TrainerHandle
    from sharpen.orchestration.weight_sync import WeightSync
    from sharpen.rollout.engines import InferenceEngine


class SyncBatches:
    """Generate on demand, load weights after every step."""

    def __init__(
        self,
        collector: BatchMaker,
        *,
        engine: InferenceEngine,
        weight_sync: WeightSync,
        timer: PhaseTimer,
        colocate: bool = False,
        pending: Sequence[ProducedBatch] = (),
    ) -> None:
        self.collector = collector
        self.engine = engine
        self.weight_sync = weight_sync
        self.timer = timer
        self.kept = {batch.step: batch for batch in pending}
        self.sleeper = sleepable(engine) if colocate else None
        self.is_asleep = False
        self.last: ProducedBatch | None = None

    def scored_batch(self, step: int) -> ProducedBatch:
        if step in self.kept:  # a checkpoint of an async run kept it
            batch = self.kept.pop(step)
        else:
            batch = self.collector.collect(self.engine, step=step, timer=self.timer)
        self.last = batch
        batch.metrics.update(pop_engine_metrics(self.engine))  # a router's retries, restarts, load per replica
        if self.sleeper is not None:
            with self.timer.phase("sleep"):
                batch.metrics.update(self.sleeper.sleep())
            self.is_asleep = True
        return batch

    def publish(self, trainer: TrainerHandle, *, version: PolicyVersion) -> dict[str, float]:
        if self.engine.policy_version == version and not self.is_asleep:
            return {}
        metrics: dict[str, float] = {}
        if self.sleeper is not None and self.is_asleep:
            with self.timer.phase("wake"):
                metrics.update(self.sleeper.wake_up())
            self.is_asleep = False
        return {**metrics, **self.weight_sync(trainer, self.engine, version=version)}

    @contextlib.contextmanager
    def exclusive(self, version: PolicyVersion) -> Iterator[InferenceEngine]:
        yield self.engine

    def pending(self, next_step: int) -> list[ProducedBatch]:
        return with_carried([self.kept[step] for step in sorted(self.kept) if step >= next_step], self.last)

    def step_metrics(
        self, step: int, trained: list[Rollout], *, train_started: float, train_ended: float
    ) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
