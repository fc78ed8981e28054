"""The console progress display: plain lines without a terminal, a rich bar with one."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest

from sharpen.monitoring import MetricSink, ProgressDisplay
from sharpen.monitoring.progress import format_step_summary, metric_label


def _clock(times: list[float]) -> Iterator[float]:
    yield from times


def test_disabled_prints_one_line_per_step(capsys: pytest.CaptureFixture[str]) -> None:
    ticks = _clock([100.0, 102.0, 105.5])
    display = ProgressDisplay(4, enabled=False, clock=lambda: next(ticks))
    assert isinstance(display, MetricSink)
    display.log({"reward/mean": 0.25, "reward/correct": 0.5, "other": 9.0}, step=0)
    display.log({"reward/mean": 0.75}, step=1)
    display.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "step 1/4  reward 0.25  correct 0.5  2 s/step  eta 0:00:06",
        "step 2/4  reward 0.75  3.5 s/step  eta 0:00:06",
    ]


def test_each_line_shows_the_time_of_each_phase(capsys: pytest.CaptureFixture[str]) -> None:
    ticks = _clock([0.0, 30.0])
    display = ProgressDisplay(3, enabled=False, clock=lambda: next(ticks))
    metrics = {"reward/mean": 0.5, "time/generate": 2.61, "time/score": 0.004, "time/train": 23.4, "time/step": 27.9}
    display.log(metrics, step=0)
    line = capsys.readouterr().out.strip()
    assert line == "step 1/3  reward 0.5  generate 2.6 s  score 0.004 s  train 23 s  30 s/step  eta 0:01:00"


def test_a_resumed_run_estimates_from_its_own_steps(capsys: pytest.CaptureFixture[str]) -> None:
    ticks = _clock([0.0, 10.0])
    display = ProgressDisplay(10, enabled=False, resume_from_step=4, clock=lambda: next(ticks))
    display.log({}, step=5)  # steps 0-4 ran before the interruption; this process ran step 5 in 10 s
    assert capsys.readouterr().out.strip() == "step 6/10  10 s/step  eta 0:00:40"


def test_enabled_without_terminal_falls_back_to_lines(capsys: pytest.CaptureFixture[str]) -> None:
    display = ProgressDisplay(2, enabled=True)
    assert not display.is_live  # pytest's captured stdout is not a TTY
    display.log({"reward/mean": 1.0}, step=1)
    display.close()
    assert capsys.readouterr().out.startswith("step 2/2  reward 1  ")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_enabled_on_terminal_draws_rich_bar() -> None:
    stream = _Terminal()
    display = ProgressDisplay(5, enabled=True, resume_from_step=1, stream=stream)
    assert display.is_live
    display.log({"reward/mean": 0.5}, step=2)
    display.close()
    display.close()  # idempotent
    output = stream.getvalue()
    assert "2/5" in output  # resumed after step 1: two steps already done
    assert "3/5" in output
    assert "reward 0.5" in output


def test_metric_labels_and_summary() -> None:
    assert metric_label("reward/mean") == "reward"
    assert metric_label("train/loss") == "loss"
    assert metric_label("loss") == "loss"
    assert metric_label("rollout/completion_length_mean") == "completion_length"
    summary = format_step_summary({"b": 2.0, "a": 1.0}, ["a", "b", "missing"], 0.123456)
    assert summary == "a 1  b 2  0.123 s/step"


def test_rejects_zero_steps() -> None:
    with pytest.raises(ValueError, match="num_steps"):
        ProgressDisplay(0, enabled=False)
