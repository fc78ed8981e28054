"""`SandboxSession`: a sandboxed program that the host exchanges messages with while it runs.

Owns the message framing (one line per message, both ways) and the thread that runs the execution's `finish`
while the caller talks to the program. The execution itself is an ordinary cold one (launch.py): the same
sandbox, limits, wall clock, output caps and cleanup, with two differences only: stdin is a pipe the host writes
to, and stdout is read as it arrives. Whatever the program writes on stdout is a message to the host; it cannot
write anywhere the host reads as anything else. Messages are plain bytes here: what they mean, and which of them
to trust, is the caller's business (the code grader's relay, say).
"""

from __future__ import annotations

import os
import queue
import select
import threading
import time

from sharpen.environments.sandbox.launch import Launch
from sharpen.environments.sandbox.result import ExecutionResult


class SandboxSession:
    """Started by `Sandbox.open_session`. ``send`` a line, ``receive`` the next line the program wrote, ``close``
    for the `ExecutionResult`. Used by one thread at a time."""

    def __init__(self, launch: Launch) -> None:
        self._launch = launch
        self._lines: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._partial = bytearray()
        self._result: ExecutionResult | None = None
        self._has_ended = threading.Event()
        launch.on_stdout = self._feed
        # The session owns the write end from now on: the launch's cleanup (in the finish thread) must not close a
        # descriptor that `send` may be writing to.
        self._stdin_fd, launch.stdin_write_fd = launch.stdin_write_fd, None
        if self._stdin_fd is not None:
            os.set_blocking(self._stdin_fd, False)
        self._thread = threading.Thread(target=self._finish, name="sandbox-session", daemon=True)
        self._thread.start()

    @property
    def has_ended(self) -> bool:
        """The program has ended (by itself, killed, or at its wall clock)."""
        return self._has_ended.is_set()

    def _feed(self, chunk: bytes) -> None:
        self._partial += chunk
        *lines, rest = self._partial.split(b"\n")
        for line in lines:
            self._lines.put(bytes(line))
        self._partial = bytearray(rest)

    def _finish(self) -> None:
        try:
            self._result = self._launch.finish()
        finally:
            self._has_ended.set()
            self._lines.put(None)

    def send(self, message: bytes, *, timeout: float) -> bool:
        """Write ``message`` and a newline to the program's stdin; False when it cannot take it within ``timeout``
        seconds (it ended, closed its stdin, or stopped reading)."""
        if b"\n" in message:
            raise ValueError("a session message is one line: it may not contain a newline")
        fd = self._stdin_fd
        if fd is None:
            return False
        data = memoryview(message + b"\n")
        deadline = time.monotonic() + timeout
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        while data:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                return False
            try:
                data = data[os.write(fd, data) :]
            except BlockingIOError:
                continue
            except OSError:  # BrokenPipeError: nobody reads the pipe any more
                return False
        return True

    def receive(self, *, timeout: float) -> bytes | None:
        """The next line the program wrote (without its newline); None when it ended, or when nothing came within
        ``timeout`` seconds."""
        try:
            return self._lines.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def close(self, *, grace_seconds: float | None = None) -> ExecutionResult:
        """Close the program's stdin and wait for its end; after ``grace_seconds`` (None: up to its wall clock)
        it is killed. Returns what happened to it."""
        fd, self._stdin_fd = self._stdin_fd, None
        if fd is not None:
            os.close(fd)
        if grace_seconds is not None and not self._has_ended.wait(grace_seconds):
            self._launch.kill()
        self._thread.join()
        assert self._result is not None
        return self._result
