"""What keeps hostile connections from holding the service shell: unambiguous body framing, a bound on open
connections, and deadlines on every phase of a connection.

Owns:

- `body_length`: the one framing the shell accepts is a single ``Content-Length`` of ASCII digits (or none: no body).
  A ``Transfer-Encoding`` of any kind is refused (411 alone, 400 with a ``Content-Length`` too: the two framings
  disagree, which is how requests are smuggled past a proxy); several ``Content-Length`` headers, a negative one or
  one that is not plain digits (``+5``, ``1_0``, ``5, 5``, which Python's ``int`` would take) are refused with 400.
  The shell closes the connection after any of them: the rest of the stream cannot be trusted to start a request.
- `ConnectionGuard`: every connection is in one phase, each with a deadline on its whole duration (not per read, so
  a client that trickles a byte at a time is cut off too): ``head`` until its request's line and headers arrived
  (``header_timeout_s``), ``body`` while an authorized body arrives (``read_timeout_s``), ``drain`` while a refused
  request's body is read and dropped (at most ``DRAIN_S``), ``idle`` between kept-alive requests
  (``idle_timeout_s``) and ``busy`` while a route runs (no deadline: the route's own limits apply). A watchdog thread
  cuts a connection past its deadline (``shutdown``, which wakes the thread blocked reading it). At most
  ``max_connections`` are open: one more evicts the oldest in ``head`` or ``drain`` (none of them has shown a
  token), else the oldest ``idle`` one; when all are ``body`` or ``busy`` the newcomer is refused (the server
  answers it 503 without a thread). So a flood of half-sent requests holds at most ``max_connections`` threads, for
  at most its deadline each, and never keeps out a caller that sends a whole request.
- `GuardedHTTPServer`: the stdlib threading server, one thread per connection the guard admits, started without
  waiting for it to run (so a flood does not slow the accept loop that a normal call waits behind).

Does not parse HTTP beyond the framing headers nor check tokens (shell.py does, before any body byte is read).
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sharpen.config.service import ServiceConfig

logger = logging.getLogger(__name__)

DRAIN_S = 2.0
"""Longest time a refused request's body is read and dropped (so that its client reads the answer, not a reset)."""
_EVICTION_RANK = {"head": 0, "drain": 0, "idle": 1}
"""Phases a newcomer may evict, lowest first; ``body`` and ``busy`` connections are working for an authorized call."""


class FramingError(ValueError):
    """A request whose body cannot be delimited unambiguously; answered ``status`` and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def body_length(headers: Message) -> int:
    """The body's length by its one ``Content-Length`` (0 without one); `FramingError` for any other framing."""
    if headers.get_all("Transfer-Encoding"):
        if headers.get_all("Content-Length"):
            raise FramingError(400, "both Transfer-Encoding and Content-Length: the body's framing is ambiguous")
        raise FramingError(411, "Transfer-Encoding is not accepted: send the body with one Content-Length")
    values = headers.get_all("Content-Length") or []
    if not values:
        return 0
    if len(values) > 1:
        raise FramingError(400, f"{len(values)} Content-Length headers: send exactly one")
    value = values[0].strip()
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise FramingError(400, f"Content-Length {value[:40]!r} is not a length (plain digits)")
    return int(value)


@dataclass(kw_only=True, slots=True, eq=False)
class Connection:
    """One open connection: its socket, phase, when the phase began and when the guard cuts it."""

    sock: socket.socket
    phase: str = "head"
    since: float = 0.0
    deadline: float | None = None
    num_requests: int = 0
    is_cut: bool = False
    """Cut by the guard (deadline passed, or evicted): what its thread read since is not a whole request."""


