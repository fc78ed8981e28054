"""The console view of a run: a live progress bar, or one plain line per step where a live bar cannot be drawn.

Owns how a step's key metrics are shown to a person watching the run. It is a `MetricSink` (``log``/``close``), so
the orchestrator treats it like any other sink. Does not write files (see `sinks.py`) and does not pick the metrics
it is given; it shows the ones named in ``keys`` that are present and ignores the rest.

Each step prints one line such as ``step 3/20  reward 0.25  loss 0.0123  generate 2.6 s  train 23 s  28 s/step``
(the metrics named in ``keys``, then the time of each phase). With a terminal, and when enabled, a live bar (rich)
below those lines shows steps done, elapsed time and ETA; in CI logs, under ``make demo | tee`` or with
``monitoring.progress = false`` the lines alone show the progress. The display writes to `run_log.terminal`, which
during ``sharpen train`` is the terminal while every other library's output goes to the run's log.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TextIO

from sharpen.monitoring.run_log import Terminal, terminal

DEFAULT_PROGRESS_KEYS: tuple[str, ...] = (
    "reward/mean",
    "reward/correct",
    "rollout/completion_length_mean",
    "offpolicy/kl_k3",
)
"""Metrics shown next to the bar when a step reports them, in this order."""

PHASE_PREFIX = "time/"
STEP_TIME_KEY = "time/step"


def format_eta(seconds: float | None) -> str:
    """``eta 0:14:05`` (``eta -:--:--`` before the first step of this process has finished)."""
    if seconds is None:
        return "eta -:--:--"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"eta {hours}:{minutes:02d}:{secs:02d}"


def metric_label(key: str) -> str:
    """Short label of a metric: ``reward/mean`` -> ``reward``, ``train/loss`` -> ``loss``,
    ``rollout/completion_length_mean`` -> ``completion_length``."""
    head, _, tail = key.rpartition("/")
    if not head:
        return key
    return head.rpartition("/")[2] if tail == "mean" else tail.removesuffix("_mean")


def format_step_summary(metrics: dict[str, float], keys: Sequence[str], seconds_per_step: float) -> str:
    """``reward 0.25  loss 0.0123  generate 2.6 s  train 23 s  28 s/step``: the present ``keys``, the phase
    times (``time/<phase>`` metrics, in the order the step reported them; ``time/step`` is the last part), then the
    step time."""
    parts = [f"{metric_label(key)} {float(metrics[key]):.4g}" for key in keys if key in metrics]
    phases = [key for key in metrics if key.startswith(PHASE_PREFIX) and key != STEP_TIME_KEY]
    parts += [f"{key.removeprefix(PHASE_PREFIX)} {float(metrics[key]):.2g} s" for key in phases]
    parts.append(f"{seconds_per_step:.3g} s/step")
    return "  ".join(parts)


class ProgressDisplay:
    """Shows step k/N, elapsed time, ETA and key metrics of a run (steps are 0-based: logging step k completes k+1).

    Args:
        num_steps: total trainer steps of the run.
        enabled: draw the live bar (when ``stream`` is a terminal); False always prints plain lines.
        resume_from_step: last step a resumed run already completed; the bar starts after it.
        keys: metrics to show, when present in a step's metrics.
        stream: where to draw (default: `run_log.terminal` at construction: the terminal during ``sharpen train``,
            else ``sys.stdout``).
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
        self._terminal = terminal() if stream is None else Terminal(stream)
        self._stream = self._terminal.stream
        self._clock = clock
        self._start_time = self._last_time = clock()
        self._is_closed = False
        num_completed = 0 if resume_from_step is None else resume_from_step + 1
        self._num_completed_at_start = num_completed
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
        )

        self._progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[eta]}"),
            console=Console(file=self._stream),
            # rich would show other writes to sys.stdout/stderr above the bar; while the terminal is sharpen's alone
            # (`run_log.capture_run_output`) those writes belong in the run's log
            redirect_stdout=not self._terminal.is_exclusive,
            redirect_stderr=not self._terminal.is_exclusive,
        )
        self._task_id = self._progress.add_task("", total=self.num_steps, completed=num_completed, eta=format_eta(None))
        self._progress.start()
        self._terminal.live_console = self._progress.console  # sharpen's log lines print above the bar

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        now = self._clock()
        summary = format_step_summary(metrics, self.keys, now - self._last_time)
        self._last_time = now
        eta = format_eta(self._seconds_left(now, num_completed=step + 1))
        line = f"step {step + 1}/{self.num_steps}  {summary}"
        if self.is_live:
            self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
            self._progress.update(self._task_id, completed=step + 1, eta=eta)
        else:
            print(f"{line}  {eta}", file=self._stream, flush=True)

    def _seconds_left(self, now: float, *, num_completed: int) -> float | None:
        """The remaining steps at the mean pace of the steps this display has seen (a resumed run's earlier steps
        ran in another process)."""
        num_seen = num_completed - self._num_completed_at_start
        if num_seen <= 0:
            return None
        return (now - self._start_time) / num_seen * (self.num_steps - num_completed)

    def close(self) -> None:
        if self.is_live and not self._is_closed:
            self._progress.stop()
            self._terminal.live_console = None
        self._is_closed = True
