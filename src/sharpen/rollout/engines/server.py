"""What engines behind an HTTP server share: a private event loop to await requests on, a JSON client whose every
failure is one `EngineError` naming the engine, the URL and the cause, and a launcher for a server process that
sharpen starts itself.

Owns transport and process life, nothing about any server's routes: `vllm_server.py` and `sglang.py` speak their
servers' APIs on top of it.

- `EventLoopThread`: one asyncio loop in a daemon thread. Server engines run all their HTTP calls there, so a
  synchronous caller (the batch `generate`, a weight sync) and a coroutine in another loop (an episode task) share
  one connection pool: the former blocks on `run`, the latter awaits `wrap`.
- `JsonClient`: JSON over HTTP (httpx). Connection refused, DNS failure, a timeout, a non-2xx status and a body
  that is not JSON each become an `EngineError` that says which of them happened; those that say the server is
  down or failing (no connection, a connection reset, no answer in time, HTTP 5xx) are `EngineUnavailable`, which
  the router answers by sending the request to another replica; a request the server refuses for its own content
  (HTTP 400, 413, 422: a prompt past the context) is an `EngineInputError`.
- `ServerProcess`: starts a command in its own process group with its output in a log file, refuses a port that
  is taken (before starting anything), waits for a readiness route while checking the process is still alive (the
  error quotes the end of the log), and stops the whole group on `close` (or at once on `kill`, before a restart).
- `ServerEngine`: the life of an engine behind a server, the same for every server: start its command (or take the
  URL of a running one) and connect, `restart` a failed one on the same port (or wait until the URL answers
  again), `close` the connections and the server. An engine gives its command line, its health route and its
  checks on connecting; its routes (generation, weight updates) are its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import httpx

from sharpen.config.engines import EngineServerFields
from sharpen.rollout.engines.base import EngineError, EngineInputError, EngineUnavailable
from sharpen.types import Completion, PolicyVersion, SamplingParams

_REFUSED_INPUT = frozenset({400, 413, 422})
"""HTTP statuses of a request refused for its own content (`EngineInputError`), not of a failing server."""

T = TypeVar("T")
C = TypeVar("C", bound=EngineServerFields)


class EventLoopThread:
    """An asyncio event loop running in a daemon thread (a hung request cannot keep the process from exiting)."""

    def __init__(self, name: str = "sharpen-engine-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T], *, timeout: float | None = None) -> T:
        """Run ``coroutine`` on the loop and block until it is done (never call from the loop's own thread)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("EventLoopThread.run called from its own loop (await the coroutine instead)")
        future = self.submit(coroutine)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    async def wrap(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Await ``coroutine`` from another event loop: it runs on this one."""
        if asyncio.get_running_loop() is self.loop:
            return await coroutine
        return await asyncio.wrap_future(self.submit(coroutine))

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


class JsonClient:
    """JSON requests to one server; ``name`` (e.g. "vllm_server engine") starts every error message.

    Must be used from one event loop (an `EventLoopThread`'s): the connection pool belongs to it."""

    def __init__(
        self,
        base_url: str,
        *,
        name: str,
        timeout_s: float | None,
        connect_timeout_s: float = 10.0,
        headers: Mapping[str, str] | None = None,
        max_connections: int = 256,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name
        self.timeout_s = timeout_s
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._headers = dict(headers or {})
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client: httpx.AsyncClient | None = None

    def _session(self) -> httpx.AsyncClient:
        if self._client is None:  # made on first use, inside the loop that will use it
            self._client = httpx.AsyncClient(
                base_url=self.base_url, timeout=self._timeout, headers=self._headers, limits=self._limits
            )
        return self._client

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        timeout_s: float | None = -1.0,
        expect_json: bool = True,
    ) -> Any:
        """The decoded JSON body (None for an empty one); ``timeout_s`` overrides the client's (None: no limit;
        the default -1 keeps the client's)."""
        url = f"{self.base_url}{path}"
        timeout = self._timeout if timeout_s == -1.0 else httpx.Timeout(timeout_s, connect=self._timeout.connect)
        try:
            response = await self._session().request(method, path, json=json, params=params, timeout=timeout)
        except httpx.ConnectError as error:
            cause = _cause(error)
            raise EngineUnavailable(f"{self.name}: cannot connect to {url} ({cause}); is the server running?") from None
        except httpx.TimeoutException as error:
            limit = timeout.read if isinstance(error, httpx.ReadTimeout) else timeout.connect
            raise EngineUnavailable(
                f"{self.name}: {url} did not answer within {limit:g} s ({type(error).__name__}); the server may be "
                "stuck or overloaded"
            ) from None
        except httpx.TransportError as error:  # the connection broke: reset, closed mid-answer
            raise EngineUnavailable(f"{self.name}: request to {url} failed: {_cause(error)}") from None
        except httpx.HTTPError as error:
            raise EngineError(f"{self.name}: request to {url} failed: {_cause(error)}") from None
        if response.status_code >= 400:
            error_class = EngineUnavailable if response.status_code >= 500 else EngineError
            if response.status_code in _REFUSED_INPUT:
                error_class = EngineInputError
            raise error_class(
                f"{self.name}: {method} {url} returned HTTP {response.status_code}: {_excerpt(response.text)}"
            )
        if not expect_json or not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise EngineError(
                f"{self.name}: {url} did not return JSON (is it the right kind of server?): {_excerpt(response.text)}"
            ) from None

    async def get(self, path: str, **kwargs: Any) -> Any:
        return await self.request("GET", path, **kwargs)

    async def post(self, path: str, json: Any = None, **kwargs: Any) -> Any:
        return await self.request("POST", path, json=json, **kwargs)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


async def wait_answering(client: JsonClient, path: str, *, timeout_s: float, poll_s: float = 1.0) -> float:
    """Poll ``path`` until the server answers it (a server sharpen did not start, coming back after a failure);
    the seconds it took, or `EngineUnavailable` with the last error after ``timeout_s``."""
    started = time.monotonic()
    while True:
        try:
            await client.get(path, timeout_s=min(5.0, timeout_s), expect_json=False)
            return time.monotonic() - started
        except EngineError as error:
            if time.monotonic() - started > timeout_s:
                raise EngineUnavailable(
                    f"{client.name}: {client.base_url}{path} did not answer again within {timeout_s:g} s ({error})"
                ) from None
        await asyncio.sleep(poll_s)


def _cause(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) < 300 else text[:300] + "..."


def _excerpt(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def connect_host(host: str) -> str:
    """Where to reach a server listening on ``host`` from this machine (an IPv6 address in brackets)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on ``port`` (connections of a server that just died, left in TIME_WAIT, do not
    count: servers bind with SO_REUSEADDR, so a restart may take the port again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


class ServerProcess:
    """A server sharpen started: ``command`` in its own process group, output to ``log_path``.

    `wait_ready` polls ``ready_url`` until it answers 200, the process exits (the error quotes the log's end) or
    ``startup_timeout_s`` passes. `close` sends SIGTERM to the group, then SIGKILL after ``grace_s``."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        name: str,
        port: int,
        host: str = "127.0.0.1",
        log_path: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if port_in_use(port, host):
            raise EngineError(
                f"{name}: port {port} on {host} is already in use; choose another port (0: any free port) or "
                "stop what is listening there"
            )
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            list(command),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def log_tail(self, num_lines: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def wait_ready(self, ready_url: str, *, startup_timeout_s: float, poll_s: float = 0.5) -> float:
        """Seconds until the server answered ``ready_url``."""
        started = time.monotonic()
        while True:
            code = self.process.poll()
            if code is not None:
                raise EngineError(
                    f"{self.name}: the server exited with code {code} while starting (log: {self.log_path}):\n"
                    f"{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ready_url, timeout=2.0).status_code == 200:
                    return time.monotonic() - started
            if time.monotonic() - started > startup_timeout_s:
                self.close()
                raise EngineError(
                    f"{self.name}: the server did not become ready at {ready_url} within {startup_timeout_s:g} s "
                    f"(log: {self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(poll_s)

    @property
    def is_running(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """Stop the whole process group at once (SIGKILL): a server that failed gets no grace period."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        self._log.close()

    def close(self, grace_s: float = 20.0) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        else:  # the server is gone; children it left in its group go too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self._log.close()


class RequestLevelEngine:
    """Base of engines whose requests are coroutines on their own `EventLoopThread` (`_generate_one`): episodes
    await `generate_async` from their loop; the batch `generate` runs the requests concurrently and waits, so the
    server batches them as it would any concurrent requests."""

    name = "engine"

    def __init__(self) -> None:
        self._loop = EventLoopThread(name=f"sharpen-{self.name}")

    async def _generate_one(self, prompt: list[int], params: SamplingParams) -> Completion:
        raise NotImplementedError

    async def generate_async(self, prompt: list[int], params: SamplingParams) -> Completion:
        return await self._loop.wrap(self._generate_one(prompt, params))

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        async def all_of() -> list[Completion]:
            return list(await asyncio.gather(*(self._generate_one(p, q) for p, q in zip(prompts, params, strict=True))))

        return self._loop.run(all_of())


class ServerEngine(RequestLevelEngine, Generic[C]):
    """Base of engines behind an HTTP server: the server at ``config.url``, or one sharpen starts (``url`` None) on
    ``config.host:config.port`` (0: any free port) with its output in ``log_dir/{log_name}-{port}.log`` (no
    ``log_dir``: a temporary folder, removed again if the port is taken).

    A subclass sets its own fields, then calls `_open`; it gives `_server_command` (raising before anything starts
    when the server cannot be started here), `_connect` (its checks on connecting, which `restart` runs again) and
    `_forget_server_state` (what a new server does not remember), and sets `health_route`, `log_name` and
    `server_env`. `close` may be called at any point of `_open`: it closes what exists."""

    health_route: ClassVar[str] = "/health"
    """Answers 200 once the server is ready."""
    log_name: ClassVar[str] = "server"
    """Start of the name of a started server's log file (and of its temporary log folder)."""
    server_env: ClassVar[Mapping[str, str]] = {}
    """Environment variables a started server gets on top of this process's."""

    def __init__(self, config: C) -> None:
        super().__init__()
        self.config = config
        self.url = config.url.rstrip("/") if config.url is not None else ""
        self.server: ServerProcess | None = None
        """The server sharpen started (None: a server at ``config.url``)."""
        self.policy_version: PolicyVersion = 0
        self.startup_seconds = 0.0
        self._client: JsonClient | None = None
        self._launch_settings: tuple[list[str], int, Path] | None = None  # command, port, log file
        self._life = threading.Lock()  # `restart` and `close` of the server process, one at a time
        self._closed = False

    def _server_command(self, *, port: int, model_path: Path, dtype: str, seed: int) -> list[str]:
        raise NotImplementedError

    def _connect(self) -> None:
        """Check that the server is the right kind, serving this run's model, and label its weights version 0."""
        raise NotImplementedError

    def _forget_server_state(self) -> None:
        """Reset what the engine knew about a server that `restart` replaced (the version is reset already)."""

    @property
    def client(self) -> JsonClient:
        if self._client is None:
            raise EngineError(f"{self.name}: not connected")
        return self._client

    def _open(
        self, *, model_path: Path, dtype: str, seed: int, request_timeout_s: float | None, log_dir: Path | None
    ) -> None:
        """Start the server (``config.url`` None) and connect; on any failure, close what was started."""
        started = time.monotonic()
        try:
            if self.config.url is None:
                self.url = self._start(model_path=model_path, dtype=dtype, seed=seed, log_dir=log_dir)
            self._client = JsonClient(self.url, name=f"{self.name} at {self.url}", timeout_s=request_timeout_s)
            self._connect()
        except BaseException:
            self.close()
            raise
        self.startup_seconds = time.monotonic() - started

    def _start(self, *, model_path: Path, dtype: str, seed: int, log_dir: Path | None) -> str:
        config = self.config
        port = config.port or free_port(config.host)
        command = self._server_command(port=port, model_path=model_path, dtype=dtype, seed=seed)
        folder = log_dir if log_dir is not None else Path(tempfile.mkdtemp(prefix=f"sharpen-{self.log_name}-"))
        self._launch_settings = (command, port, folder / f"{self.log_name}-{port}.log")
        try:
            server = self._launch()
        except EngineError:  # the port is taken: nothing was started or logged
            if log_dir is None:
                shutil.rmtree(folder, ignore_errors=True)
            raise
        url = f"http://{connect_host(config.host)}:{port}"
        server.wait_ready(f"{url}{self.health_route}", startup_timeout_s=config.start_timeout_s)
        return url

    def _launch(self) -> ServerProcess:
        assert self._launch_settings is not None, "_launch before _start"
        command, port, log_path = self._launch_settings
        self.server = ServerProcess(
            command, name=self.name, port=port, host=self.config.host, log_path=log_path, env=self.server_env
        )
        return self.server

    def restart(self) -> None:
        """A new server on the same port (a server at a URL: wait until it answers again), connected as at the
        start; then version 0 until the next sync (`RestartableEngine`)."""
        started = time.monotonic()
        limit = self.config.start_timeout_s
        with self._life:
            if self._closed:
                raise EngineError(f"{self.name} at {self.url} is closed")
            server = self.server
            if server is not None:
                server.kill()
                server = self._launch()
        if server is None:
            self._loop.run(wait_answering(self.client, self.health_route, timeout_s=limit), timeout=limit + 30)
        else:
            server.wait_ready(f"{self.url}{self.health_route}", startup_timeout_s=limit)
        self.policy_version = 0
        self._forget_server_state()
        self._connect()
        self.startup_seconds = time.monotonic() - started

    def close(self) -> None:
        """Close the connections and stop a server sharpen started (its process group); once."""
        with self._life:  # a restart in progress launches nothing after this
            if self._closed:
                return
            self._closed = True
        try:
            if self._client is not None:
                self._loop.run(self._client.aclose(), timeout=5.0)
        finally:
            self._loop.close()
            if self.server is not None:
                self.server.close()
