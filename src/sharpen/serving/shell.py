"""The HTTP shell every served component sits in: routes, a shared-secret token, limits, a bounded queue, probes.

Owns what all services share: ``Authorization: Bearer <token>`` on every route but the probes (compared in constant
time), a body size limit (413), admission of the routes that do work into ``max_running`` slots plus a bounded
queue (beyond it 503 with Retry-After, never a silent drop), answers kept by ``Idempotency-Key`` (idempotency.py),
``GET /healthz`` (alive), ``GET /readyz`` (503 when the queue is full or the component cannot serve) and
``GET /metrics`` (Prometheus text). The token is checked before a request's body is read. JSON in, JSON out. Does not
know what a route does: the component's service module gives the routes (the sandbox's, the environment's, the
reward model's). Standard library HTTP only.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from sharpen.config.service import ServiceConfig
from sharpen.serving.idempotency import Answer, IdempotencyTable, KeyConflict

logger = logging.getLogger(__name__)

PROBES = ("/healthz", "/readyz", "/metrics")


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
        self.counts = {"requests": 0, "rejected": 0, "unauthorized": 0}
        self._token = token.encode()
        self._num_running = self._num_waiting = 0
        self._slots = threading.Condition()
        self._stopping = threading.Event()
        self._http = _HTTPServer((host, port), _make_handler(self))
        self.url = "http://{}:{}".format(*self._http.server_address[:2])
        self._thread: threading.Thread | None = None

    @property
    def is_stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def queue_depth(self) -> int:
        return self._num_waiting

    def is_authorized(self, header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._token)

    def admit(self) -> bool:
        """Take a running slot, waiting in the queue when there is room; False when the queue is full."""
        with self._slots:
            if self._num_running >= self.max_running:
                if self._num_waiting >= self.config.max_queue_size:
                    self.counts["rejected"] += 1
                    return False
                self._num_waiting += 1
                while self._num_running >= self.max_running:
                    self._slots.wait()
                self._num_waiting -= 1
            self._num_running += 1
            return True

    def release(self) -> None:
        with self._slots:
            self._num_running -= 1
            self._slots.notify()

    def ready(self) -> bool:
        """Alive, able to serve, and a queued request would be admitted now (not answered 503)."""
        is_full = self._num_running >= self.max_running and self._num_waiting >= self.config.max_queue_size
        return not self._stopping.is_set() and not is_full and self.is_ready()

    def metrics_text(self) -> str:
        values: dict[str, tuple[str, float]] = {
            "sharpen_queue_depth": ("gauge", self._num_waiting),
            "sharpen_requests_running": ("gauge", self._num_running),
            "sharpen_max_running": ("gauge", self.max_running),
            "sharpen_requests_total": ("counter", self.counts["requests"]),
            "sharpen_requests_rejected_total": ("counter", self.counts["rejected"]),
            "sharpen_requests_unauthorized_total": ("counter", self.counts["unauthorized"]),
            "sharpen_idempotent_replays_total": ("counter", self.idempotency.num_replayed),
            **{name: ("gauge", value) for name, value in self.gauges().items()},
        }
        lines = []
        for name, (kind, value) in values.items():
            lines += [f"# TYPE {name} {kind}", f"{name} {value:g}"]
        return "\n".join(lines) + "\n"

    def dispatch(self, method: str, path: str, raw: bytes, key: str | None) -> Answer:
        """The answer to an authorized request: routing, idempotency, admission, the route itself."""
        for route in self.routes:
            params = route.match(method, path)
            if params is not None:
                break
        else:
            return _answer(404, {"error": f"no route {method} {path}"})
        if not (route.is_idempotent and key):
            return self._run(route, params, raw)
        digest = hashlib.sha256(b"%s %s\n%s" % (method.encode(), path.encode(), raw)).hexdigest()
        try:
            earlier = self.idempotency.claim(key, digest, timeout=self.config.idempotency_ttl_s)
        except KeyConflict as error:
            return _answer(409, {"error": str(error)})
        if earlier is not None:
            return earlier
        answer = Answer(status=500, body=b'{"error": "the request failed"}')
        try:
            answer = self._run(route, params, raw)
        finally:
            self.idempotency.finish(key, answer)
        return answer

    def _run(self, route: Route, params: list[str], raw: bytes) -> Answer:
        try:
            body = json.loads(raw) if raw else {}
        except (ValueError, UnicodeDecodeError) as error:
            return _answer(400, {"error": f"the body is not JSON: {error}"})
        if not isinstance(body, dict):
            return _answer(400, {"error": "the body must be a JSON object"})
        if route.is_queued and not self.admit():
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
                self.release()

    def start(self) -> ServiceShell:
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
        if self._thread is not None:
            self._http.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._http.server_close()


def _answer(status: int, payload: Mapping[str, Any], *, retry_after: int | None = None) -> Answer:
    return Answer(status=status, body=json.dumps(payload).encode(), retry_after=retry_after)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # The default listen backlog of 5 drops connections under a burst of clients; they then wait out a 1 s SYN
    # retransmit (a 1.3 s p99 in benchmarks/rm_server.py).
    request_queue_size = 1024


def _make_handler(shell: ServiceShell) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a client reuses its connection for the next call
        # Headers and body go out in two writes: with Nagle's algorithm the body waits for the client's delayed ACK
        # of the headers (~40 ms per call on a kept-alive connection; a relayed session makes dozens of calls).
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            if self.path == "/healthz":
                return self._send(_answer(200, {"status": "alive"}))
            if self.path == "/readyz":
                is_ready = shell.ready()
                return self._send(_answer(200 if is_ready else 503, {"ready": is_ready}))
            if self.path == "/metrics":
                return self._send(Answer(status=200, body=shell.metrics_text().encode()), content_type="text/plain")
            refusal = self._refusal()
            self._send(refusal or shell.dispatch("GET", self.path, b"", self.headers.get("Idempotency-Key")))

        def do_POST(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            # Refused before the body is read: a caller without the token cannot make the server hold its body.
            refusal = self._refusal()
            if refusal is None and (length < 0 or length > shell.max_body_bytes):
                message = f"a body of {length} bytes is over the limit of {shell.max_body_bytes} (or unreadable)"
                refusal = _answer(413, {"error": message})
            if refusal is None:
                raw = self.rfile.read(length)
                return self._send(shell.dispatch("POST", self.path, raw, self.headers.get("Idempotency-Key")))
            self.close_connection = True
            self._send(refusal)
            # Then read what was sent (up to a bound) and drop it: closing with unread bytes resets the connection,
            # and a client still writing its body would see a dropped call, not the answer that tells it why.
            remaining = min(max(length, 0), 4 * shell.max_body_bytes)
            with contextlib.suppress(OSError):
                while remaining > 0 and (chunk := self.rfile.read(min(remaining, 1 << 16))):
                    remaining -= len(chunk)

        def _refusal(self) -> Answer | None:
            """The answer to a request the shell refuses before it reads the body: shutting down, or no token."""
            shell.counts["requests"] += 1
            if shell.is_stopping:  # a kept-alive connection outlives close(): send its client elsewhere
                self.close_connection = True
                return _answer(503, {"error": "the service is shutting down"}, retry_after=0)
            if not shell.is_authorized(self.headers.get("Authorization")):
                shell.counts["unauthorized"] += 1
                return _answer(401, {"error": "missing or wrong bearer token"})
            return None

        def _send(self, answer: Answer, *, content_type: str = "application/json") -> None:
            self.send_response(answer.status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(answer.body)))
            if answer.retry_after is not None:
                self.send_header("Retry-After", str(answer.retry_after))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                self.wfile.write(answer.body)

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
