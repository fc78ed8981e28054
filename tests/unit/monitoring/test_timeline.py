"""The Chrome-trace timeline: complete events in microseconds, process and thread names, a loadable file after a
crash, continuation across processes, spans another process recorded, and `PhaseTimer` feeding it."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sharpen.config.schema import MonitoringConfig
from sharpen.monitoring import PhaseTimer, Span, SpanBuffer, Timeline, build_timeline, read_timeline


class _FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _spans(events: list[dict]) -> list[dict]:
    return [event for event in events if event["ph"] == "X"]


def test_spans_are_complete_events_in_microseconds(tmp_path: Path) -> None:
    clock = _FakeClock()
    timeline = Timeline(tmp_path / "timeline.json", process_name="trainer", clock=clock)
    with timeline.span("generate", step=3):
        clock.now += 0.25
        with timeline.span("reward", category="score"):
            clock.now += 0.5
    timeline.close()

    events = read_timeline(tmp_path / "timeline.json")
    me, thread = os.getpid(), threading.get_native_id()
    assert _spans(events) == [  # a span is written when it ends: the inner one first
        {
            "name": "reward",
            "cat": "score",
            "ph": "X",
            "ts": 1000.25e6,
            "dur": 0.5e6,
            "pid": me,
            "tid": thread,
            "args": {},
        },
        {
            "name": "generate",
            "cat": "sharpen",
            "ph": "X",
            "ts": 1000e6,
            "dur": 0.75e6,
            "pid": me,
            "tid": thread,
            "args": {"step": 3},
        },
    ]
    names = {(e["name"], e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {("process_name", me, 0): "trainer", ("thread_name", me, thread): "MainThread"}


def test_span_of_a_failing_block_is_kept_with_the_error(tmp_path: Path) -> None:
    timeline = Timeline(tmp_path / "timeline.json")
    with pytest.raises(ValueError), timeline.span("train"):
        raise ValueError("nan loss")
    timeline.close()
    (span,) = _spans(read_timeline(tmp_path / "timeline.json"))
    assert (span["name"], span["args"]) == ("train", {"error": "ValueError"})


def test_spans_from_other_workers_and_threads(tmp_path: Path) -> None:
    timeline = Timeline(tmp_path / "timeline.json", clock=_FakeClock())
    timeline.add_span(
        "generate", start=5.0, duration=2.0, pid=4242, tid=7, process_name="rollout-0", thread_name="engine"
    )
    timeline.add_span("generate", start=7.0, duration=1.0, pid=4242, tid=7, process_name="rollout-0")
    worker = threading.Thread(target=lambda: timeline.add_span("score", start=1.0, duration=0.5), name="scorer")
    worker.start()
    worker.join()
    timeline.close()

    events = read_timeline(tmp_path / "timeline.json")
    assert [(e["name"], e["pid"], e["ts"], e["dur"]) for e in _spans(events)] == [
        ("generate", 4242, 5e6, 2e6),
        ("generate", 4242, 7e6, 1e6),
        ("score", os.getpid(), 1e6, 0.5e6),
    ]
    names = sorted(e["args"]["name"] for e in events if e["ph"] == "M")
    assert names == sorted(["orchestrator", "rollout-0", "engine", "scorer"])  # each named once


def test_spans_of_another_process_arrive_under_its_own_pid_and_names(tmp_path: Path) -> None:
    """What a Ray actor does: record into a `SpanBuffer`, ship the drained spans (pickled), add them to the driver's
    timeline."""
    clock = _FakeClock(50.0)
    buffer = SpanBuffer(process_name="trainer actor", clock=clock)
    with buffer.span("step", category="actor", step=2):
        clock.now += 1.5
    with pytest.raises(RuntimeError), buffer.span("put_weights"):
        clock.now += 0.25
        raise RuntimeError("out of memory")
    spans = pickle.loads(pickle.dumps(buffer.drain()))
    assert buffer.drain() == []
    me, thread = os.getpid(), threading.get_native_id()
    assert spans == [
        Span(
            name="step",
            start=50.0,
            duration=1.5,
            pid=me,
            tid=thread,
            process_name="trainer actor",
            thread_name="MainThread",
            category="actor",
            args={"step": 2},
        ),
        Span(
            name="put_weights",
            start=51.5,
            duration=0.25,
            pid=me,
            tid=thread,
            process_name="trainer actor",
            thread_name="MainThread",
            args={"error": "RuntimeError"},
        ),
    ]

    foreign = [
        Span(
            name="generate",
            start=3.0,
            duration=1.0,
            pid=4242,
            tid=9,
            process_name="engine actor",
            thread_name="MainThread",
        )
    ]
    timeline = Timeline(tmp_path / "timeline.json", clock=_FakeClock(), flush_every=2)
    timeline.add_spans(foreign * 2)  # two spans: flushed by flush_every, like the process's own
    events = read_timeline(tmp_path / "timeline.json")
    assert [(e["name"], e["pid"], e["tid"], e["ts"], e["dur"]) for e in _spans(events)] == [
        ("generate", 4242, 9, 3e6, 1e6),
        ("generate", 4242, 9, 3e6, 1e6),
    ]
    names = {(e["name"], e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {
        ("process_name", me, 0): "orchestrator",
        ("process_name", 4242, 0): "engine actor",
        ("thread_name", 4242, 9): "MainThread",
    }
    timeline.close()


def test_file_is_loadable_after_a_crash(tmp_path: Path) -> None:
    """A process that dies without `close` leaves valid JSON holding every flushed span, in the object format."""
    path = tmp_path / "timeline.json"
    code = (
        "import os, sys\n"
        "from sharpen.monitoring import Timeline\n"
        "timeline = Timeline(sys.argv[1], flush_every=2)\n"
        "for step in range(5):\n"
        "    with timeline.span('step', step=step):\n"
        "        pass\n"
        "os._exit(1)  # no close, no flush of the fifth span\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=False, timeout=60)
    document = json.loads(path.read_text(encoding="utf-8"))
    assert document["displayTimeUnit"] == "ms"
    assert [span["args"]["step"] for span in _spans(document["traceEvents"])] == [0, 1, 2, 3]


def test_reopening_continues_the_file_and_repairs_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    first = Timeline(path, clock=_FakeClock())
    with first.span("step", step=0):
        pass
    first.flush()
    # the interrupted process died mid-write: a torn event after the last complete one, no closing
    text = path.read_text(encoding="utf-8")
    path.write_text(text[: text.rindex("\n]")] + ',\n{"name": "st', encoding="utf-8")

    resumed = Timeline(path, clock=_FakeClock(2000.0))
    with resumed.span("step", step=1):
        pass
    resumed.close()
    spans = _spans(read_timeline(path))
    assert [(span["args"]["step"], span["ts"]) for span in spans] == [(0, 1000e6), (1, 2000e6)]


def test_flush_every_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="flush_every"):
        Timeline(tmp_path / "timeline.json", flush_every=0)


def test_build_timeline(tmp_path: Path) -> None:
    assert build_timeline(MonitoringConfig(timeline=False), tmp_path) is None
    assert not (tmp_path / "timeline.json").exists()
    timeline = build_timeline(MonitoringConfig(), tmp_path)
    assert timeline is not None and timeline.path == tmp_path / "timeline.json"
    timeline.close()
    assert read_timeline(tmp_path / "timeline.json")[0]["name"] == "process_name"


def test_phase_timer_feeds_the_timeline_and_flushes_per_step(tmp_path: Path) -> None:
    clock = _FakeClock()
    timeline = Timeline(tmp_path / "timeline.json", clock=clock, flush_every=1000)
    timer = PhaseTimer(clock=clock, timeline=timeline)
    with timer.phase("generate", step=0):
        clock.now += 2.0
        with timer.phase("engine"):
            clock.now += 1.0
    assert timer.pop_metrics() == {"time/generate": 3.0, "time/engine": 1.0}
    # popped once per step: the spans are on disk without close
    spans = _spans(read_timeline(tmp_path / "timeline.json"))
    assert [(s["name"], s["cat"], s["ts"], s["dur"], s["args"]) for s in spans] == [
        ("engine", "phase", 1002e6, 1e6, {}),
        ("generate", "phase", 1000e6, 3e6, {"step": 0}),
    ]
    timeline.close()
