"""The run timeline: where each process and thread spent its time, as a Chrome-trace file Perfetto opens.

Owns ``run_dir/timeline.json``, written in the Trace Event Format's object form (``{"traceEvents": [...]}``): one
``"X"`` (complete) event per span with microsecond ``ts``/``dur``, and ``"M"`` (metadata) events naming processes
and threads. Open it at https://ui.perfetto.dev or ``chrome://tracing``. Does not decide what to time (callers
open spans, `PhaseTimer` opens one per phase) and does not aggregate: per-step sums are `PhaseTimer`'s metrics.

Other processes (Ray actors) do not write the file: they record `Span`s into a `SpanBuffer`, and the process that
owns the `Timeline` adds them with `Timeline.add_spans` under their own pid, thread and process name.

The file is valid JSON after every `flush`: new events are written over the closing ``]}`` and the closing is
written again after them, so a run that dies leaves a loadable file holding everything flushed. Reopening a file
(a resumed run) keeps its events, drops a torn last line, and appends.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharpen.config.schema import MonitoringConfig

TIMELINE_FILE_NAME = "timeline.json"

_HEAD = b'{"traceEvents":[\n'
_TAIL = b'\n],"displayTimeUnit":"ms"}\n'
_SEPARATOR = b",\n"
# perf_counter is monotonic but its zero is arbitrary; anchoring it to the wall clock once makes timestamps of
# different processes on one machine line up in the same trace
_WALL_ANCHOR = time.time() - time.perf_counter()


def wall_clock() -> float:
    """Seconds since the epoch, monotonic within this process."""
    return _WALL_ANCHOR + time.perf_counter()


@contextmanager
def _measure(
    clock: Callable[[], float], args: dict[str, Any], record: Callable[[float, float], None]
) -> Iterator[None]:
    """Times the block and passes ``record`` its start and duration; a block that raises adds its exception's type to
    ``args`` (under ``error``) before it is recorded."""
    start = clock()
    try:
        yield
    except BaseException as error:
        args["error"] = type(error).__name__
        raise
    finally:
        record(start, clock() - start)


@dataclass(kw_only=True, slots=True, frozen=True)
class Span:
    """One finished span of some process and thread, as plain data that can be pickled to another process."""

    name: str
    start: float
    """Seconds since the epoch (`wall_clock`), so spans of processes on one machine line up."""
    duration: float
    pid: int
    tid: int
    process_name: str
    thread_name: str
    category: str = "sharpen"
    args: dict[str, Any] = field(default_factory=dict[str, Any])


class SpanBuffer:
    """Spans of this process kept in memory until another process, which owns the `Timeline`, takes them (`drain`).

    What a Ray actor records: its own pid and threads under ``process_name`` (e.g. ``"trainer actor"``). Holds every
    span until drained, so whoever makes one must drain it regularly (the Ray proxies do after every call).
    """

    def __init__(self, *, process_name: str, clock: Callable[[], float] = wall_clock) -> None:
        self.process_name = process_name
        self._clock = clock
        self._lock = threading.Lock()
        self._spans: list[Span] = []

    def span(self, name: str, *, category: str = "sharpen", **args: Any) -> AbstractContextManager[None]:
        """Times the block as one span of the calling thread, like `Timeline.span`."""

        def record(start: float, duration: float) -> None:
            span = Span(
                name=name,
                start=start,
                duration=duration,
                pid=os.getpid(),
                tid=threading.get_native_id(),
                process_name=self.process_name,
                thread_name=threading.current_thread().name,
                category=category,
                args=args,
            )
            with self._lock:
                self._spans.append(span)

        return _measure(self._clock, args, record)

    def drain(self) -> list[Span]:
        """The spans recorded since the last drain, oldest end first; the buffer is empty afterwards."""
        with self._lock:
            spans, self._spans = self._spans, []
        return spans


def _read_events(path: Path) -> list[dict[str, Any]]:
    """The events of an existing timeline file; a torn last line (the process died mid-write) is dropped."""
    text = path.read_text(encoding="utf-8")
    try:
        return list(json.loads(text)["traceEvents"])
    except (json.JSONDecodeError, KeyError, TypeError):
        pass
    events = []
    for line in text.split("\n")[1:]:  # the first line is the head
        try:
            events.append(json.loads(line.strip().strip(",")))
        except json.JSONDecodeError:
            break  # the torn line, or the tail: everything before it is intact
    return events


def read_timeline(path: Path) -> list[dict[str, Any]]:
    """Every event of a timeline file, in order (what Perfetto would load)."""
    return list(json.loads(Path(path).read_text(encoding="utf-8"))["traceEvents"])


class Timeline:
    """Records spans and writes them to a Chrome-trace JSON file, flushed every ``flush_every`` spans and on `flush`.

    ``with timeline.span("generate", step=3): ...`` times a block on the calling thread; `add_span` records a span
    measured elsewhere (another worker's process and thread), `add_spans` the `Span`s another process recorded.
    Safe to use from several threads. ``clock`` returns
    seconds and is injectable so tests need not sleep.
    """

    def __init__(
        self,
        path: Path,
        *,
        process_name: str = "orchestrator",
        flush_every: int = 64,
        clock: Callable[[], float] = wall_clock,
    ) -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.path = Path(path)
        self.flush_every = flush_every
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._num_pending_spans = 0  # metadata events ride along and do not count towards flush_every
        self._named: set[tuple[int, int | None]] = set()  # (pid, None) for a process, (pid, tid) for a thread
        self.path.parent.mkdir(parents=True, exist_ok=True)
        events = _read_events(self.path) if self.path.exists() else []
        body = _SEPARATOR.join(json.dumps(event).encode() for event in events)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(_HEAD + body + _TAIL)
        os.replace(tmp, self.path)  # a torn file is repaired atomically before anything is appended
        self._file = self.path.open("r+b")
        self._end = len(_HEAD) + len(body)  # where the tail starts: the next events are written here
        self._is_empty = not events
        self._name(os.getpid(), None, process_name)
        self.flush()

    def span(self, name: str, *, category: str = "sharpen", **args: Any) -> AbstractContextManager[None]:
        """Times the block as one span of the calling thread; a block that raises records the exception's type."""

        def record(start: float, duration: float) -> None:
            self.add_span(name, start=start, duration=duration, category=category, args=args)

        return _measure(self._clock, args, record)

    def add_span(
        self,
        name: str,
        *,
        start: float,
        duration: float,
        category: str = "sharpen",
        pid: int | None = None,
        tid: int | None = None,
        process_name: str | None = None,
        thread_name: str | None = None,
        args: dict[str, Any] | None = None,
    ) -> None:
        """Records a span that began at ``start`` (seconds, the ``clock``'s epoch) and lasted ``duration`` seconds.

        ``pid``/``tid`` default to this process and the calling thread; name another process or thread the first
        time it appears with ``process_name``/``thread_name`` (this process and its threads are named for you).
        """
        pid = os.getpid() if pid is None else pid
        if tid is None:
            tid = threading.get_native_id()
            thread_name = thread_name or threading.current_thread().name
        event = {
            "name": name,
            "cat": category,
            "ph": "X",
            "ts": round(start * 1e6, 3),
            "dur": round(duration * 1e6, 3),
            "pid": pid,
            "tid": tid,
            "args": args or {},
        }
        with self._lock:
            if process_name is not None:
                self._name_locked(pid, None, process_name)
            if thread_name is not None:
                self._name_locked(pid, tid, thread_name)
            self._pending.append(event)
            self._num_pending_spans += 1
            if self._num_pending_spans >= self.flush_every:
                self._flush_locked()

    def add_spans(self, spans: Iterable[Span]) -> None:
        """Records spans another process measured (a `SpanBuffer`'s), each under its own pid, thread and process
        name; they are written with the next flush, like this process's own."""
        for span in spans:
            self.add_span(
                span.name,
                start=span.start,
                duration=span.duration,
                category=span.category,
                pid=span.pid,
                tid=span.tid,
                process_name=span.process_name,
                thread_name=span.thread_name,
                args=span.args,
            )

    def flush(self) -> None:
        """Writes pending events; afterwards the file is complete, valid JSON."""
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        self.flush()
        self._file.close()

    def _name(self, pid: int, tid: int | None, name: str) -> None:
        with self._lock:
            self._name_locked(pid, tid, name)

    def _name_locked(self, pid: int, tid: int | None, name: str) -> None:
        if (pid, tid) in self._named:
            return
        self._named.add((pid, tid))
        kind = "process_name" if tid is None else "thread_name"
        self._pending.append({"name": kind, "ph": "M", "pid": pid, "tid": tid or 0, "args": {"name": name}})

    def _flush_locked(self) -> None:
        if not self._pending:
            return
        body = _SEPARATOR.join(json.dumps(event).encode() for event in self._pending)
        data = body if self._is_empty else _SEPARATOR + body
        self._file.seek(self._end)
        self._file.write(data + _TAIL)  # one write: the file is never left without its closing
        self._file.truncate()
        self._file.flush()
        self._end += len(data)
        self._is_empty = False
        self._pending.clear()
        self._num_pending_spans = 0


def build_timeline(config: MonitoringConfig, run_dir: Path) -> Timeline | None:
    """``run_dir/timeline.json`` when ``config.timeline`` is on (an existing file is continued), else None."""
    return Timeline(Path(run_dir) / TIMELINE_FILE_NAME) if config.timeline else None
