"""Proof that a weight sync took effect: engine and trainer logprobs on a fixed probe sequence.

After a sync the two must agree within a tolerance (different kernels, same weights). And if the trainer's probe
logprobs moved since the last sync while the engine's did not move at all, the sync silently did nothing: that
is an error even when the step was small enough to stay inside the tolerance.

The tolerance (`ProbeTolerance`) depends on the arithmetic. Engine and trainer in float32 agree to ~1e-5 nats per
token, so 1e-3 is a fixed bound. With bfloat16 on either side the mismatch is the rounding of 8-bit mantissas and
is far larger (SmolLM2, engine in bfloat16 against float32 master weights: 0.024-0.085 on three short probes), and
it depends on the model and the probe, so it is measured: the first sync's mismatch is the baseline, every later
sync may differ by at most max(floor, factor x baseline), and a sync that passes raises the baseline to its own
mismatch when that is larger (bf16's noise grows as training sharpens the logits: seen 26x over 30 steps of a
fast-learning tiny model, at most 1.9x from one sync to the next). That bound catches weights that are wrong by more
than bf16's own noise (a partial or corrupted load, stale weights many steps old, another model), not a single
missed step: one AdamW step at the demo's learning rate moves the probe by ~0.005 nats/token, well inside the
noise. A missed sync is caught by the other check, which is exact in any precision: an engine that did not load
new weights returns bit-identical probe logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

_MIN_VISIBLE_DELTA = 1e-6
"""A trainer probe change below this may be invisible in the engine's float32 arithmetic: no no-op verdict then."""


FLOAT32_TOLERANCE = 1e-3
"""Fixed tolerance when both sides compute in float32: 100x what SmolLM2 on vLLM's CPU engine and the trainer
disagree by."""

BF16_FLOOR = 0.01
"""Least measured tolerance: bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ~ 2e-3), so a logprob of a few
nats moves by ~0.01 from rounding alone, and a small first mismatch says little about later ones. Seen: the tiny
random Llama (baseline 4.5e-4) reached 2.1e-3 after one AdamW step at lr 5e-2, 4.5x its baseline, where SmolLM2's
mismatch stayed within 2.4x."""

BF16_FACTOR = 4.0
"""Measured tolerance: the allowed mismatch is this multiple of the baseline. A correctly synced engine's mismatch
wandered up to 2.4x its first value over six AdamW steps of SmolLM2 (lr 1e-5, hf engine in bfloat16, trainer in
float32, three probes: 0.024 -> 0.058 on the worst), 1.6x over four demo steps on vLLM (0.041 -> 0.065), and by at
most 1.9x from one sync to the next over 30 steps of the tiny model at lr 5e-2: 4x leaves a margin of 1.7x."""

BF16_FIRST_LIMIT = 0.25
"""Largest mismatch the first sync may show with bfloat16 on a side (the measured tolerance has no baseline yet):
3x the largest bf16 mismatch measured on SmolLM2 (0.085 nats/token on a 7-token probe, 0.034 on the default
probe). Wrong weights (another model, random or uninitialised tensors) differ by nats, not tenths."""


class WeightSyncError(RuntimeError):
    """The engine does not hold the weights the trainer sent."""


@dataclass(kw_only=True, slots=True)
class ProbeTolerance:
    """The probe check's bound on the mean mismatch: ``fixed`` when set, else measured (see the module docstring):
    `first_limit` until `record` has seen the first sync's mismatch (the baseline), then
    max(floor, factor x baseline), the baseline being the largest mismatch of the syncs that passed."""

    fixed: float | None = None
    floor: float = BF16_FLOOR
    factor: float = BF16_FACTOR
    first_limit: float = BF16_FIRST_LIMIT
    baseline: float | None = None
    """The largest mismatch of the checked syncs, the first one's at first (None until then, and always for a fixed
    tolerance)."""

    @property
    def is_measured(self) -> bool:
        return self.fixed is None

    def limit(self) -> float:
        """The bound the next check must meet."""
        if self.fixed is not None:
            return self.fixed
        if self.baseline is None:
            return self.first_limit
        return max(self.floor, self.factor * self.baseline)

    def record(self, mismatch: float) -> None:
        """Take the mismatch of a sync that passed: the first is a measured tolerance's baseline, a larger one later
        raises it."""
        if self.fixed is None:
            self.baseline = mismatch if self.baseline is None else max(self.baseline, mismatch)


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
