"""Proof that a weight sync took effect: engine and trainer logprobs on a fixed probe sequence.

After a sync the two must agree within a tolerance (different kernels, same weights). And if the trainer's probe
logprobs moved since the last sync while the engine's did not move at all, the sync silently did nothing: that
is an error even when the step was small enough to stay inside the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

_MIN_VISIBLE_DELTA = 1e-6
"""A trainer probe change below this may be invisible in the engine's float32 arithmetic: no no-op verdict then."""


class WeightSyncError(RuntimeError):
    """The engine does not hold the weights the trainer sent."""


@dataclass(kw_only=True, slots=True)
class ProbeCheck:
    mismatch_mean: float
    """Mean |engine - trainer| logprob over probe tokens after the sync."""
    mismatch_max: float
    trainer_delta: float
    """Mean |trainer now - trainer at the previous sync|: how much the weights moved the probe."""
    engine_delta: float
    """The same for the engine."""

    def metrics(self) -> dict[str, float]:
        return {
            "sync/probe_mismatch_mean": self.mismatch_mean,
            "sync/probe_mismatch_max": self.mismatch_max,
            "sync/probe_trainer_delta": self.trainer_delta,
            "sync/probe_engine_delta": self.engine_delta,
        }


def _mean_abs_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        raise WeightSyncError(f"probe logprobs have different lengths: {len(a)} vs {len(b)}")
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def verify_probe(
    *,
    engine: list[float],
    trainer: list[float],
    previous_engine: list[float] | None,
    previous_trainer: list[float] | None,
    tolerance: float,
    version: int,
) -> ProbeCheck:
    check = ProbeCheck(
        mismatch_mean=_mean_abs_diff(engine, trainer),
        mismatch_max=max(abs(x - y) for x, y in zip(engine, trainer, strict=True)),
        trainer_delta=_mean_abs_diff(trainer, previous_trainer) if previous_trainer else 0.0,
        engine_delta=_mean_abs_diff(engine, previous_engine) if previous_engine else 0.0,
    )
    if previous_engine is not None and check.trainer_delta > _MIN_VISIBLE_DELTA and engine == previous_engine:
        raise WeightSyncError(
            f"weight sync to version {version} had no effect: the trainer's probe logprobs moved by "
            f"{check.trainer_delta:.3g} nats/token but the engine's are unchanged"
        )
    if check.mismatch_mean > tolerance:
        raise WeightSyncError(
            f"after weight sync to version {version} the engine's probe logprobs differ from the trainer's by "
            f"{check.mismatch_mean:.3g} nats/token on average (tolerance {tolerance})"
        )
    return check
