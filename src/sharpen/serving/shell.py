"""The HTTP shell every served component sits in: routes, a shared-secret token, limits, fair admission, probes.

Owns what all services share: ``Authorization: Bearer <token>`` on every route but the probes (compared in constant
time, checked before a single body byte is read: a caller without it is answered 401 and its connection closed
after at most 64 KiB of its body are read and dropped, so unauthenticated bodies are never held), one unambiguous
body framing (a single ``Content-Length``; see http_guard.py for what is refused), a body size limit (413), a cap on
the items of a route's batch (``max_items_per_request``, 413), bounded connections with deadlines on their headers,
bodies and idle time (http_guard.py), admission of the routes that do work into ``max_running`` slots plus a
bounded queue shared fairly between callers (admission.py; beyond it 503 with Retry-After, never a silent drop),
answers kept by ``Idempotency-Key`` (idempotency.py), ``GET /healthz`` (alive), ``GET /readyz`` (503 when the queue
is full or the component cannot serve) and ``GET /metrics`` (Prometheus text). JSON in, JSON out. Does not know what
a route does: the component's service module gives the routes (the sandbox's, the environment's, the reward
model's). Standard library HTTP only.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any, Self, cast

from sharpen.config.service import ServiceConfig
from sharpen.serving.admission import FairQueue
from sharpen.serving.http_guard import ConnectionGuard, FramingError, GuardedHTTPServer, body_length
from sharpen.serving.idempotency import Answer, IdempotencyTable, KeyConflict

logger = logging.getLogger(__name__)

PROBES = ("/healthz", "/readyz", "/metrics")
CALLER_HEADER = "X-Sharpen-Caller"
"""Names the caller for fair admission (a client process, a run); without it, the peer's address does."""
DRAIN_BYTES = 1 << 16
"""The most of a refused request's body that is read and dropped, unless it was authorized (then up to 4 times the
body limit: its client learns why, e.g. 413, instead of seeing a reset while it still sends)."""


