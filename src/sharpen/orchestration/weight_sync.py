"""`WeightSync`: moves the trainer's weights into the engine and proves they arrived (the probe check).

Owns the check's state (the previous sync's probe logprobs, per replica; the measured tolerance's baseline) and
the ``sync/*`` metrics. A Mixture-of-Experts policy's probe carries the trainer's routes, which an engine that can
replays (`probe_engine`): both sides then run the same experts, so the check sees the weights, not a route that
one side's rounding flipped (``sync/probe_replayed``). How the tensors
travel (in process, through Ray's object store, by broadcast) is the engine's `load_weights`, which the runtime
chose; where a sync happens in the step is the batch source's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from sharpen.rollout.engines import probe_engine, replicas_of
from sharpen.rollout.weight_sync import ProbeCheck, ProbeTolerance, verify_probe

if TYPE_CHECKING:
    import torch

    from sharpen.orchestration.handles import TrainerHandle
    from sharpen.rollout.engines import InferenceEngine
    from sharpen.types import ProbeScores


class WeightSync:
    """Moves the trainer's weights into the engine and proves they arrived (probe check).

    Synchronous mode calls it after every step. Asynchronous mode splits it in two, because the trainer and the
    engine hold a version at different times: the trainer's probe `reference` is taken when a version is
    published, and `load` checks the engine against it when the producer loads that version."""

    def __init__(self, *, probe_ids: list[int], tolerance: float | ProbeTolerance, verify: bool) -> None:
        """``tolerance``: a fixed bound (nats per token), or a `ProbeTolerance` (measured at the first sync)."""
        self.probe_ids = probe_ids
        self.tolerance = tolerance if isinstance(tolerance, ProbeTolerance) else ProbeTolerance(fixed=tolerance)
        self.verify = verify
        self.previous_engine: dict[int, list[float]] = {}  # by replica
        self.previous_trainer: list[float] | None = None

    def __call__(self, trainer: TrainerHandle, engine: InferenceEngine, *, version: int) -> dict[str, float]:
        return self.load(trainer.named_weights(), engine, version=version, reference=lambda: self.reference(trainer))

    def reference(self, trainer: TrainerHandle) -> ProbeScores | None:
        """The trainer's probe logprobs now, with its routes when it records them (None when verification is
        off)."""
        return trainer.probe(self.probe_ids) if self.verify else None

    def load(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        engine: InferenceEngine,
        *,
        version: int,
        reference: Callable[[], ProbeScores | None],
    ) -> dict[str, float]:
        """Load ``weights`` (version ``version``) into the engine and, when verifying, compare the probe logprobs of
        the engine (of each replica, behind a router; replaying the trainer's routes where it can) with
        ``reference()``, the trainer's at that version."""
        started = time.perf_counter()
        metrics = engine.load_weights(weights, version=version)
        metrics["sync/seconds"] = time.perf_counter() - started
        trainer = reference()
        if trainer is not None:
            checks, replayed = [], []
            for index, replica in enumerate(replicas_of(engine)):
                engine_logprobs, did_replay = probe_engine(replica, self.probe_ids, trainer.routes)
                checks.append(self.compare(engine_logprobs, trainer.logprobs, version=version, replica=index))
                replayed.append(did_replay)
            if trainer.routes is not None:
                metrics["sync/probe_replayed"] = float(all(replayed))
            self.previous_trainer = trainer.logprobs
            worst = max(checks, key=lambda check: check.mismatch_mean)
            metrics.update(worst.metrics())
            metrics["sync/probe_tolerance"] = self.tolerance.limit()  # the bound this sync met
            self.tolerance.record(worst.mismatch_mean)
            if self.tolerance.baseline is not None:
                metrics["sync/probe_baseline"] = self.tolerance.baseline
        return metrics

    def compare(
        self, engine_logprobs: list[float], trainer_logprobs: list[float], *, version: int, replica: int = 0
    ) -> ProbeCheck:
        """Check one engine (``replica``: which one behind a router) against the trainer; the caller then records
        ``trainer_logprobs`` as the previous sync's."""
        check = verify_probe(
            engine=engine_logprobs,
            trainer=trainer_logprobs,
            previous_engine=self.previous_engine.get(replica),
            previous_trainer=self.previous_trainer,
            tolerance=self.tolerance.limit(),
            version=version,
        )
        self.previous_engine[replica] = engine_logprobs
        return check
