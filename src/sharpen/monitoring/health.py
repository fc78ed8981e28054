"""Run health: what a step's metrics say about the run's numerics and stability, checked every step, and what the
stability guards (``monitoring.guards``) do about it.

Owns the checks and their policies. A step whose gradient was not finite was skipped by the trainer (its optimizer step
did not run); here its whole batch is dumped to ``run_dir/nonfinite/step_<N>.jsonl`` (the rollout records, replayable
and readable) and counted. A gradient norm far above its recent median is flagged as a spike (often the first sign of a
diverging run); with ``on_bad_step`` ``"skip"``, ``"stop"`` or ``"rollback"`` the loop hands the trainer the bound
(`skip_above`) so a spiking optimizer step is not applied. The alarms (`guards.StabilityAlarms`) fire once each: a
console line, ``health/alarm_<name>`` = 1 in the step's metrics, a record in ``run_dir/alarms.jsonl``. A ``stop``
policy sets `stop_reason`; the loop checkpoints the step and raises `RunStopped`. A ``rollback`` policy sets `rollback`
(or, with no checkpoint yet, says so in one line and lets the run go on; past ``max_rollbacks``, sets `stop_reason`);
the loop ends there and the session restores the newest checkpoint and records the rollback (`record_rollback`, in
``alarms.jsonl``, counted from there by the next loop's health). A resumed run first `replay`\\s the rows its metrics
file kept, so its spike median and alarm streaks are the uninterrupted run's. It never changes the loss (the adaptive
entropy coefficient is the trainer's).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sharpen.config.guards import GuardsConfig
from sharpen.monitoring.guards import Alarm, Rollback, StabilityAlarms
from sharpen.monitoring.recorder import rollout_record
from sharpen.monitoring.sinks import METRICS_FILE_NAME, read_jsonl, truncate_jsonl_after
from sharpen.types import Rollout

logger = logging.getLogger(__name__)

NONFINITE_DIR_NAME = "nonfinite"
ALARMS_FILE_NAME = "alarms.jsonl"
ROLLBACK_RECORD = "rollback"
"""The ``alarm`` field of a rollback's record in ``alarms.jsonl``."""


