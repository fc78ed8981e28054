"""The stability guards' configuration (``[monitoring.guards]``): the alarms on a run's logged signals and what an
alarm or a bad step does. Mounted in `MonitoringConfig` (schema.py); `monitoring/health.py` applies it and
docs/algorithms.md (Stability guards) gives the rules. The adaptive entropy coefficient is part of the objective
(``trainer.algorithm.entropy``, algorithm.py), not a guard: it changes the loss, a guard only watches and acts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sharpen.config.section import Section

__all__ = ["AlarmPolicy", "BadStepPolicy", "GuardsConfig"]

AlarmPolicy = Literal["warn", "stop", "rollback"]
BadStepPolicy = Literal["warn", "skip", "stop", "rollback"]


class GuardsConfig(Section):
    """Alarms on the logged signals, each off until its threshold is set, and the policies for an alarm and a bad
    step. An alarm fires once, at the step where its signal has been out of bounds for ``patience`` consecutive
    measurements (a console line naming the step and the signal, ``health/alarm_<name>`` = 1 at that step, a line
    in ``run_dir/alarms.jsonl``, listed by ``sharpen inspect``), and again only after the signal came back."""

    entropy_floor: float | None = Field(default=None, gt=0.0)
    """Alarm ``entropy_collapse`` when the policy's mean token entropy (``train/entropy``, nats) stays below this
    (None: no floor)."""
    entropy_drop_factor: float | None = Field(default=None, gt=1.0)
    """Alarm ``entropy_collapse`` also when ``train/entropy`` stays below its early median (the median of its first
    ``early_steps`` steps) divided by this factor (None: off)."""
    entropy_rise_factor: float | None = Field(default=None, gt=1.0)
    """Alarm ``entropy_blowup`` when ``train/entropy`` stays above its early median times this (None: off): the
    policy turning to noise, as a too-large learning rate does (a tiny Llama at learning rate 2e-3 went from 1.0 to
    10.2 nats, the uniform distribution over its 49k words, in 7 steps)."""
    early_steps: int = Field(default=5, ge=1)
    """Steps whose entropy make the early median of entropy_drop_factor and entropy_rise_factor; the drop or rise is
    judged from the next step on."""
    mismatch_ceiling: float | None = Field(default=None, gt=0.0)
    """Alarm ``mismatch`` when the engine/trainer mismatch stays above this: ``offpolicy/kl_k3`` (every step) or
    the parity probe's ``parity/k3`` (its steps), both the k3 estimate of KL(engine || trainer) in nats per token
    (None: off)."""
    patience: int = Field(default=3, ge=1)
    """Consecutive measurements out of bounds before an alarm fires."""
    on_alarm: AlarmPolicy = "warn"
    """What an alarm does: ``warn`` (the console line and the records); ``stop``: also end the run after its step,
    with a checkpoint of it and one line naming the alarm (``--resume`` continues); ``rollback``: go back to the
    newest checkpoint and on with the data after the alarm's step, as ``on_bad_step = "rollback"``."""
    on_bad_step: BadStepPolicy = "warn"
    """What a bad step does (a non-finite gradient, whose optimizer step is always skipped, or a gradient-norm spike
    over monitoring.grad_norm_spike_factor x its recent median): ``warn`` applies a spike's update and flags it;
    ``skip`` leaves out every optimizer step whose gradient norm is over that bound (``train/num_skipped_updates``);
    ``stop`` skips it too, then ends the run after the step with a checkpoint and one line; ``rollback`` skips it
    too, then restores the newest complete checkpoint in the same run (trainer weights and optimizer, the engine's
    weights synced again) and goes on from its step with the data after the bad step's batch (the batches in
    between are left out, so the same data cannot spike again), at most ``max_rollbacks`` times; before the first
    checkpoint it acts as ``skip``. A rollback needs ``run.checkpoint_every`` > 0."""
    max_rollbacks: int = Field(default=3, ge=1)
    """Rollbacks (``on_bad_step`` or ``on_alarm`` = ``rollback``) a run may make in all; a bad step or alarm past
    them ends the run as ``stop`` does, with one line naming this key."""

    @property
    def rolls_back(self) -> bool:
        """Whether a bad step or an alarm can roll the run back to its newest checkpoint."""
        return "rollback" in (self.on_bad_step, self.on_alarm)
