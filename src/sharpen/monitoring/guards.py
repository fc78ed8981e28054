"""Stability alarms: the rules of ``monitoring.guards`` over a run's logged signals, fed one step's metrics at a time.

Owns three alarms. ``entropy_collapse``: the policy's mean token entropy (``train/entropy``) below
``entropy_floor``, or below its early median divided by ``entropy_drop_factor``; ``entropy_blowup``: the entropy
above its early median times ``entropy_rise_factor``; ``mismatch``: the engine/trainer
mismatch (``offpolicy/kl_k3`` every step, the parity probe's ``parity/k3`` on its steps) above ``mismatch_ceiling``.
Each fires once, at the step where its signal has been out of bounds for ``patience`` consecutive measurements, and
is armed again when the signal comes back. Pure: it writes and logs nothing (`RunHealth` does, and applies the
policies) and changes nothing in training. `RunStopped` is the one-line error a ``stop`` policy ends a run with;
`Rollback` is what a ``rollback`` policy asks of the session (`session.roll_back`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sharpen.config.guards import GuardsConfig

ENTROPY_SIGNAL = "train/entropy"
MISMATCH_SIGNALS = ("offpolicy/kl_k3", "parity/k3")
"""The mismatch's signals, both the k3 estimate of KL(engine || trainer) in nats per token."""


