"""Async mode's batch source: a producer thread that runs ahead of the trainer within a staleness bound.

In one paragraph. Batch ``g`` (the one trained at step ``g``) is admitted to generation only once the
trainer has published version ``g - max_staleness``; the trainer consumes batches strictly in order, so it holds
version ``g`` when it trains on batch ``g`` and no trained token is more than ``max_staleness`` versions old. That
is admission control: nothing generated is ever dropped, and a batch is complete only when every one of its groups
is, so slow (hard) prompts delay their batch instead of being left out — the batch composition is exactly the
sync mode's. Weights travel through a `WeightStore`: after each step the trainer publishes a snapshot (and the
probe logprobs that prove a load), and the producer loads the version it needs before it calls the engine. With
``weight_updates = "between_batches"`` that is exactly version ``g - max_staleness`` for the whole batch, so a
run is reproducible run to run (and ``max_staleness = 0`` is the sync run); with ``in_flight`` the producer
loads the newest published version between chunks of ``update_chunk_tokens`` tokens and every token records the
version that made it; ``abort`` regenerates the unfinished completions from their start instead.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from sharpen.monitoring import PhaseTimer
from sharpen.orchestration.batches.base import ProducedBatch, with_carried
from sharpen.orchestration.batches.weights import (
    ProducerStopped,
    PublishedWeights,
    WeightStore,
    versioned_engine,
)
from sharpen.rollout.engines import pop_engine_metrics
from sharpen.types import PolicyVersion, Rollout

if TYPE_CHECKING:
    from sharpen.config.schema import RolloutConfig
    from sharpen.monitoring import Timeline
    from sharpen.orchestration.handles import TrainerHandle
    from sharpen.orchestration.weight_sync import WeightSync
    from sharpen.rollout.engines import InferenceEngine

logger = logging.getLogger(__name__)


class BatchMaker(Protocol):
    """What makes one step's batch with a given engine (`GroupCollector`)."""

    def collect(self, engine: InferenceEngine, *, step: int, timer: PhaseTimer) -> ProducedBatch: ...


