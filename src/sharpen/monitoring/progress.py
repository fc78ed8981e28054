"""The console view of a run: a live progress bar, or one plain line per step where a live bar cannot be drawn.

Owns how a step's key metrics are shown to a person watching the run. It is a `MetricSink` (``log``/``close``), so
the orchestrator treats it like any other sink. Does not write files (see `sinks.py`) and does not pick the metrics
it is given; it shows the ones named in ``keys`` that are present and ignores the rest.

The live bar (rich) is drawn only when enabled and the stream is a terminal. Otherwise, in CI logs, under
``make demo | tee`` or with ``monitoring.progress = false``, each step prints one line such as
``step 3/20  reward 0.25  loss 0.0123  4.1 s/step`` so progress is still visible without a terminal.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

DEFAULT_PROGRESS_KEYS: tuple[str, ...] = (
    "reward/mean",
    "reward/correct",
    "rollout/completion_length_mean",
    "offpolicy/kl_k3",
)
"""Metrics shown next to the bar when a step reports them, in this order."""

ETA_WINDOW_SECONDS = 600.0
"""rich estimates speed from the last this-many seconds; its 30 s default gives no ETA when a step takes longer."""


def metric_label(key: str) -> str:
    """Short label of a metric: ``reward/mean`` -> ``reward``, ``train/loss`` -> ``loss``."""
    head, _, tail = key.rpartition("/")
    if not head:
        return key
    return head.rpartition("/")[2] if tail == "mean" else tail


def format_step_summary(metrics: dict[str, float], keys: Sequence[str], seconds_per_step: float) -> str:
    """``reward 0.25  loss 0.0123  4.1 s/step``: the present ``keys`` then the step time."""
    parts = [f"{metric_label(key)} {float(metrics[key]):.4g}" for key in keys if key in metrics]
    parts.append(f"{seconds_per_step:.3g} s/step")
    return "  ".join(parts)


class ProgressDisplay:
    """Shows step k/N, elapsed time, ETA and key metrics of a run (steps are 0-based: logging step k completes k+1).

    Args:
        num_steps: total trainer steps of the run.
        enabled: draw the live bar (when ``stream`` is a terminal); False always prints plain lines.
        resume_from_step: last step a resumed run already completed; the bar starts after it.
        keys: metrics to show, when present in a step's metrics.
        stream: where to draw (default: ``sys.stdout`` at construction).
        clock: seconds, for the per-step time (injectable for tests).
    """

    def __init__(
        self,
        num_steps: int,
        *,
        enabled: bool,
        resume_from_step: int | None = None,
        keys: Sequence[str] = DEFAULT_PROGRESS_KEYS,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be at least 1, got {num_steps}")
        self.num_steps = num_steps
        self.keys = tuple(keys)
        self._stream = stream if stream is not None else sys.stdout
        self._clock = clock
        self._last_time = clock()
        self._is_closed = False
        num_completed = 0 if resume_from_step is None else resume_from_step + 1
        self.is_live = enabled and self._stream.isatty()
        if self.is_live:
            self._start_live(num_completed)

    def _start_live(self, num_completed: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=Console(file=self._stream),
            speed_estimate_period=ETA_WINDOW_SECONDS,
        )
        self._task_id = self._progress.add_task("", total=self.num_steps, completed=num_completed)
        self._progress.start()

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        now = self._clock()
        summary = format_step_summary(metrics, self.keys, now - self._last_time)
        self._last_time = now
        if self.is_live:
            self._progress.update(self._task_id, completed=step + 1, description=summary)
        else:
            print(f"step {step + 1}/{self.num_steps}  {summary}", file=self._stream, flush=True)

    def close(self) -> None:
        if self.is_live and not self._is_closed:
            self._progress.stop()
        self._is_closed = True
