"""`EnvironmentService`: any sharpen `Environment` served over HTTP (`sharpen serve-env`), episodes by id.

Owns the routes, the wire format of the environment protocol's data, and the table of open episodes:

- ``GET /v1/info`` -> ``{"name", "version"}`` of the environment served.
- ``POST /v1/episodes`` ``{"example": {...}, "context": {"seed", "sample_index", "max_turns", "max_tokens",
  "wall_seconds"}}`` -> ``{"episode_id", "observation": [messages], "replica_url"?}``: a fresh environment from the
  recipe's factory, reset with an `EpisodeContext` rebuilt from those numbers (its rng from the seed; its sandbox
  this server's), so an episode depends on its example, seed and actions alone. ``replica_url``, when the server
  was given its own address (``advertise_url``), is where the episode's steps must go: a client that reached this
  replica through a Kubernetes Service sends them to this pod, not back through the Service to another.
- ``POST /v1/episodes/{id}/step`` ``{"action", "turn"}`` -> a `StepResult`. ``turn`` counts the steps before
  this one: a step that does not follow the last is refused (409) rather than applied out of order. An episode is
  forgotten after a step that ends it or its ``max_turns``-th step, else after ``service.idle_seconds`` untouched.

Reset and step are queued (bounded, 503 beyond) and idempotent by key. An environment's exception fails the
request (500), which the client turns into `EnvironmentInfraError`. Agent environments (their agent calls the
engine itself) are not served. Does not know its clients (remote.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from sharpen.config.environments import EnvironmentConfig
from sharpen.config.sandbox import SandboxConfig
from sharpen.config.service import ServiceConfig
from sharpen.environments.base import AgentEnvironment, Environment, EpisodeContext
from sharpen.environments.registry import build_environment_factory, build_sandbox
from sharpen.environments.wire import decode_example, encode_messages, encode_step
from sharpen.serving.shell import Request, Route, ServedComponent, ServiceError, ServiceShell

_MAX_RUNNING = 64
"""Resets and steps in progress at once (they are coroutines on one event loop; most wait on I/O)."""


@dataclass(kw_only=True, slots=True)
class _Episode:
    environment: Environment
    max_turns: int
    wall_seconds: float | None
    num_steps: int = 0
    last_used: float = field(default_factory=time.monotonic)
    is_busy: bool = False


class EnvironmentService(ServedComponent):
    """Serves the environment of ``config`` (and, for environments that run code, a pool of ``sandbox``).
    ``advertise_url``: this replica's own address, given with every episode it opens (None: none)."""

    def __init__(
        self,
        config: EnvironmentConfig,
        *,
        sandbox: SandboxConfig,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_url: str | None = None,
    ):
        local = config.model_copy(update={"remote": None}) if getattr(config, "remote", None) is not None else config
        self.factory = build_environment_factory(local)
        probe = self.factory()
        if isinstance(probe, AgentEnvironment) or not isinstance(probe, Environment):
            raise ValueError(
                f"environment {config.type!r} runs its own agent: only turn-by-turn environments are served"
            )
        self.name, self.version = probe.name, probe.version
        self.service: ServiceConfig = getattr(config, "service", None) or ServiceConfig()
        self.sandbox = build_sandbox(local, sandbox)
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._threads = [
            threading.Thread(target=self._loop.run_forever, daemon=True, name="env-service-loop"),
            threading.Thread(target=self._expire, daemon=True, name="env-service-expiry"),
        ]
        routes = [
            Route(method="GET", pattern="/v1/info", handler=lambda _: {"name": self.name, "version": self.version}),
            Route(method="POST", pattern="/v1/episodes", handler=self._reset, is_queued=True, is_idempotent=True),
            Route(
                method="POST", pattern="/v1/episodes/{}/step", handler=self._step, is_queued=True, is_idempotent=True
            ),
        ]
        self.shell = ServiceShell(
            self.service,
            routes=routes,
            token=token,
            max_running=_MAX_RUNNING,
            host=host,
            port=port,
            is_ready=lambda: not self._stopping.is_set(),
            gauges=lambda: {"sharpen_open_episodes": len(self._episodes)},
        )
        self.url = self.shell.url
        self.advertise_url = advertise_url

    def close(self) -> None:
        self._stopping.set()
        self.shell.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self.sandbox is not None:
            self.sandbox.close()

    @property
    def num_open(self) -> int:
        return len(self._episodes)

    def _reset(self, request: Request) -> dict[str, Any]:
        try:
            example = decode_example(request.body["example"])
            numbers = request.body["context"]
            ctx = EpisodeContext(
                seed=int(numbers["seed"]),
                sample_index=int(numbers["sample_index"]),
                max_turns=int(numbers["max_turns"]),
                max_tokens=int(numbers["max_tokens"]),
                wall_seconds=numbers.get("wall_seconds"),
                sandbox=self.sandbox,
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ServiceError(400, f"a reset needs an example and a context: {error!r}") from None
        if len(self._episodes) >= self.service.max_open:
            raise ServiceError(503, "too many open episodes on this replica", retry_after=self.service.retry_after_s)
        environment = self.factory()
        assert isinstance(environment, Environment)  # checked at start: the factory makes turn-by-turn environments
        observation = self._await(environment.reset(example, ctx), timeout=ctx.wall_seconds)
        episode_id = uuid.uuid4().hex
        with self._lock:
            self._episodes[episode_id] = _Episode(
                environment=environment, max_turns=ctx.max_turns, wall_seconds=ctx.wall_seconds
            )
        answer: dict[str, Any] = {"episode_id": episode_id, "observation": encode_messages(observation)}
        if self.advertise_url:
            answer["replica_url"] = self.advertise_url
        return answer

    def _step(self, request: Request) -> dict[str, Any]:
        action, turn = request.body.get("action"), request.body.get("turn")
        if not isinstance(action, str) or not isinstance(turn, int):
            raise ServiceError(400, 'a step needs "action" (a string) and "turn" (an integer)')
        episode_id = request.params[0]
        with self._lock:
            episode = self._episodes.get(episode_id)
            if episode is None:
                raise ServiceError(404, f"no open episode {episode_id} (ended, expired, or never started here)")
            if episode.is_busy or turn != episode.num_steps:
                raise ServiceError(409, f"step {turn} of an episode at step {episode.num_steps} (or mid-step)")
            episode.is_busy = True
        try:
            result = self._await(episode.environment.step(action), timeout=episode.wall_seconds)
        finally:
            with self._lock:
                episode.is_busy, episode.last_used = False, time.monotonic()
        with self._lock:
            episode.num_steps += 1
            if result.terminated or result.truncated or episode.num_steps >= episode.max_turns:
                self._episodes.pop(episode_id, None)  # the episode loop calls no further step
        return encode_step(result)

    def _await(self, coroutine: Any, *, timeout: float | None) -> Any:
        """Run ``coroutine`` on the service's loop; past the episode's wall clock it is cancelled (504): the episode
        loop has given up on it by then, and it must not run on here."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            future.cancel()
            raise ServiceError(504, f"the environment took longer than the episode's {timeout} s") from None

    def _expire(self) -> None:
        idle = self.service.idle_seconds
        while not self._stopping.wait(min(1.0, idle / 4)):
            now = time.monotonic()
            with self._lock:
                for key in [k for k, e in self._episodes.items() if not e.is_busy and now - e.last_used > idle]:
                    del self._episodes[key]