class AsyncBatches:
    """A producer thread that generates batches ahead of the trainer (the module docstring says how).

    ``maker`` makes each batch with the producer's view of ``engine`` (`VersionedEngine`); ``weight_sync`` takes the
    trainer's probe when a version is published and checks the engine against it when the producer loads that
    version; ``rollout`` gives the staleness bound and the weight-update mode; ``decode`` joins the text of a
    completion generated in chunks."""

    def __init__(
        self,
        maker: BatchMaker,
        *,
        engine: InferenceEngine,
        weight_sync: WeightSync,
        rollout: RolloutConfig,
        start_step: int,
        num_steps: int,
        timeline: Timeline | None = None,
        decode: Callable[[list[int]], str] | None = None,
        pending: Sequence[ProducedBatch] = (),
        join_timeout_s: float = 120.0,
    ) -> None:
        self.engine = engine
        self.store = WeightStore()
        self.view = versioned_engine(
            engine,
            self.store,
            load=self._load,
            updates=rollout.weight_updates,
            chunk_tokens=rollout.update_chunk_tokens,
            decode=decode,
        )
        self.start_step = start_step
        self.num_steps = num_steps
        self.max_staleness = rollout.max_staleness
        # partial rollouts: a carried token is up to max_steps_spanned - 1 versions older than its batch's generation
        self._carried_staleness = rollout.partial.max_steps_spanned - 1 if rollout.partial.enabled else 0
        self.join_timeout_s = join_timeout_s
        self._maker = maker
        self._weight_sync = weight_sync
        self._timeline = timeline
        # a batch before start_step only brings partial rollouts' carried groups (`with_carried`)
        self._ready: dict[int, ProducedBatch] = {batch.step: batch for batch in pending if batch.step >= start_step}
        self._next = start_step + len(self._ready)
        self._last: ProducedBatch | None = None
        self._cond = threading.Condition()
        self._engine_lock = threading.Lock()  # the producer holds it for a whole batch; `exclusive` in between
        self._error: BaseException | None = None
        self._busy: list[tuple[float, float]] = []  # the producer's (start, end) of each batch, perf_counter
        self._busy_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="sharpen-producer", daemon=True)
        self._started = False

    def _load(self, published: PublishedWeights, engine: InferenceEngine) -> dict[str, float]:
        return self._weight_sync.load(
            published.weights, engine, version=published.version, reference=lambda: published.probe
        )

    # the trainer's side

    def publish(self, trainer: TrainerHandle, *, version: PolicyVersion) -> dict[str, float]:
        started = time.perf_counter()
        weights = trainer.snapshot_weights()
        snapshot_seconds = time.perf_counter() - started
        probe = self._weight_sync.reference(trainer)
        self.store.publish(PublishedWeights(version=version, weights=weights, probe=probe))
        if not self._started:
            self._started = True
            self._thread.start()
        return {"sync/snapshot_seconds": snapshot_seconds, "async/num_held_versions": float(len(self.store))}

    def scored_batch(self, step: int) -> ProducedBatch:
        started = time.perf_counter()
        with self._cond:
            while step not in self._ready and self._error is None:
                self._cond.wait()
            if step not in self._ready:
                assert self._error is not None
                raise self._error
            batch = self._ready.pop(step)
            num_ready = len(self._ready)
        self._last = batch
        batch.metrics["async/wait_batch_seconds"] = time.perf_counter() - started
        batch.metrics["async/num_ready_batches"] = float(num_ready)
        return batch

    @contextlib.contextmanager
    def exclusive(self, version: PolicyVersion) -> Iterator[InferenceEngine]:
        with self._engine_lock:
            self.view.ensure(version)  # its metrics go out with the next batch, like the producer's own loads
            yield self.engine

    def pending(self, next_step: int) -> list[ProducedBatch]:
        """Batches ``next_step, ...`` generated by versions below ``next_step`` (pickled copies, before the loop
        mutates them), waiting for the producer to finish them."""
        last = min(next_step + self.max_staleness, self.num_steps)
        needed = [g for g in range(next_step, last) if self._target(g) < next_step]
        with self._cond:
            while not all(g in self._ready for g in needed) and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            kept = [pickle.loads(pickle.dumps(self._ready[g])) for g in needed]
        return with_carried(kept, self._last)

    def step_metrics(
        self, step: int, trained: list[Rollout], *, train_started: float, train_ended: float
    ) -> dict[str, float]:
        bound = self.max_staleness + self._carried_staleness
        metrics = staleness_metrics(trained, step=step, max_staleness=bound)
        train_seconds = train_ended - train_started
        overlap = self.overlap(train_started, train_ended)
        metrics["async/overlap_ratio"] = overlap / train_seconds if train_seconds > 0 else 0.0
        return metrics

    def overlap(self, start: float, end: float) -> float:
        """Seconds of [start, end] (perf_counter) during which the producer was generating."""
        with self._cond:
            spans = [*self._busy, *([(self._busy_since, end)] if self._busy_since is not None else [])]
            self._busy = [span for span in self._busy if span[1] > start]
        return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)

    def close(self) -> None:
        self.store.stop()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=self.join_timeout_s)
            if self._thread.is_alive():
                logger.warning("the rollout producer did not stop within %.0f s; leaving it", self.join_timeout_s)

    # the producer's side

    def _target(self, step: int) -> PolicyVersion:
        return max(step - self.max_staleness, self.start_step)

    def _run(self) -> None:
        timer = PhaseTimer(timeline=self._timeline)
        try:
            for step in range(self._next, self.num_steps):
                target = self._target(step)
                wait_seconds = self.store.wait_for(target)
                with self._engine_lock:
                    started = time.perf_counter()
                    with self._cond:
                        self._busy_since = started
                    self.view.target = target
                    self.view.ensure(self.view.wanted())
                    batch = self._maker.collect(self.view, step=step, timer=timer)
                    batch.metrics = {
                        **batch.metrics,
                        **timer.pop_metrics(),
                        **self.view.pop_metrics(),
                        **pop_engine_metrics(self.engine),  # a router's retries, restarts, load per replica
                        "async/wait_weights_seconds": wait_seconds,
                        "async/generation_version": float(target),
                    }
                with self._cond:
                    self._busy.append((started, time.perf_counter()))
                    self._busy_since = None
                    self._ready[step] = batch
                    self._cond.notify_all()
                self.store.release_below(min(self._target(step + 1), self.engine.policy_version))
        except ProducerStopped:
            return
        except BaseException as error:  # handed to the trainer's thread, which raises it from `take`
            logger.debug("rollout producer failed", exc_info=True)
            with self._cond:
                self._error = error
                self._busy_since = None
                self._cond.notify_all()


def staleness_metrics(rollouts: Sequence[Rollout], *, step: int, max_staleness: int) -> dict[str, float]:
    """How old the trained tokens are: ``step - version`` of every generated token, as a mean, a max and a
    histogram (the fraction of tokens at each staleness 0..max_staleness)."""
    counts: collections.Counter[int] = collections.Counter()
    for rollout in rollouts:
        mask = rollout.loss_mask
        for position, version in enumerate(rollout.versions):
            if mask is None or mask[position]:
                counts[step - version] += 1
    total = sum(counts.values())
    metrics = {
        "async/staleness_mean": sum(s * n for s, n in counts.items()) / total if total else 0.0,
        "async/staleness_max": float(max(counts, default=0)),
    }
    for staleness in range(max_staleness + 1):
        metrics[f"async/staleness_{staleness}"] = counts[staleness] / total if total else 0.0
    return metrics
