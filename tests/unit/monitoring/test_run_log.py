"""The run's log: libraries' log records, Python warnings and child processes' output go to the log file and not to
the terminal (unless verbose); sharpen's own lines reach the terminal, and everything is restored afterwards."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from sharpen.config import ConfigError
from sharpen.monitoring import LOG_FILE_NAME, ProgressDisplay, capture_run_output, terminal


@pytest.fixture
def libraries() -> Iterator[None]:
    """Loggers set up as vLLM's and transformers' are, under names of their own (the real libraries may be imported
    in this test process): one gets its handler on the process's stderr before the run (a library imported before
    it), the other on ``sys.stdout`` during the run (vLLM, imported when the engine starts)."""
    early = logging.getLogger("fakelib.transformers")
    early_stream = open(2, "w", closefd=False)  # noqa: SIM115 (closefd=False: closing it leaves descriptor 2 alone)
    early.addHandler(logging.StreamHandler(early_stream))
    early.propagate = False
    yield
    early.handlers.clear()
    early.propagate = True
    early_stream.close()


def _run_noisy_libraries() -> None:
    """What the libraries do during a run: log through their own handlers and through the root logger, warn,
    and write from a child process."""
    late = logging.getLogger("fakelib.vllm")
    late.addHandler(logging.StreamHandler(sys.stdout))
    late.propagate = False
    late.setLevel(logging.INFO)
    try:
        late.info("vllm: resolved architecture")
        logging.getLogger("fakelib.transformers").warning("transformers: generation flags are not valid")
        logging.getLogger("fakelib.ray").warning("ray: worker started")
        warnings.warn("torch: reduce_op is deprecated", FutureWarning, stacklevel=1)
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('worker: NUMA binding\\n')"], check=True)
    finally:
        late.handlers.clear()
        late.propagate = True
        late.setLevel(logging.NOTSET)


THIRD_PARTY_LINES = (
    "vllm: resolved architecture",
    "transformers: generation flags are not valid",
    "ray: worker started",
    "torch: reduce_op is deprecated",
    "worker: NUMA binding",
)


def test_libraries_go_to_the_log_and_sharpen_to_the_terminal(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], libraries: None
):
    log_path = tmp_path / "runs" / "demo" / LOG_FILE_NAME
    with capture_run_output(log_path, verbose=False) as run_terminal:
        assert terminal() is run_terminal
        _run_noisy_libraries()
        display = ProgressDisplay(2, enabled=True)
        display.log({"reward/mean": 0.5, "time/generate": 2.5, "time/train": 20.0, "time/step": 23.0}, step=0)
        display.close()
        logging.getLogger("sharpen.orchestration").warning("sharpen: a rollout abstained")
    shown = capfd.readouterr()
    log = log_path.read_text()
    for line in THIRD_PARTY_LINES:
        assert line in log
        assert line not in shown.out + shown.err
    assert "step 1/2  reward 0.5  generate 2.5 s  train 20 s" in shown.out
    assert "sharpen: a rollout abstained" in shown.out and "sharpen: a rollout abstained" in log
    assert "step 1/2" not in log

    # afterwards nothing is captured any more
    print("after the run")
    logging.getLogger("fakelib.transformers").warning("transformers: after the run")
    shown = capfd.readouterr()
    assert "after the run" in shown.out and "transformers: after the run" in shown.err
    assert "after the run" not in log_path.read_text()


def test_verbose_shows_the_libraries_on_the_terminal_too(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], libraries: None
):
    log_path = tmp_path / LOG_FILE_NAME
    with capture_run_output(log_path, verbose=True):
        _run_noisy_libraries()
    shown = capfd.readouterr()
    log = log_path.read_text()
    for line in THIRD_PARTY_LINES:
        assert line in log
        assert line in shown.out + shown.err


def test_a_run_refused_before_it_wrote_anything_leaves_no_folder(tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    log_path = tmp_path / "runs" / "refused" / LOG_FILE_NAME
    with pytest.raises(ConfigError, match="refused"), capture_run_output(log_path, verbose=False):
        raise ConfigError("refused")
    assert not (tmp_path / "runs").exists()
    assert capfd.readouterr().err == ""


def test_a_run_that_fails_before_anything_was_written_keeps_its_log(tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    """The terminal named the log when the run started; a failure (not a refusal) leaves its traceback there."""
    log_path = tmp_path / "runs" / "failed" / LOG_FILE_NAME
    with pytest.raises(RuntimeError), capture_run_output(log_path, verbose=False):
        raise RuntimeError("the engine failed to start")
    assert str(log_path) in capfd.readouterr().err
    log = log_path.read_text()
    assert "Traceback" in log and "RuntimeError: the engine failed to start" in log


def test_a_failed_run_names_its_log(tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    log_path = tmp_path / LOG_FILE_NAME
    with pytest.raises(RuntimeError), capture_run_output(log_path, verbose=False):
        logging.getLogger("fakelib.vllm").error("vllm: engine core died")
        raise RuntimeError("engine failed")
    assert str(log_path) in capfd.readouterr().err
    assert "vllm: engine core died" in log_path.read_text()