class RunStopped(RuntimeError):
    """A stability guard whose policy is ``stop`` ended the run (after a checkpoint of its last step)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Rollback:
    """A ``rollback`` policy's request, made at a bad step or an alarm: restore the newest checkpoint and go on with
    the data after this step's batch."""

    step: int
    """The step whose bad update or alarm asked for it."""
    signal: str
    """The metric that was out of bounds (``train/grad_norm``, ``train/num_nonfinite_updates``, an alarm's signal)."""
    value: float
    reason: str
    """One line: the step and what happened (``step 6: a gradient-norm spike (train/grad_norm = 812)``)."""
    number: int
    """This rollback's number in the run, from 1 (monitoring.guards.max_rollbacks bounds it)."""
    sampler_state: dict[str, Any] = field(default_factory=dict[str, Any])
    """The data position after the step's batch, where the data continues after the rollback (the loop fills it)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Alarm:
    step: int
    name: str
    """``entropy_collapse``, ``entropy_blowup`` or ``mismatch``."""
    signal: str
    """The metric that was out of bounds."""
    value: float
    threshold: float
    message: str
    """One line for a person: the step, the alarm, the signal, its value and bound, and the key to change."""

    def to_record(self) -> dict[str, object]:
        return {
            "step": self.step,
            "alarm": self.name,
            "signal": self.signal,
            "value": self.value,
            "threshold": self.threshold,
            "message": self.message,
        }


@dataclass(kw_only=True, slots=True)
class _Streak:
    """Consecutive out-of-bounds measurements of one alarm."""

    length: int = 0

    def observe(self, out_of_bounds: bool, patience: int) -> bool:
        """Whether this measurement fires the alarm: the ``patience``-th in a row out of bounds."""
        self.length = self.length + 1 if out_of_bounds else 0
        return self.length == patience


@dataclass(kw_only=True)
class StabilityAlarms:
    """The alarms of ``config``; `observe` each step's metrics in order."""

    config: GuardsConfig
    early_entropy: list[float] = field(default_factory=list[float])
    """The first ``early_steps`` finite entropies (their median is entropy_drop_factor's and entropy_rise_factor's
    reference)."""
    entropy_streak: _Streak = field(default_factory=_Streak)
    blowup_streak: _Streak = field(default_factory=_Streak)
    mismatch_streak: _Streak = field(default_factory=_Streak)

    @property
    def names(self) -> list[str]:
        """The alarms this config turns on."""
        config = self.config
        names = []
        if config.entropy_floor is not None or config.entropy_drop_factor is not None:
            names.append("entropy_collapse")
        if config.entropy_rise_factor is not None:
            names.append("entropy_blowup")
        if config.mismatch_ceiling is not None:
            names.append("mismatch")
        return names

    def observe(self, step: int, metrics: Mapping[str, float]) -> list[Alarm]:
        """The alarms that fire at ``step``, given its metrics (a signal missing or not finite is not a
        measurement: its streak neither grows nor breaks)."""
        fired = [*self._entropy(step, metrics), self._mismatch(step, metrics)]
        return [alarm for alarm in fired if alarm is not None]

    def entropy_bound(self) -> float | None:
        """The entropy below which a step counts as collapsed now: the higher of the floor and the early median
        over the drop factor (known once ``early_steps`` entropies were seen); None: no bound yet."""
        config = self.config
        bounds = []
        if config.entropy_floor is not None:
            bounds.append(config.entropy_floor)
        if config.entropy_drop_factor is not None and len(self.early_entropy) == config.early_steps:
            bounds.append(statistics.median(self.early_entropy) / config.entropy_drop_factor)
        return max(bounds) if bounds else None

    def entropy_ceiling(self) -> float | None:
        """The entropy above which a step counts as blown up now: the early median times the rise factor (None:
        off, or fewer than ``early_steps`` entropies seen)."""
        factor = self.config.entropy_rise_factor
        if factor is None or len(self.early_entropy) < self.config.early_steps:
            return None
        return statistics.median(self.early_entropy) * factor

    def _entropy(self, step: int, metrics: Mapping[str, float]) -> tuple[Alarm | None, Alarm | None]:
        """The entropy alarms that fire at ``step``: collapse, blow-up."""
        entropy = metrics.get(ENTROPY_SIGNAL)
        names = self.names
        if not {"entropy_collapse", "entropy_blowup"} & set(names) or entropy is None or not math.isfinite(entropy):
            return None, None
        bound, ceiling = self.entropy_bound(), self.entropy_ceiling()
        if len(self.early_entropy) < self.config.early_steps:
            self.early_entropy.append(entropy)  # after the bounds: a step is never judged against itself
        collapse = self._collapse(step, entropy, bound) if "entropy_collapse" in names else None
        blowup = self._blowup(step, entropy, ceiling) if "entropy_blowup" in names else None
        return collapse, blowup

    def _collapse(self, step: int, entropy: float, bound: float | None) -> Alarm | None:
        if not self.entropy_streak.observe(bound is not None and entropy < bound, self.config.patience):
            return None
        assert bound is not None
        return Alarm(
            step=step,
            name="entropy_collapse",
            signal=ENTROPY_SIGNAL,
            value=entropy,
            threshold=bound,
            message=(
                f"step {step}: entropy_collapse alarm: {ENTROPY_SIGNAL} = {entropy:.4g} below {bound:.4g} for "
                f"{self.config.patience} steps (trainer.algorithm.entropy_coef or entropy.target, or a lower "
                "learning rate)"
            ),
        )

    def _blowup(self, step: int, entropy: float, ceiling: float | None) -> Alarm | None:
        if not self.blowup_streak.observe(ceiling is not None and entropy > ceiling, self.config.patience):
            return None
        assert ceiling is not None
        return Alarm(
            step=step,
            name="entropy_blowup",
            signal=ENTROPY_SIGNAL,
            value=entropy,
            threshold=ceiling,
            message=(
                f"step {step}: entropy_blowup alarm: {ENTROPY_SIGNAL} = {entropy:.4g} above {ceiling:.4g} for "
                f"{self.config.patience} steps (the policy is turning to noise: a lower trainer.learning_rate, "
                'trainer.max_grad_norm, or monitoring.guards.on_alarm = "rollback")'
            ),
        )

    def _mismatch(self, step: int, metrics: Mapping[str, float]) -> Alarm | None:
        ceiling = self.config.mismatch_ceiling
        measured = {
            name: metrics[name] for name in MISMATCH_SIGNALS if name in metrics and math.isfinite(metrics[name])
        }
        if ceiling is None or not measured:
            return None
        over = [name for name, value in measured.items() if value > ceiling]
        if not self.mismatch_streak.observe(bool(over), self.config.patience):
            return None
        signal = over[0]
        return Alarm(
            step=step,
            name="mismatch",
            signal=signal,
            value=measured[signal],
            threshold=ceiling,
            message=(
                f"step {step}: mismatch alarm: {signal} = {measured[signal]:.4g} above {ceiling:.4g} for "
                f"{self.config.patience} measurements (engine and trainer disagree: trainer.precision, "
                "rollout.engine, trainer.algorithm.off_policy_correction)"
            ),
        )
