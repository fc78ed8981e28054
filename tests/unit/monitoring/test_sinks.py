"""JSONL and TensorBoard sinks, fan-out, resume truncation and `build_sinks`."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sharpen.config.schema import MonitoringConfig
from sharpen.monitoring import (
    JsonlSink,
    MetricSink,
    MultiSink,
    ProgressDisplay,
    TensorBoardSink,
    build_sinks,
    read_jsonl,
    truncate_jsonl_after,
)


def _scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_jsonl_round_trip_and_flush_per_call(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log({"reward/mean": 0.25, "loss": 1.5}, step=0)
    # readable before close: each call is flushed, so a crash loses nothing
    assert read_jsonl(path) == [{"step": 0, "reward/mean": 0.25, "loss": 1.5}]
    sink.log({"reward/mean": 0.5}, step=1)
    sink.close()
    assert read_jsonl(path) == [{"step": 0, "reward/mean": 0.25, "loss": 1.5}, {"step": 1, "reward/mean": 0.5}]


def test_jsonl_reopen_appends(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    for step in range(2):
        sink = JsonlSink(path)
        sink.log({"x": float(step)}, step=step)
        sink.close()
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]


def test_jsonl_resume_drops_steps_after_resume_point(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in range(5):
        sink.log({"x": float(step)}, step=step)
    sink.close()

    resumed = JsonlSink(path, resume_from_step=2)
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]
    resumed.log({"x": 30.0}, step=3)
    resumed.close()
    assert [(r["step"], r["x"]) for r in read_jsonl(path)] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]


def test_truncate_drops_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "x": 1.0}\n{"step": 1, "x"', encoding="utf-8")
    truncate_jsonl_after(path, None)
    assert read_jsonl(path) == [{"step": 0, "x": 1.0}]
    truncate_jsonl_after(tmp_path / "missing.jsonl", 3)
    assert not (tmp_path / "missing.jsonl").exists()


def test_tensorboard_scalars_read_back(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path / "tb")
    for step, reward in enumerate([0.1, 0.4, 0.9]):
        sink.log({"reward/mean": reward, "loss": 2.0 - step}, step=step)
    sink.close()
    rewards = _scalars(tmp_path / "tb", "reward/mean")
    assert [s for s, _ in rewards] == [0, 1, 2]
    assert [v for _, v in rewards] == pytest.approx([0.1, 0.4, 0.9])
    assert _scalars(tmp_path / "tb", "loss") == [(0, 2.0), (1, 1.0), (2, 0.0)]


def test_tensorboard_resume_purges_steps_after_resume_point(tmp_path: Path) -> None:
    first = TensorBoardSink(tmp_path / "tb")
    for step in range(5):
        first.log({"x": float(step)}, step=step)
    first.close()

    resumed = TensorBoardSink(tmp_path / "tb", resume_from_step=2)
    for step in (3, 4):
        resumed.log({"x": 10.0 * step}, step=step)
    resumed.close()
    assert _scalars(tmp_path / "tb", "x") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


class _ListSink:
    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []
        self.is_closed = False

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        self.calls.append((step, metrics))

    def close(self) -> None:
        self.is_closed = True


def test_multi_sink_fans_out() -> None:
    sinks = [_ListSink(), _ListSink()]
    multi = MultiSink(sinks)
    assert isinstance(multi, MetricSink)
    multi.log({"a": 1.0}, step=7)
    multi.close()
    for sink in sinks:
        assert sink.calls == [(7, {"a": 1.0})]
        assert sink.is_closed


def test_build_sinks_all_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sink = build_sinks(MonitoringConfig(), tmp_path, num_steps=3, resume_from_step=None)
    assert isinstance(sink, MultiSink)
    assert [type(s) for s in sink.sinks] == [JsonlSink, TensorBoardSink, ProgressDisplay]
    sink.log({"reward/mean": 0.5}, step=0)
    sink.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0, "reward/mean": 0.5}]
    assert _scalars(tmp_path / "tensorboard", "reward/mean") == [(0, 0.5)]
    assert "step 1/3" in capsys.readouterr().out  # captured stdout is not a terminal: plain lines


def test_build_sinks_without_tensorboard_resumes_jsonl(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n', encoding="utf-8")
    config = MonitoringConfig(tensorboard=False, progress=False)
    sink = build_sinks(config, tmp_path, num_steps=3, resume_from_step=0)
    assert [type(s) for s in sink.sinks] == [JsonlSink, ProgressDisplay]  # type: ignore[attr-defined]
    sink.close()
    assert not (tmp_path / "tensorboard").exists()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0}]
