"""`SandboxService`: a `SandboxPool` served over HTTP (`sharpen serve-sandbox`), one-shot runs and sessions.

Owns the routes (JSON, see wire.py for the encodings) and the table of open sessions:

- ``POST /v1/run`` ``{"argv": [...] | "code": "...", "files": {...}, "stdin": {...}}`` -> an `ExecutionResult`;
  queued (at most ``sandbox.max_concurrency`` run at once, ``service.max_queue_size`` wait, then 503), and
  idempotent: a repeated Idempotency-Key gets the first execution's result. A program the sandbox did not start
  (``sandbox_error``, never the program's doing) is answered 503 too, so that the client runs it on another
  replica; after a few in a row /readyz says not ready until a trivial program starts again.
- ``POST /v1/sessions`` (same body, no stdin) -> ``{"session_id", "replica_url"?}``: `Sandbox.open_session` on this
  replica; ``replica_url`` (when the server was given its own address, ``advertise_url``) is where the session's
  calls must go, so that a client that reached it through a Kubernetes Service keeps talking to this pod;
  ``POST /v1/sessions/{id}/send`` ``{"line", "timeout"}`` -> ``{"ok"}``; ``POST /v1/sessions/{id}/receive``
  ``{"timeout"}`` -> ``{"line"}`` (a long poll of at most 20 s; null: ended or nothing yet); ``POST
  /v1/sessions/{id}/close`` ``{"grace_seconds"}`` -> the `ExecutionResult`. A session no request touched for
  ``service.idle_seconds`` is killed and forgotten (404 afterwards).
- ``GET /v1/info`` -> the pool's `IsolationReport`; plus the shell's probes (/healthz, /readyz, /metrics).

Does not know its clients (remote.py) nor decide anything about a result: it returns what the pool returned.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox.pool import SandboxPool
from sharpen.environments.sandbox.probe import PROBE_ARGV
from sharpen.environments.sandbox.result import ExecutionResult
from sharpen.environments.sandbox.session import SandboxSession
from sharpen.environments.sandbox.wire import (
    WireError,
    decode_data,
    decode_files,
    decode_line,
    encode_line,
    encode_report,
    encode_result,
)
from sharpen.serving.shell import Request, Route, ServedComponent, ServiceError, ServiceShell

MAX_POLL_S = 20.0
"""The longest a receive waits on the server; the client asks again for longer waits."""
MAX_FAILING = 3
"""Executions in a row that the sandbox did not start before the replica reports itself not ready."""


@dataclass(kw_only=True, slots=True)
class _OpenSession:
    session: SandboxSession
    last_used: float = field(default_factory=time.monotonic)
    num_busy: int = 0


class SandboxService(ServedComponent):
    """Serves ``pool`` (built from ``config`` by the caller, which closes it) behind a `ServiceShell`.
    ``advertise_url``: this replica's own address, given with every session it opens (None: none)."""

    def __init__(
        self,
        config: SandboxConfig,
        *,
        pool: SandboxPool,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_url: str | None = None,
    ):
        if config.backend == "remote":
            raise ValueError(
                "serve-sandbox runs a local sandbox: set sandbox.backend to auto, bwrap, unshare or process"
            )
        self.config = config
        self.pool = pool
        self.num_executions = 0
        self._num_failing = 0
        self._sessions: dict[str, _OpenSession] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._threads = [
            threading.Thread(target=self._loop.run_forever, daemon=True, name="sandbox-service-loop"),
            threading.Thread(target=self._expire_sessions, daemon=True, name="sandbox-service-expiry"),
        ]
        routes = [
            Route(method="GET", pattern="/v1/info", handler=lambda _: encode_report(self.pool.report)),
            Route(method="POST", pattern="/v1/run", handler=self._run, is_queued=True, is_idempotent=True),
            Route(method="POST", pattern="/v1/sessions", handler=self._open, is_queued=True, is_idempotent=True),
            Route(method="POST", pattern="/v1/sessions/{}/send", handler=self._send),
            Route(method="POST", pattern="/v1/sessions/{}/receive", handler=self._receive),
            Route(method="POST", pattern="/v1/sessions/{}/close", handler=self._close, is_idempotent=True),
        ]
        self.shell = ServiceShell(
            config.service,
            routes=routes,
            token=token,
            max_running=config.max_concurrency,
            host=host,
            port=port,
            is_ready=self._is_ready,
            gauges=lambda: {"sharpen_open_sessions": len(self._sessions), "sharpen_executions": self.num_executions},
        )
        self.url = self.shell.url
        self.advertise_url = advertise_url

    def close(self) -> None:
        """Stop serving and kill the open sessions; the pool is the caller's to close."""
        self._stopping.set()
        self.shell.close()
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for open_session in sessions:
            open_session.session.close(grace_seconds=0.0)
        self._loop.call_soon_threadsafe(self._loop.stop)

    def _program(self, body: Mapping[str, Any]) -> tuple[list[str] | None, str | None, dict[str, str | bytes]]:
        try:
            files = decode_files(body.get("files", {}))
        except WireError as error:
            raise ServiceError(400, str(error)) from None
        argv, code = body.get("argv"), body.get("code")
        if (argv is None) == (code is None):
            raise ServiceError(400, 'give exactly one of "argv" (a list of strings) and "code" (a string)')
        if argv is not None and not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise ServiceError(400, '"argv" must be a non-empty list of strings')
        if code is not None and not isinstance(code, str):
            raise ServiceError(400, '"code" must be a string')
        return argv, code, files  # pyright: ignore[reportUnknownVariableType]

    def _run(self, request: Request) -> dict[str, Any]:
        argv, code, files = self._program(request.body)
        try:
            stdin = decode_data(request.body.get("stdin", {"text": ""}), where="stdin")
        except WireError as error:
            raise ServiceError(400, str(error)) from None
        try:
            if code is not None:
                job = self.pool.run_python(code, files=files, stdin=stdin)
            else:
                job = self.pool.run(argv or [], files=files, stdin=stdin)
            result = asyncio.run_coroutine_threadsafe(job, self._loop).result()
        except ValueError as error:  # a file name the sandbox refuses, files holding main.py
            raise ServiceError(400, str(error)) from None
        self._note(result)
        if not result.is_program_started:  # nothing ran, through no fault of the program: another replica may run it
            raise ServiceError(503, f"this replica's sandbox did not start the program: {result.detail}", retry_after=0)
        return encode_result(result)

    def _note(self, result: ExecutionResult) -> None:
        with self._lock:
            self.num_executions += 1
            self._num_failing = 0 if result.is_program_started else self._num_failing + 1

    def _is_ready(self) -> bool:
        """Not stopping, and the sandbox starts programs: after `MAX_FAILING` executions in a row that it did not
        start, each readiness check runs a trivial program until one starts again."""
        if self._stopping.is_set():
            return False
        if self._num_failing >= MAX_FAILING:
            self._note(self.pool.sandbox.run(PROBE_ARGV))
        return self._num_failing < MAX_FAILING

    def _open(self, request: Request) -> dict[str, Any]:
        argv, code, files = self._program(request.body)
        if len(self._sessions) >= self.config.service.max_open:
            raise ServiceError(
                503, "too many open sessions on this replica", retry_after=self.config.service.retry_after_s
            )
        sandbox = self.pool.sandbox
        try:
            if code is not None:
                session = sandbox.open_python_session(code, files=files)
            else:
                session = sandbox.open_session(argv or [], files=files)
        except ValueError as error:
            raise ServiceError(400, str(error)) from None
        session_id = uuid.uuid4().hex
        with self._lock:
            self._sessions[session_id] = _OpenSession(session=session)
        if self.advertise_url:
            return {"session_id": session_id, "replica_url": self.advertise_url}
        return {"session_id": session_id}

    def _use(self, session_id: str, *, is_closing: bool = False) -> _OpenSession:
        with self._lock:
            open_session = self._sessions.pop(session_id) if is_closing else self._sessions.get(session_id)
            if open_session is None:
                raise ServiceError(404, f"no open session {session_id} (closed, expired, or never opened here)")
            open_session.num_busy += 1
            open_session.last_used = time.monotonic()
            return open_session

    def _done(self, open_session: _OpenSession) -> None:
        with self._lock:
            open_session.num_busy -= 1
            open_session.last_used = time.monotonic()

    def _send(self, request: Request) -> dict[str, Any]:
        timeout = _seconds(request.body, "timeout", default=MAX_POLL_S)
        try:
            line = decode_line(request.body.get("line"))
        except (WireError, ValueError) as error:
            raise ServiceError(400, f"line: {error}") from None
        if line is None:
            raise ServiceError(400, '"line" is required')
        open_session = self._use(request.params[0])
        try:
            return {"ok": open_session.session.send(line, timeout=min(timeout, MAX_POLL_S))}
        except ValueError as error:  # a newline in the message
            raise ServiceError(400, str(error)) from None
        finally:
            self._done(open_session)

    def _receive(self, request: Request) -> dict[str, Any]:
        timeout = min(_seconds(request.body, "timeout", default=MAX_POLL_S), MAX_POLL_S)
        open_session = self._use(request.params[0])
        try:
            line = open_session.session.receive(timeout=timeout)
            return {"line": encode_line(line), "has_ended": line is None and open_session.session.has_ended}
        finally:
            self._done(open_session)

    def _close(self, request: Request) -> dict[str, Any]:
        grace = request.body.get("grace_seconds")
        if grace is not None and not isinstance(grace, int | float):
            raise ServiceError(400, '"grace_seconds" must be a number or null')
        open_session = self._use(request.params[0], is_closing=True)
        result = open_session.session.close(grace_seconds=None if grace is None else float(grace))
        self._note(result)
        return encode_result(result)

    def _expire_sessions(self) -> None:
        idle = self.config.service.idle_seconds
        while not self._stopping.wait(min(1.0, idle / 4)):
            now = time.monotonic()
            with self._lock:
                expired = [k for k, s in self._sessions.items() if not s.num_busy and now - s.last_used > idle]
                sessions = [self._sessions.pop(k) for k in expired]
            for open_session in sessions:
                open_session.session.close(grace_seconds=0.0)


def _seconds(body: Mapping[str, Any], name: str, *, default: float) -> float:
    value = body.get(name, default)
    if not isinstance(value, int | float) or value < 0:
        raise ServiceError(400, f'"{name}" must be a number of seconds >= 0')
    return float(value)
