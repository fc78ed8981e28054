"""The sandbox's client backend (``sandbox.backend = "remote"``): `RemoteSandbox`, `RemoteSandboxPool` and
`RemoteSandboxSession`, the same calls and results as `Sandbox`, `SandboxPool` and `SandboxSession`, executed by
`sharpen serve-sandbox` replicas (service.py).

Owns mapping the sandbox protocol onto the service's routes and turning faults of the service into what the
callers already handle. An execution is spread over the replicas and retried elsewhere under the same
Idempotency-Key when a replica is full or dies (its program dies with it, and sandboxed code has no effect outside
its sandbox, so running it again there is safe; a live replica never runs one key twice). When no replica can run
it, the result is ``sandbox_error`` with ``is_program_started`` False: the program's fault it is not, so the
episode or the grading abstains. A session lives on one replica, and its calls go there by the address the
replica advertised when it opened the session (so a Kubernetes Service in front of several replicas opens sessions
but never moves one); when that replica is lost mid-session, ``send`` fails, ``receive`` ends and ``close`` returns
such a ``sandbox_error`` (the program may have run, but its end was the infrastructure's, so the policy is not
judged by it). Does not start replicas or pick the isolation.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox.execution import check_file_names
from sharpen.environments.sandbox.result import ExecutionResult, ExecutionStatus, IsolationReport
from sharpen.environments.sandbox.sandbox import NO_FILES
from sharpen.environments.sandbox.service import MAX_POLL_S
from sharpen.environments.sandbox.wire import (
    decode_line,
    decode_report,
    decode_result,
    encode_data,
    encode_files,
    encode_line,
)
from sharpen.serving.replicas import ReplicaClient, ServiceRequestError, ServiceUnavailable, new_key

_SLACK_S = 10.0
"""HTTP time allowed beyond a long poll's own wait."""


def _lost(backend: str, detail: str) -> ExecutionResult:
    return ExecutionResult(
        status=ExecutionStatus.SANDBOX_ERROR,
        exit_code=None,
        stdout="",
        stderr="",
        wall_seconds=0.0,
        is_output_truncated=False,
        backend=backend,
        detail=detail,
    )


class RemoteSandbox:
    """`Sandbox`'s calls (``run``, ``run_python``, ``open_session``, ``open_python_session``) on the replicas of
    ``config.remote``. Asks a replica for its ``report`` at construction: a wrong token or no live replica fails
    here, before anything runs. Thread-safe."""

    def __init__(self, config: SandboxConfig) -> None:
        if config.backend != "remote":
            raise ValueError(f'RemoteSandbox needs sandbox.backend = "remote", got {config.backend!r}')
        self.config = config
        self.client = ReplicaClient(config.remote, what="sandbox")
        try:
            self.report: IsolationReport = decode_report(self.client.call("GET", "/v1/info")[1])
        except BaseException:
            self.client.close()
            raise

    def run(
        self, argv: Sequence[str], *, files: Mapping[str, str | bytes] = NO_FILES, stdin: str | bytes = ""
    ) -> ExecutionResult:
        if not argv:
            raise ValueError("argv is empty: give the program to run")
        return self._execute({"argv": list(argv)}, files, stdin)

    def run_python(
        self, code: str, *, files: Mapping[str, str | bytes] = NO_FILES, stdin: str | bytes = ""
    ) -> ExecutionResult:
        if "main.py" in files:
            raise ValueError("files may not contain 'main.py': run_python writes the code there")
        return self._execute({"code": code}, files, stdin)

    def _execute(
        self, program: dict[str, Any], files: Mapping[str, str | bytes], stdin: str | bytes
    ) -> ExecutionResult:
        check_file_names(files)
        payload = {**program, "files": encode_files(files), "stdin": encode_data(stdin)}
        try:
            _, answer = self.client.call("POST", "/v1/run", payload, key=new_key())
        except ServiceUnavailable as error:
            return _lost(self.report.backend, f"no sandbox replica ran the program: {error}")
        except ServiceRequestError as error:
            raise ValueError(str(error)) from None
        return decode_result(answer)

    def open_session(self, argv: Sequence[str], *, files: Mapping[str, str | bytes] = NO_FILES) -> RemoteSandboxSession:
        if not argv:
            raise ValueError("argv is empty: give the program to run")
        return self._open({"argv": list(argv)}, files)

    def open_python_session(self, code: str, *, files: Mapping[str, str | bytes] = NO_FILES) -> RemoteSandboxSession:
        if "main.py" in files:
            raise ValueError("files may not contain 'main.py': open_python_session writes the code there")
        return self._open({"code": code}, files)

    def _open(self, program: dict[str, Any], files: Mapping[str, str | bytes]) -> RemoteSandboxSession:
        check_file_names(files)
        try:
            url, answer = self.client.call(
                "POST", "/v1/sessions", {**program, "files": encode_files(files)}, key=new_key()
            )
        except ServiceUnavailable as error:
            return RemoteSandboxSession(self, url="", session_id="", lost=f"no sandbox replica opened it: {error}")
        except ServiceRequestError as error:
            raise ValueError(str(error)) from None
        try:
            pinned = self.client.pin(url, answer)  # the replica itself, when it was reached through a Service
        except ServiceRequestError as error:
            return RemoteSandboxSession(self, url="", session_id="", lost=str(error))
        return RemoteSandboxSession(self, url=pinned, session_id=str(answer["session_id"]))

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> RemoteSandbox:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


