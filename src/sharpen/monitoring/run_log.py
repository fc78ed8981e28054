"""Where a run's output goes: sharpen's own lines (progress, its log records) to the terminal, everything else to
the run's log file, ``run_dir/sharpen.log``.

vLLM, Ray, transformers and torch print from this process and from child processes (vLLM's engine core and workers
inherit file descriptors 1 and 2), through Python logging, ``warnings``, tqdm and C++ code alike; no logging setting
reaches all of them. `capture_run_output` therefore moves the descriptors themselves: for the run's duration 1 and 2
(and ``sys.stdout``/``sys.stderr``) point at the log file, or with ``verbose`` at a pipe that is copied to both the
log and the terminal, and the terminal survives as a duplicate that only sharpen writes to (`terminal`).

Does not decide what a run reports (the sinks do), and configures no library's logging: for the run's duration the
root logger gets one handler (every record at INFO and above, into the log) and the ``sharpen`` logger one more
(its records on the terminal); both are removed afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from sharpen.config import ConfigError

LOG_FILE_NAME = "sharpen.log"
"""The run's log in its run directory: every library's output, sharpen's log records, Python warnings."""

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_TERMINAL_FORMAT = "%(levelname)s %(name)s: %(message)s"


class Terminal:
    """Where sharpen's own output goes: ``stream``, with lines printed above a live progress bar while one is drawn.

    ``is_exclusive`` is True while `capture_run_output` points ``sys.stdout`` and ``sys.stderr`` at the log: other
    writes to them then never reach ``stream``, so a live display need not catch them.
    """

    def __init__(self, stream: TextIO, *, is_exclusive: bool = False) -> None:
        self.stream = stream
        self.is_exclusive = is_exclusive
        self.live_console: Any = None
        """The rich Console of the live display drawn on ``stream``, if any (set by `ProgressDisplay`)."""

    def print_line(self, text: str) -> None:
        if self.live_console is not None:
            self.live_console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=self.stream, flush=True)


_current: Terminal | None = None


def terminal() -> Terminal:
    """The terminal of the running capture, else one on ``sys.stdout`` as it is now."""
    return _current if _current is not None else Terminal(sys.stdout)


class _TerminalHandler(logging.Handler):
    def __init__(self, target: Terminal) -> None:
        super().__init__(logging.INFO)
        self.target = target
        self.setFormatter(logging.Formatter(_TERMINAL_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.target.print_line(self.format(record))
        except Exception:  # a display failure must not end the run; logging reports it on stderr (the log)
            self.handleError(record)


def _duplicate(stream: TextIO) -> TextIO | None:
    """A new stream on a duplicate of ``stream``'s file descriptor (None when it has none, e.g. a test's capture or
    an application's StringIO: moving descriptors does not move such a stream, so it can be used as it is)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both an OSError and a ValueError
        return None
    stream.flush()
    encoding = getattr(stream, "encoding", None) or "utf-8"
    return open(os.dup(fd), "w", buffering=1, encoding=encoding, errors="replace")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class _Tee:
    """Copies what is written into a pipe to the log and the terminal, from a thread (``verbose``)."""

    def __init__(self, log_fd: int, terminal_fd: int) -> None:
        self.read_fd, self.write_fd = os.pipe()
        targets = (os.dup(log_fd), os.dup(terminal_fd))  # its own: it may outlive the capture (below)
        self._thread = threading.Thread(target=self._copy, args=targets, name="sharpen-log-tee", daemon=True)
        self._thread.start()

    def _copy(self, log_fd: int, terminal_fd: int) -> None:
        try:
            while chunk := os.read(self.read_fd, 1 << 16):
                _write_all(log_fd, chunk)
                _write_all(terminal_fd, chunk)
        except OSError:  # the terminal went away (a closed pty): the run goes on, its log is complete so far
            pass
        finally:
            for fd in (self.read_fd, log_fd, terminal_fd):
                os.close(fd)

    def close(self) -> None:
        """Wait for the copy to drain. A child process that still holds the pipe (one that outlived the run)
        keeps it open: the thread is a daemon, so it does not hold up the exit."""
        os.close(self.write_fd)
        self._thread.join(timeout=5.0)


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    return missing


@contextlib.contextmanager
def capture_run_output(
    log_path: Path, *, verbose: bool, is_refusal: Callable[[BaseException], bool] | None = None
) -> Iterator[Terminal]:
    """Send all output but sharpen's own to ``log_path`` (appended) while the block runs; with ``verbose``, to the
    terminal as well. Yields the `Terminal`, which `terminal` returns meanwhile.

    A run that fails writes its traceback to the log, so the log the terminal named is kept. A log that stays empty
    (a run refused before anything started: ``is_refusal(error)``, by default a `ConfigError`, whose one line the
    caller prints) is removed again, with the folders made for it.
    """
    refused = is_refusal or (lambda error: isinstance(error, ConfigError))
    global _current
    created = _missing_dirs(log_path.parent)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    own_stream = _duplicate(sys.stdout)
    target = Terminal(own_stream if own_stream is not None else sys.stdout, is_exclusive=True)
    sys.stderr.flush()
    saved_fds = {fd: os.dup(fd) for fd in (1, 2)}
    saved_streams = sys.stdout, sys.stderr
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    tee = _Tee(log_fd, saved_fds[1]) if verbose else None
    for fd in (1, 2):
        os.dup2(tee.write_fd if tee is not None else log_fd, fd)
    # Handlers that libraries configure meanwhile (vLLM's on "ext://sys.stdout") keep these streams after the run:
    # they are never closed, and write to descriptors 1 and 2 again once those are restored.
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    root, sharpen_logger = logging.getLogger(), logging.getLogger("sharpen")
    root_level, sharpen_level = root.level, sharpen_logger.level
    log_handler = logging.StreamHandler(sys.stderr)
    log_handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    log_handler.setLevel(logging.INFO)
    root.addHandler(log_handler)
    root.setLevel(logging.INFO)
    sharpen_logger.setLevel(logging.INFO)
    terminal_handler = None if verbose else _TerminalHandler(target)  # verbose: the tee shows the log's lines
    if terminal_handler is not None:
        sharpen_logger.addHandler(terminal_handler)
    logging.captureWarnings(True)
    _current = target
    has_failed = False
    try:
        yield target
    except BaseException as error:
        has_failed = True
        if not isinstance(error, KeyboardInterrupt) and not refused(error):  # a refusal is its one line
            traceback.print_exc()  # into the log: a run that failed before anything else wrote there keeps it
        raise
    finally:
        _current = None
        logging.captureWarnings(False)
        if terminal_handler is not None:
            sharpen_logger.removeHandler(terminal_handler)
        root.removeHandler(log_handler)
        root.setLevel(root_level)
        sharpen_logger.setLevel(sharpen_level)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved_streams
        for fd, saved in saved_fds.items():
            os.dup2(saved, fd)
            os.close(saved)
        if tee is not None:
            tee.close()
        os.close(log_fd)
        if own_stream is not None:
            own_stream.close()
        if log_path.stat().st_size == 0:
            log_path.unlink()
            for folder in created:
                with contextlib.suppress(OSError):  # no longer empty: something else wrote there
                    folder.rmdir()
        elif has_failed and not verbose:
            print(f"sharpen: the run's log (libraries' output and warnings): {log_path}", file=sys.stderr)
