"""Phase timers and peak-memory metrics."""

from __future__ import annotations

import json
import subprocess
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


_ALLOCATE_AND_REPORT = """
import json, os, sys
from sharpen.monitoring import peak_memory_metrics
before = peak_memory_metrics()
resident = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30  # GiB, now
buffer = bytearray(b"x") * (256 << 20)  # written byte by byte, so every page is resident (not lazily zero)
after = peak_memory_metrics()
print(json.dumps({"before": before, "resident": resident, "after": after, "has_torch": "torch" in sys.modules}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident size from /proc")
def test_peak_rss_rises_by_what_the_process_allocates() -> None:
    # A fresh process: this one's peak may already lie far above its current size, which would hide the rise.
    output = subprocess.run(
        [sys.executable, "-c", _ALLOCATE_AND_REPORT], capture_output=True, text=True, check=True
    ).stdout
    report = json.loads(output)
    assert not report["has_torch"] and set(report["after"]) == {"memory/peak_rss_gib"}  # no CUDA key without torch
    # the peak becomes the resident size plus the 256 MiB buffer, unless an earlier peak was higher still
    expected = max(report["before"]["memory/peak_rss_gib"], report["resident"] + 0.25)
    assert report["after"]["memory/peak_rss_gib"] == pytest.approx(expected, abs=0.01), report


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