class RemoteSandboxSession:
    """`SandboxSession`'s calls on the replica that runs the program. Used by one thread at a time."""

    def __init__(self, sandbox: RemoteSandbox, *, url: str, session_id: str, lost: str = "") -> None:
        self._sandbox, self._url, self._path = sandbox, url, f"/v1/sessions/{session_id}"
        self._lost = lost
        self._has_ended = bool(lost)
        self._result: ExecutionResult | None = None

    @property
    def has_ended(self) -> bool:
        return self._has_ended

    def _call(self, route: str, payload: dict[str, Any], *, wait_s: float, key: str | None = None) -> dict[str, Any]:
        try:
            return self._sandbox.client.call(
                "POST", self._path + route, payload, pin=self._url, key=key, timeout_s=wait_s + _SLACK_S
            )[1]
        except ServiceUnavailable as error:  # ReplicaLost included: the program went with its replica
            self._lost = self._lost or f"the sandbox replica was lost mid-session: {error}"
            self._has_ended = True
            raise

    def send(self, message: bytes, *, timeout: float) -> bool:
        if b"\n" in message:
            raise ValueError("a session message is one line: it may not contain a newline")
        if self._lost:
            return False
        wait = min(max(timeout, 0.0), MAX_POLL_S)
        try:
            return bool(self._call("/send", {"line": encode_line(message), "timeout": wait}, wait_s=wait)["ok"])
        except ServiceUnavailable:
            return False

    def receive(self, *, timeout: float) -> bytes | None:
        deadline = time.monotonic() + max(timeout, 0.0)
        while not self._lost:
            wait = min(max(deadline - time.monotonic(), 0.0), MAX_POLL_S)
            try:
                answer = self._call("/receive", {"timeout": wait}, wait_s=wait)
            except ServiceUnavailable:
                return None
            line = decode_line(answer.get("line"))
            if line is not None or answer.get("has_ended") or time.monotonic() >= deadline:
                self._has_ended = self._has_ended or bool(answer.get("has_ended"))
                return line
        return None

    def close(self, *, grace_seconds: float | None = None) -> ExecutionResult:
        if self._result is not None:
            return self._result
        if not self._lost:
            wait = self._sandbox.config.wall_seconds if grace_seconds is None else grace_seconds
            try:
                answer = self._call("/close", {"grace_seconds": grace_seconds}, wait_s=wait, key=new_key())
                self._result = decode_result(answer)
            except ServiceUnavailable:
                pass
        self._has_ended = True
        if self._result is None:
            self._result = _lost(self._sandbox.report.backend, self._lost)
        return self._result


class RemoteSandboxPool:
    """`SandboxPool`'s calls (``await run``, ``await run_python``) on the replicas, for asyncio callers; at most
    ``remote.max_in_flight`` at once from this process."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.sandbox = RemoteSandbox(config)
        self.report: IsolationReport = self.sandbox.report

    async def run(
        self, argv: Sequence[str], *, files: Mapping[str, str | bytes] = NO_FILES, stdin: str | bytes = ""
    ) -> ExecutionResult:
        return await self.sandbox.client.in_thread(functools.partial(self.sandbox.run, argv, files=files, stdin=stdin))

    async def run_python(
        self, code: str, *, files: Mapping[str, str | bytes] = NO_FILES, stdin: str | bytes = ""
    ) -> ExecutionResult:
        job = functools.partial(self.sandbox.run_python, code, files=files, stdin=stdin)
        return await self.sandbox.client.in_thread(job)

    def close(self) -> None:
        self.sandbox.close()

    def __enter__(self) -> RemoteSandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> RemoteSandboxPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