class ConnectionGuard:
    """Open connections, their phases and deadlines (see the module doc); ``start`` runs the watchdog."""

    def __init__(self, config: ServiceConfig) -> None:
        self.max_connections = config.max_connections
        self._timeouts = {
            "head": config.header_timeout_s,
            "body": config.read_timeout_s,
            "drain": min(DRAIN_S, config.read_timeout_s),
            "idle": config.idle_timeout_s,
        }
        self.socket_timeout_s = max(self._timeouts.values())
        """Each read or write on a connection: a backstop under the deadlines, for a phase without one."""
        self.num_cut = self.num_evicted = self.num_refused = 0
        self._open: dict[socket.socket, Connection] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._tick_s = min(0.25, max(0.01, min(self._timeouts.values()) / 4))
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="service-connection-guard")

    @property
    def num_open(self) -> int:
        """Connections open and not cut (cut ones are closing: their threads end at once)."""
        with self._lock:
            return sum(not c.is_cut for c in self._open.values())

    def open(self, sock: socket.socket) -> Connection | None:
        """Register a new connection (``head``), evicting one when full; None when it must be refused."""
        with self._lock:
            live = [c for c in self._open.values() if not c.is_cut]
            if len(live) >= self.max_connections:
                evictable = [c for c in live if c.phase in _EVICTION_RANK]
                if not evictable:
                    self.num_refused += 1
                    return None
                self._cut(min(evictable, key=lambda c: (_EVICTION_RANK[c.phase], c.since)))
                self.num_evicted += 1
            connection = Connection(sock=sock)
            self._open[sock] = connection
            self._enter(connection, "head")
            return connection

    def connection(self, sock: socket.socket) -> Connection:
        with self._lock:
            return self._open[sock]

    def enter(self, connection: Connection, phase: str) -> None:
        """Move ``connection`` to ``phase``; its deadline starts now."""
        with self._lock:
            self._enter(connection, phase)

    def close(self, sock: socket.socket) -> None:
        """Forget a connection before its socket is closed (so the watchdog never touches a reused descriptor)."""
        with self._lock:
            self._open.pop(sock, None)

    def expire(self, now: float | None = None) -> int:
        """Cut every connection past its deadline; how many were cut."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [c for c in self._open.values() if not c.is_cut and c.deadline is not None and c.deadline <= now]
            for connection in late:
                self._cut(connection)
            self.num_cut += len(late)
            return len(late)

    def start(self) -> None:
        self._watchdog.start()

    def stop(self) -> None:
        self._stopping.set()

    def _enter(self, connection: Connection, phase: str) -> None:
        connection.phase, connection.since = phase, time.monotonic()
        timeout = self._timeouts.get(phase)
        connection.deadline = None if timeout is None else connection.since + timeout

    def _cut(self, connection: Connection) -> None:
        connection.is_cut = True
        with contextlib.suppress(OSError):  # already closed by its peer
            connection.sock.shutdown(socket.SHUT_RDWR)

    def _watch(self) -> None:
        while not self._stopping.wait(self._tick_s):
            self.expire()


class GuardedHTTPServer(ThreadingHTTPServer):
    """One thread per connection the guard admits; one it refuses is answered 503 and closed without a thread."""

    daemon_threads = True
    # The default listen backlog of 5 drops connections under a burst of clients; they then wait out a 1 s SYN
    # retransmit (a 1.3 s p99 in benchmarks/rm_server.py).
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *, guard: ConnectionGuard):
        self.guard = guard
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if self.guard.open(request) is None:  # every connection is working for an authorized call
            with contextlib.suppress(OSError):
                request.setblocking(False)  # never wait on a client that does not read
                request.send(_FULL)
            self.shutdown_request(request)
            return
        # Not threading.Thread: its start() waits until the new thread runs, one GIL hand-off per connection, which
        # under a flood of connections delays every later accept (a normal call behind 200 waited over a second).
        _thread.start_new_thread(self.process_request_thread, (request, client_address))

    def shutdown_request(self, request: Any) -> None:
        self.guard.close(request)  # first: the watchdog never shuts a descriptor that a new connection reuses
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.exception("a connection from %s failed", client_address)


_FULL_BODY = b'{"error": "too many connections; retry on another replica"}'
_FULL = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(
    _FULL_BODY
) + (b"Retry-After: 1\r\nConnection: close\r\n\r\n" + _FULL_BODY)
