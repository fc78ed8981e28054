"""Phase timers and peak-memory metrics."""

from __future__ import annotations

import sys

import pytest

from sharpen.monitoring import PhaseTimer, peak_memory_metrics


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_phases_accumulate_until_popped() -> None:
    clock = _FakeClock()
    timer = PhaseTimer(clock=clock)
    with timer.phase("generate"):
        clock.now += 2.0
    with timer.phase("train"):
        clock.now += 1.5
        with timer.phase("optimizer"):
            clock.now += 0.25
    with timer.phase("generate"):
        clock.now += 3.0
    assert timer.pop_metrics() == {"time/generate": 5.0, "time/train": 1.75, "time/optimizer": 0.25}
    assert timer.pop_metrics() == {}
    with timer.phase("generate"):
        clock.now += 1.0
    assert timer.pop_metrics() == {"time/generate": 1.0}


def test_phase_counts_time_when_body_raises() -> None:
    clock = _FakeClock()
    timer = PhaseTimer(clock=clock)
    with pytest.raises(RuntimeError), timer.phase("reward"):
        clock.now += 0.5
        raise RuntimeError("boom")
    assert timer.pop_metrics() == {"time/reward": 0.5}


def test_peak_memory_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    metrics = peak_memory_metrics()
    assert set(metrics) == {"memory/peak_rss_gib"}
    assert 0.001 < metrics["memory/peak_rss_gib"] < 1024  # a Python process: more than 1 MiB, less than 1 TiB


def test_peak_memory_reads_cuda_only_from_imported_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    class _Cuda:
        @staticmethod
        def is_available() -> bool:
            return True

        @staticmethod
        def max_memory_allocated() -> int:
            return 3 * 2**30

    class _Torch:
        cuda = _Cuda

    monkeypatch.setitem(sys.modules, "torch", _Torch)
    assert peak_memory_metrics()["memory/cuda_peak_gib"] == 3.0