class ServiceError(Exception):
    """Raised by a route to answer ``status`` with ``{"error": message}``."""

    def __init__(self, status: int, message: str, *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


@dataclass(kw_only=True, slots=True)
class Request:
    """What a route gets: the path's ``{}`` segments, in order, and the JSON body (an object; empty for GET)."""

    params: list[str]
    body: dict[str, Any] = field(default_factory=dict[str, Any])


@dataclass(kw_only=True, slots=True, frozen=True)
class Route:
    method: str
    pattern: str
    """The path; a ``{}`` segment matches any one segment (an id) and is passed in ``Request.params``."""
    handler: Callable[[Request], dict[str, Any]]
    is_queued: bool = False
    """Does work: runs in one of ``max_running`` slots, waits in the bounded queue, or is refused with 503."""
    is_idempotent: bool = False
    """Honours Idempotency-Key: a repeated key gets the first answer (waiting for it while it runs)."""
    items: str | None = None
    """The body's field that holds a batch (a list or an object of items): more than ``max_items_per_request``
    items are answered 413 before the request waits for a slot."""

    def match(self, method: str, path: str) -> list[str] | None:
        parts, wanted = path.strip("/").split("/"), self.pattern.strip("/").split("/")
        if method != self.method or len(parts) != len(wanted):
            return None
        if any(w != "{}" and w != p for w, p in zip(wanted, parts, strict=True)):
            return None
        return [p for w, p in zip(wanted, parts, strict=True) if w == "{}"]


def read_token(env_name: str) -> str:
    """The shared-secret token from environment variable ``env_name``; a clear error when it is unset or empty."""
    token = os.environ.get(env_name, "")
    if not token.strip():
        raise ValueError(f"set the shared-secret token in the environment variable {env_name} (it is unset or empty)")
    return token.strip()


class ServiceShell:
    """Serves ``routes``; ``start()`` in background threads (tests), ``serve_forever()`` blocks (the CLI).
    ``is_ready`` tells whether the component can serve now; ``gauges`` adds component gauges to /metrics."""

    def __init__(
        self,
        config: ServiceConfig,
        *,
        routes: Sequence[Route],
        token: str,
        max_running: int,
        host: str = "127.0.0.1",
        port: int = 0,
        is_ready: Callable[[], bool] = lambda: True,
        gauges: Callable[[], Mapping[str, float]] = dict,
    ) -> None:
        if not token:
            raise ValueError("a service needs a non-empty shared-secret token")
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.config = config
        self.routes = list(routes)
        self.max_running = max_running
        self.max_body_bytes = int(config.max_body_mb * (1 << 20))
        self.is_ready, self.gauges = is_ready, gauges
        self.idempotency = IdempotencyTable(ttl_s=config.idempotency_ttl_s, max_keys=config.max_idempotency_keys)
        self.counts = {"requests": 0, "rejected": 0, "unauthorized": 0, "misframed": 0}
        self.admission = FairQueue(max_running=max_running, max_queue_size=config.max_queue_size)
        self.guard = ConnectionGuard(config)
        self._token = token.encode()
        self._stopping = threading.Event()
        self._http = GuardedHTTPServer((host, port), _make_handler(self), guard=self.guard)
        self.url = "http://{}:{}".format(*self._http.server_address[:2])
        self._thread: threading.Thread | None = None

    @property
    def is_stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def queue_depth(self) -> int:
        return self.admission.num_waiting

    def is_authorized(self, header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._token)

    def ready(self) -> bool:
        """Alive, able to serve, and a queued request would be admitted now (not answered 503)."""
        return not self._stopping.is_set() and not self.admission.is_full and self.is_ready()

    def metrics_text(self) -> str:
        values: dict[str, tuple[str, float]] = {
            "sharpen_queue_depth": ("gauge", self.admission.num_waiting),
            "sharpen_requests_running": ("gauge", self.admission.num_running),
            "sharpen_max_running": ("gauge", self.max_running),
            "sharpen_connections_open": ("gauge", self.guard.num_open),
            "sharpen_requests_total": ("counter", self.counts["requests"]),
            "sharpen_requests_rejected_total": ("counter", self.counts["rejected"]),
            "sharpen_requests_unauthorized_total": ("counter", self.counts["unauthorized"]),
            "sharpen_requests_misframed_total": ("counter", self.counts["misframed"]),
            "sharpen_connections_cut_total": ("counter", self.guard.num_cut + self.guard.num_evicted),
            "sharpen_connections_refused_total": ("counter", self.guard.num_refused),
            "sharpen_idempotent_replays_total": ("counter", self.idempotency.num_replayed),
            **{name: ("gauge", value) for name, value in self.gauges().items()},
        }
        lines = []
        for name, (kind, value) in values.items():
            lines += [f"# TYPE {name} {kind}", f"{name} {value:g}"]
        return "\n".join(lines) + "\n"

    def dispatch(self, method: str, path: str, raw: bytes, key: str | None, *, caller: str = "") -> Answer:
        """The answer to an authorized request: routing, idempotency, admission (as ``caller``), the route itself."""
        for route in self.routes:
            params = route.match(method, path)
            if params is not None:
                break
        else:
            return _answer(404, {"error": f"no route {method} {path}"})
        if not (route.is_idempotent and key):
            return self._run(route, params, raw, caller)
        digest = hashlib.sha256(b"%s %s\n%s" % (method.encode(), path.encode(), raw)).hexdigest()
        try:
            earlier = self.idempotency.claim(key, digest, timeout=self.config.idempotency_ttl_s)
        except KeyConflict as error:
            return _answer(409, {"error": str(error)})
        if earlier is not None:
            return earlier
        answer = Answer(status=500, body=b'{"error": "the request failed"}')
        try:
            answer = self._run(route, params, raw, caller)
        finally:
            self.idempotency.finish(key, answer)
        return answer

    def _run(self, route: Route, params: list[str], raw: bytes, caller: str) -> Answer:
        try:
            body = json.loads(raw) if raw else {}
        except (ValueError, UnicodeDecodeError) as error:
            return _answer(400, {"error": f"the body is not JSON: {error}"})
        if not isinstance(body, dict):
            return _answer(400, {"error": "the body must be a JSON object"})
        num_items, limit = _num_items(body.get(route.items)) if route.items else 0, self.config.max_items_per_request
        if num_items > limit:
            return _answer(413, {"error": f"{num_items} {route.items} are over the limit of {limit} per request"})
        if route.is_queued and not self.admission.admit(caller):
            self.counts["rejected"] += 1
            retry = self.config.retry_after_s
            return _answer(503, {"error": "the queue is full; retry on another replica"}, retry_after=retry)
        try:
            return _answer(200, route.handler(Request(params=params, body=body)))
        except ServiceError as error:
            return _answer(error.status, {"error": str(error)}, retry_after=error.retry_after)
        except Exception as error:  # a component fault fails this request, not the server
            logger.exception("%s %s failed", route.method, route.pattern)
            return _answer(500, {"error": f"{type(error).__name__}: {error}"})
        finally:
            if route.is_queued:
                self.admission.release()

    def start(self) -> ServiceShell:
        self.guard.start()
        # A short poll interval makes close() quick (shutdown waits for the serving loop's next poll).
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.05,), daemon=True, name="service")
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve until interrupted (Ctrl-C, SIGTERM raising SystemExit) or closed."""
        self.start()
        try:
            self._stopping.wait()
        finally:
            self.close()

    def close(self) -> None:
        self._stopping.set()
        self.guard.stop()
        if self._thread is not None:
            self._http.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._http.server_close()


def _answer(status: int, payload: Mapping[str, Any], *, retry_after: int | None = None) -> Answer:
    return Answer(status=status, body=json.dumps(payload).encode(), retry_after=retry_after)


def _num_items(batch: object) -> int:
    return len(batch) if isinstance(batch, list | dict) else 0


def _make_handler(shell: ServiceShell) -> type[BaseHTTPRequestHandler]:
    guard = shell.guard

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a client reuses its connection for the next call
        # Headers and body go out in two writes: with Nagle's algorithm the body waits for the client's delayed ACK
        # of the headers (~40 ms per call on a kept-alive connection; a relayed session makes dozens of calls).
        disable_nagle_algorithm = True
        timeout = guard.socket_timeout_s  # each read and write; the guard's deadlines bound the phases in all

        def setup(self) -> None:
            super().setup()
            self.conn = guard.connection(self.request)

        def handle_one_request(self) -> None:
            if self.conn.num_requests and not self._next_request_begins():
                self.close_connection = True
                return
            guard.enter(self.conn, "head")
            try:
                super().handle_one_request()
            except OSError:  # a peer that vanished, or cut by the guard: nothing to answer
                self.close_connection = True
            self.conn.num_requests += 1
            if self.conn.is_cut:
                self.close_connection = True

        def _next_request_begins(self) -> bool:
            """Wait (``idle``) for the first byte of a kept-alive connection's next request; False at its end."""
            guard.enter(self.conn, "idle")
            try:
                return bool(cast(io.BufferedReader, self.rfile).peek(1))
            except OSError:  # timed out or reset
                return False

        def handle_expect_100(self) -> bool:
            if shell.is_authorized(self.headers.get("Authorization")):
                return super().handle_expect_100()
            return True  # no "100 Continue" to a caller without the token: it is refused before its body

        def do_GET(self) -> None:
            if self._head(is_probe=self.path in PROBES) is None:
                return
            guard.enter(self.conn, "busy")
            if self.path == "/healthz":
                return self._send(_answer(200, {"status": "alive"}))
            if self.path == "/readyz":
                is_ready = shell.ready()
                return self._send(_answer(200 if is_ready else 503, {"ready": is_ready}))
            if self.path == "/metrics":
                return self._send(Answer(status=200, body=shell.metrics_text().encode()), content_type="text/plain")
            key = self.headers.get("Idempotency-Key")
            self._send(shell.dispatch("GET", self.path, b"", key, caller=self._caller()))

        def do_POST(self) -> None:
            length = self._head(is_probe=False)
            if length is None:
                return
            guard.enter(self.conn, "body")
            raw = self.rfile.read(length)
            if len(raw) < length or self.conn.is_cut:  # the client left, or was too slow: the request never runs
                self.close_connection = True
                return
            guard.enter(self.conn, "busy")
            key = self.headers.get("Idempotency-Key")
            self._send(shell.dispatch("POST", self.path, raw, key, caller=self._caller()))

        def _head(self, *, is_probe: bool) -> int | None:
            """The body's length when the request goes on; else None, its refusal answered (`_refuse`) before a
            byte of its body was read."""
            shell.counts["requests"] += 1
            if self.conn.is_cut:  # cut by the guard while its head arrived: what was read is not a whole request
                self.close_connection = True
                return None
            length = 0
            try:
                length = body_length(self.headers)
                if self.command == "GET" and length:
                    raise FramingError(400, "a GET request carries no body")
            except FramingError as error:
                shell.counts["misframed"] += 1
                return self._refuse(_answer(error.status, {"error": str(error)}), length=length)
            if is_probe:
                return length
            if shell.is_stopping:  # a kept-alive connection outlives close(): send its client elsewhere
                return self._refuse(
                    _answer(503, {"error": "the service is shutting down"}, retry_after=0), length=length
                )
            if not shell.is_authorized(self.headers.get("Authorization")):
                shell.counts["unauthorized"] += 1
                return self._refuse(_answer(401, {"error": "missing or wrong bearer token"}), length=length)
            if length > shell.max_body_bytes:
                message = f"a body of {length} bytes is over the limit of {shell.max_body_bytes}"
                return self._refuse(_answer(413, {"error": message}), length=length, drain=4 * shell.max_body_bytes)
            return length

        def _refuse(self, answer: Answer, *, length: int, drain: int = DRAIN_BYTES) -> None:
            """Answer, close our side, read and drop at most ``drain`` bytes of the body, then close the connection:
            closing with unread bytes resets it, and a client still writing its body would see a dropped call, not
            the answer that tells it why."""
            self.close_connection = True
            guard.enter(self.conn, "drain")
            self._send(answer)
            with contextlib.suppress(OSError):  # the client reads the answer's end now, while the body drains
                self.connection.shutdown(socket.SHUT_WR)
            self._drain(min(length, drain) if length else drain)

        def _drain(self, limit: int) -> None:
            """Read and drop up to ``limit`` bytes into one small buffer, until the client stops sending or the
            guard's drain deadline."""
            buffer = bytearray(4096)
            with contextlib.suppress(OSError):
                while limit > 0 and not self.conn.is_cut and (n := self.rfile.readinto1(buffer)):
                    limit -= n

        def _caller(self) -> str:
            return self.headers.get(CALLER_HEADER, "")[:128] or str(self.client_address[0])

        def _send(self, answer: Answer, *, content_type: str = "application/json") -> None:
            try:
                self.send_response(answer.status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(answer.body)))
                if answer.retry_after is not None:
                    self.send_header("Retry-After", str(answer.retry_after))
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(answer.body)
            except OSError:  # the client gave up (its timeout) or does not read: drop the connection
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("%s " + format, self.address_string(), *args)

    return Handler


class ServedComponent:
    """The life cycle every service shares: its background threads (``_threads``) start with its ``shell``, and
    ``close`` (the service's own) runs when serving ends. Subclasses set ``shell`` and ``_threads`` and define
    ``close``."""

    shell: ServiceShell
    _threads: list[threading.Thread]

    def start(self) -> Self:
        """Serve in background threads (tests, fleets' actors)."""
        for thread in self._threads:
            thread.start()
        self.shell.start()
        return self

    def serve_forever(self) -> None:
        """Serve until interrupted (the CLI), then close."""
        for thread in self._threads:
            thread.start()
        try:
            self.shell.serve_forever()
        finally:
            self.close()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