class RunHealth:
    def __init__(
        self,
        run_dir: Path,
        *,
        spike_factor: float,
        spike_window: int,
        min_history: int = 5,
        guards: GuardsConfig | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.spike_factor = spike_factor
        self.min_history = min_history
        self.history: deque[float] = deque(maxlen=spike_window)
        self.num_nonfinite_steps = 0
        self.guards = guards if guards is not None else GuardsConfig()
        self.alarms = StabilityAlarms(config=self.guards)
        self.stop_reason: str | None = None
        """Why a ``stop`` policy ends the run after the step just checked (None: it goes on)."""
        self.rollback: Rollback | None = None
        """What a ``rollback`` policy asks after the step just checked (None: nothing; never with `stop_reason`)."""
        self.num_rollbacks = 0
        """Rollbacks the run made before this loop (its ``alarms.jsonl`` records, read by `resume`)."""
        self.checkpoint_step: int | None = None
        """The step of the newest checkpoint a rollback would restore (None: none yet); `resume` and `checkpointed`
        set it."""

    def skip_above(self) -> float | None:
        """The gradient norm over which the next step's optimizer steps are left out (`TrainBatch`'s
        ``skip_grad_norm_above``): the spike bound, under ``on_bad_step`` skip, stop or rollback once the median has
        enough history; None: every finite update is applied."""
        if self.guards.on_bad_step == "warn" or len(self.history) < self.min_history:
            return None
        return self.spike_factor * statistics.median(self.history)

    def check(self, step: int, rollouts: list[Rollout], metrics: Mapping[str, float]) -> dict[str, float]:
        """``health/*`` metrics of one step from its other metrics; dumps the batch of a step with a non-finite
        update, logs and records the alarms that fire, and sets `stop_reason` under a ``stop`` policy (`rollback`
        under a ``rollback`` one)."""
        self.rollback = None
        nonfinite = metrics.get("train/num_nonfinite_updates", 0.0) > 0
        if nonfinite:
            path = self.dump(step, rollouts)
            logger.warning("step %d: non-finite gradient, optimizer step skipped; batch dumped to %s", step, path)
        median = statistics.median(self.history) if self.history else math.nan
        is_spike, alarms = self._observe(step, metrics)
        grad_norm = metrics.get("train/grad_norm", math.nan)
        if is_spike:
            skipped = " (its update skipped)" if metrics.get("train/num_skipped_updates", 0.0) > 0 else ""
            logger.warning(
                "step %d: gradient norm %.4g is over %.1fx its recent median %.4g%s",
                step,
                grad_norm,
                self.spike_factor,
                median,
                skipped,
            )
        if (nonfinite or is_spike) and self.guards.on_bad_step == "stop":
            what = "a non-finite gradient" if nonfinite else f"a gradient-norm spike ({grad_norm:.4g})"
            self.stop_reason = f'step {step}: {what}; monitoring.guards.on_bad_step = "stop"'
        if (nonfinite or is_spike) and self.guards.on_bad_step == "rollback":
            signal = "train/num_nonfinite_updates" if nonfinite else "train/grad_norm"
            what = "a non-finite gradient" if nonfinite else "a gradient-norm spike"
            value = metrics.get(signal, math.nan)
            self._ask_rollback(step, signal, value, f"step {step}: {what} ({signal} = {value:.4g})", "on_bad_step")
        for alarm in alarms:
            self._record(alarm)
        if self.stop_reason is not None:
            self.rollback = None  # a stop policy of the same step wins: the run ends after a checkpoint
        health = {
            "health/num_nonfinite_steps": float(self.num_nonfinite_steps),
            "health/grad_norm_spike": float(is_spike),
        }
        fired = {alarm.name for alarm in alarms}
        health.update({f"health/alarm_{name}": float(name in fired) for name in self.alarms.names})
        return health

    def resume(self, before_step: int, *, rolled_back: bool = False) -> None:
        """Continue a resumed run's health from its run directory (its checkpoint of ``before_step``): `replay` the
        metrics it kept, drop the alarm records of the steps it will run again (they fire again, once), and count
        the rollbacks recorded. ``rolled_back``: the run continues in the same process after a rollback to that
        checkpoint; the records of the steps rolled back, the rollback's own included, are kept."""
        metrics_path = self.run_dir / METRICS_FILE_NAME
        self.replay(read_jsonl(metrics_path) if metrics_path.is_file() else [], before_step=before_step)
        if not rolled_back:
            truncate_jsonl_after(self.run_dir / ALARMS_FILE_NAME, before_step - 1)
        self.num_rollbacks = sum(record.get("alarm") == ROLLBACK_RECORD for record in read_alarms(self.run_dir))
        self.checkpoint_step = before_step

    def checkpointed(self, next_step: int) -> None:
        """The loop wrote the checkpoint of ``next_step``: a rollback from here on restores it."""
        self.checkpoint_step = next_step

    def replay(self, rows: Sequence[Mapping[str, Any]], *, before_step: int) -> None:
        """Take in the recorded metrics of the steps before ``before_step`` (a resumed run's metrics file) silently:
        the spike median, the nonfinite count and the alarm streaks continue as if the run had not stopped."""
        last = {int(row["step"]): row for row in rows if int(row["step"]) < before_step}  # a step logged twice: last
        for step in sorted(last):
            self._observe(step, {k: v for k, v in last[step].items() if isinstance(v, int | float)})

    def _observe(self, step: int, metrics: Mapping[str, float]) -> tuple[bool, list[Alarm]]:
        """The state update of one step: whether its gradient norm spiked, and the alarms that fire."""
        if metrics.get("train/num_nonfinite_updates", 0.0) > 0:
            self.num_nonfinite_steps += 1
        grad_norm = metrics.get("train/grad_norm", math.nan)
        is_spike = (
            math.isfinite(grad_norm)
            and len(self.history) >= self.min_history
            and grad_norm > self.spike_factor * statistics.median(self.history)
        )
        if math.isfinite(grad_norm):
            self.history.append(grad_norm)
        return is_spike, self.alarms.observe(step, metrics)

    def _record(self, alarm: Alarm) -> None:
        logger.warning("%s", alarm.message)
        with (self.run_dir / ALARMS_FILE_NAME).open("a", encoding="utf-8") as file:
            file.write(json.dumps(alarm.to_record()) + "\n")
        if self.guards.on_alarm == "stop":
            self.stop_reason = f'{alarm.message}; monitoring.guards.on_alarm = "stop"'
        if self.guards.on_alarm == "rollback":
            self._ask_rollback(alarm.step, alarm.signal, alarm.value, alarm.message, "on_alarm")

    def _ask_rollback(self, step: int, signal: str, value: float, reason: str, key: str) -> None:
        """Set `rollback` for ``step`` (once a step), or with no checkpoint yet log one line and go on, or past
        max_rollbacks set `stop_reason`."""
        if self.rollback is not None:
            return  # a bad step and an alarm of the same step: one rollback
        if self.checkpoint_step is None:
            logger.warning(
                '%s; no checkpoint to roll back to yet: the run goes on (monitoring.guards.%s = "rollback")',
                reason,
                key,
            )
            return
        if self.num_rollbacks >= self.guards.max_rollbacks:
            self.stop_reason = (
                f"{reason}; no rollback left (monitoring.guards.max_rollbacks = {self.guards.max_rollbacks} done)"
            )
            return
        self.rollback = Rollback(step=step, signal=signal, value=value, reason=reason, number=self.num_rollbacks + 1)

    def dump(self, step: int, rollouts: list[Rollout]) -> Path:
        path = self.run_dir / NONFINITE_DIR_NAME / f"step_{step}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(rollout_record(step, r)) + "\n" for r in rollouts))
        return path


def record_rollback(run_dir: Path, rollback: Rollback, *, checkpoint: str, next_step: int, max_rollbacks: int) -> str:
    """Log one line for ``rollback``, done by restoring ``checkpoint`` (the run's next step ``next_step``), and add its
    record to ``run_dir/alarms.jsonl`` (``sharpen inspect`` lists it); returns the line."""
    message = (
        f"{rollback.reason}; rolled back to checkpoint {checkpoint} (rollback {rollback.number} of {max_rollbacks}): "
        f"steps {next_step}-{rollback.step} run again on the data after step {rollback.step}'s batch"
    )
    logger.warning("%s", message)
    record = {
        "step": rollback.step,
        "alarm": ROLLBACK_RECORD,
        "signal": rollback.signal,
        "value": rollback.value,
        "checkpoint": checkpoint,
        "next_step": next_step,
        "message": message,
    }
    with (Path(run_dir) / ALARMS_FILE_NAME).open("a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")
    return message


def read_alarms(run_dir: Path) -> list[dict[str, Any]]:
    """The alarm records of ``run_dir`` (``alarms.jsonl``), in the order they fired; [] when none fired."""
    path = Path(run_dir) / ALARMS_FILE_NAME
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
