"""Run health: what a step's metrics say about the run's numerics, checked every step.

Owns two checks. A step whose gradient was not finite was skipped by the trainer (its optimizer step did not run);
here its whole batch is dumped to ``run_dir/nonfinite/step_<N>.jsonl`` (the rollout records, replayable and
readable) and counted. A gradient norm far above its recent median is flagged as a spike (often the first sign
of a diverging run). It does not stop the run or change training; it reports.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections import deque
from pathlib import Path

from sharpen.monitoring.recorder import rollout_record
from sharpen.types import Rollout

logger = logging.getLogger(__name__)

NONFINITE_DIR_NAME = "nonfinite"


class RunHealth:
    def __init__(self, run_dir: Path, *, spike_factor: float, spike_window: int, min_history: int = 5) -> None:
        self.run_dir = Path(run_dir)
        self.spike_factor = spike_factor
        self.min_history = min_history
        self.history: deque[float] = deque(maxlen=spike_window)
        self.num_nonfinite_steps = 0

    def check(self, step: int, rollouts: list[Rollout], train_metrics: dict[str, float]) -> dict[str, float]:
        """``health/*`` metrics of one step; dumps the batch of a step with a non-finite update."""
        metrics: dict[str, float] = {}
        if train_metrics.get("train/num_nonfinite_updates", 0.0) > 0:
            self.num_nonfinite_steps += 1
            path = self.dump(step, rollouts)
            logger.warning("step %d: non-finite gradient, optimizer step skipped; batch dumped to %s", step, path)
        metrics["health/num_nonfinite_steps"] = float(self.num_nonfinite_steps)
        grad_norm = train_metrics.get("train/grad_norm", float("nan"))
        is_spike = (
            math.isfinite(grad_norm)
            and len(self.history) >= self.min_history
            and grad_norm > self.spike_factor * statistics.median(self.history)
        )
        if is_spike:
            logger.warning(
                "step %d: gradient norm %.4g is over %.1fx its recent median %.4g",
                step,
                grad_norm,
                self.spike_factor,
                statistics.median(self.history),
            )
        metrics["health/grad_norm_spike"] = float(is_spike)
        if math.isfinite(grad_norm):
            self.history.append(grad_norm)
        return metrics

    def dump(self, step: int, rollouts: list[Rollout]) -> Path:
        path = self.run_dir / NONFINITE_DIR_NAME / f"step_{step}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(rollout_record(step, r)) + "\n" for r in rollouts))
        return path
