"""Reading a running execution's stdout and stderr with caps, a deadline and the ready marker.

Owns the one event loop that both cold executions and warm-worker jobs use: poll the two pipes and an "exit"
descriptor (a pidfd, or a warm worker's control socket), keep at most ``max_bytes`` of each stream, and call back
when the wall clock runs out, when a stream overflows, and when the program has exited. It kills nothing itself:
the callbacks know how (a cgroup, a message to the worker).
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_CHUNK = 1 << 16
DRAIN_SECONDS = 2.0
"""After the program ended (or was killed), how long the pipes may take to reach end-of-file."""


@dataclass(kw_only=True, slots=True)
class StreamCapture:
    """One stream: the first ``max_bytes`` after an optional marker that must open it."""

    max_bytes: int
    marker: bytes = b""
    tap: Callable[[bytes], None] | None = None
    """Called with every piece of the stream that is kept, as it arrives (a session reads its messages so)."""
    data: bytearray = field(default_factory=bytearray)
    is_truncated: bool = False
    is_marker_broken: bool = False
    _marker_left: bytes = b""

    def __post_init__(self) -> None:
        self._marker_left = self.marker

    @property
    def is_marker_seen(self) -> bool:
        return not self._marker_left and not self.is_marker_broken

    def feed(self, chunk: bytes) -> bool:
        """Take a chunk; True when this chunk made the stream pass its cap."""
        if self._marker_left:
            head = chunk[: len(self._marker_left)]
            if not self._marker_left.startswith(head):
                self.is_marker_broken = True
                self._marker_left = b""
                return False
            self._marker_left = self._marker_left[len(head) :]
            chunk = chunk[len(head) :]
        if self.is_truncated:
            return False
        room = self.max_bytes - len(self.data)
        self.data += chunk[:room]
        if self.tap is not None and chunk[:room]:
            self.tap(chunk[:room])
        if len(chunk) > room:
            self.is_truncated = True
            return True
        return False


@dataclass(kw_only=True, slots=True)
class Captured:
    stdout: StreamCapture
    stderr: StreamCapture
    is_timed_out: bool = False
    is_output_overflow: bool = False
    is_stuck: bool = False
    """The pipes stayed open after the program ended: a process outlived the execution."""


def collect(
    *,
    stdout_fd: int,
    stderr_fd: int,
    exit_fd: int,
    deadline: float,
    max_bytes: int,
    marker: bytes,
    on_exit: Callable[[], None],
    on_deadline: Callable[[], None],
    on_overflow: Callable[[], None],
    on_stdout: Callable[[bytes], None] | None = None,
) -> Captured:
    """Run until both pipes reach end-of-file and ``exit_fd`` became readable (``on_exit`` was called), or until
    the drain after an exit or a kill runs out. ``deadline`` is on the time.monotonic clock. ``on_stdout`` sees
    stdout's kept bytes as they arrive (after the marker)."""
    captured = Captured(
        stdout=StreamCapture(max_bytes=max_bytes, marker=marker, tap=on_stdout),
        stderr=StreamCapture(max_bytes=max_bytes),
    )
    streams = {stdout_fd: captured.stdout, stderr_fd: captured.stderr}
    poller = select.poll()
    for fd in (stdout_fd, stderr_fd, exit_fd):
        poller.register(fd, select.POLLIN)
    has_exited = False
    drain_until: float | None = None
    while streams or not has_exited:
        now = time.monotonic()
        if drain_until is not None and now >= drain_until:
            captured.is_stuck = True
            break
        if drain_until is None and now >= deadline:
            captured.is_timed_out = True
            on_deadline()
            drain_until = now + DRAIN_SECONDS
            continue
        wait_until = drain_until if drain_until is not None else deadline
        for fd, _ in poller.poll(max(0.0, wait_until - now) * 1000 + 1):
            if fd == exit_fd:
                poller.unregister(fd)
                has_exited = True
                on_exit()
                drain_until = drain_until or time.monotonic() + DRAIN_SECONDS
                continue
            chunk = os.read(fd, _CHUNK)
            if not chunk:
                poller.unregister(fd)
                del streams[fd]
            elif streams[fd].feed(chunk) and not captured.is_output_overflow:
                captured.is_output_overflow = True
                on_overflow()
                drain_until = drain_until or time.monotonic() + DRAIN_SECONDS
    return captured
