"""Where a step's time and memory go: per-phase wall-clock timers and peak-memory readings, as metrics.

Owns the ``time/<phase>`` and ``memory/*`` metric names. Does not log metrics (the caller passes them to a sink;
an optional `Timeline` gets one span per phase) and does not import torch: CUDA memory is read only when the
process has already imported torch.
"""

from __future__ import annotations

import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from sharpen.monitoring.timeline import Timeline

GIB = 2**30


class PhaseTimer:
    """Accumulates wall-clock seconds per named phase between calls to `pop_metrics`.

    ``with timer.phase("generate"): ...``; a phase entered twice (or nested under another) adds up. ``clock`` is
    injectable so tests need not sleep. With a ``timeline``, each phase is also recorded there as one span (category
    ``phase``, with the keyword arguments given to `phase` as its args), and `pop_metrics` flushes the timeline, so a
    crashed run's timeline holds every finished step.
    """

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter, timeline: Timeline | None = None) -> None:
        self._clock = clock
        self._timeline = timeline
        self._seconds: defaultdict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str, **span_args: Any) -> Iterator[None]:
        span = nullcontext() if self._timeline is None else self._timeline.span(name, category="phase", **span_args)
        with span:
            start = self._clock()
            try:
                yield
            finally:
                self._seconds[name] += self._clock() - start

    def pop_metrics(self) -> dict[str, float]:
        """``{"time/<phase>": seconds}`` accumulated since the last pop, then start afresh."""
        metrics = {f"time/{name}": seconds for name, seconds in self._seconds.items()}
        self._seconds.clear()
        if self._timeline is not None:
            self._timeline.flush()  # once per step: cheap, and what a crash would otherwise lose
        return metrics


def peak_memory_metrics() -> dict[str, float]:
    """Peak resident memory of this process in GiB, and peak CUDA memory allocated by torch when it is in use."""
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = max_rss if sys.platform == "darwin" else max_rss * 1024  # macOS reports bytes, Linux KiB
    metrics = {"memory/peak_rss_gib": rss_bytes / GIB}
    torch = sys.modules.get("torch")  # never import torch just to ask: a process without it has no CUDA memory
    if torch is not None and torch.cuda.is_available():
        metrics["memory/cuda_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    return metrics
