"""The health of the engine replicas behind `EngineRouter`: which serve, which are being restarted, which wait for
weights, the choice of a replica for each request, and what happened (the step's counts, a log of events).

Owns the replicas' states, nothing about how a request is sent (the router's). A replica is in one of four states:

- ``serving``: it takes requests and weight syncs;
- ``restarting``: it failed (an `EngineUnavailable`, a hang, a failed weight load) and is being restarted in a
  background thread (`RestartableEngine.restart`);
- ``standby``: it came back with the weights it boots with, and serves once the next weight sync has given it the
  run's; while the run is still at the version it boots with (version 0, before the first sync) it serves at once;
- ``lost``: it cannot come back (not restartable, restarts off, or its restart failed) and stays out of the run.

Each time a replica goes down its epoch grows, so a late report about an incarnation already replaced changes
nothing, and every request still running on the failed incarnation is told at once (`watch`), to be sent elsewhere
without waiting for its own error or timeout. A request finds no serving replica only while all are down: it waits,
up to ``replica_wait_s``, while one is restarting, and fails at once, naming each replica's state, when none can
serve before the next weight sync.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from sharpen.config.engines import FailoverConfig
from sharpen.rollout.engines.base import EngineError, InferenceEngine, RestartableEngine
from sharpen.types import PolicyVersion

logger = logging.getLogger(__name__)

MAX_EVENTS = 10_000
"""Events kept (the oldest go first)."""


class ReplicaState(enum.Enum):
    SERVING = "serving"
    RESTARTING = "restarting"
    STANDBY = "standby"
    LOST = "lost"


@dataclass(frozen=True, kw_only=True, slots=True)
class Lease:
    """One request's hold on a replica: which one, and which incarnation of it."""

    replica: int
    epoch: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaEvent:
    at: float
    """``time.monotonic()`` when it happened."""
    replica: int
    kind: Literal["down", "restarted", "rejoined", "lost", "served_retry"]
    detail: str = ""


class ReplicaSet:
    """The states of ``engines`` (all serving at first, at their common version) and their counts."""

    def __init__(self, engines: Sequence[InferenceEngine], names: Sequence[str], *, config: FailoverConfig) -> None:
        self.engines = list(engines)
        self.names = list(names)
        self.config = config
        self.states = [ReplicaState.SERVING] * len(engines)
        self.causes = [""] * len(engines)
        """Why each replica last went down."""
        self.epochs = [0] * len(engines)
        self.in_flight = [0] * len(engines)
        self.num_routed = [0] * len(engines)
        """Requests sent to each replica so far (retries included)."""
        self.num_retried = 0
        self.num_restarts = 0
        self.events: collections.deque[ReplicaEvent] = collections.deque(maxlen=MAX_EVENTS)
        self.version: PolicyVersion = engines[0].policy_version
        """The run's version: what the serving replicas hold (the last weight load's)."""
        self.is_loading = False
        self.is_closed = False
        self._cond = threading.Condition()
        self._watchers: list[dict[int, Callable[[], None]]] = [{} for _ in engines]
        self._listeners: set[Callable[[], None]] = set()  # requests of event loops waiting for a serving replica
        self._tokens = itertools.count()
        self._reported = (0, 0, [0] * len(engines))  # retried, restarts, routed at the last `pop_metrics`

    def serving(self) -> list[int]:
        with self._cond:
            return [i for i, state in enumerate(self.states) if state is ReplicaState.SERVING]

    def serving_leases(self) -> list[Lease]:
        with self._cond:
            return [Lease(replica=i, epoch=self.epochs[i]) for i in self.serving()]

    # choosing a replica

    def acquire(self, num_requests: int = 1) -> list[Lease]:
        """A lease for each request, each on the serving replica with the fewest requests in flight (ties: the
        lowest index); blocks while no replica serves (see the module docstring)."""
        deadline = time.monotonic() + self.config.replica_wait_s
        with self._cond:
            while (leases := self._pick(num_requests, deadline)) is None:
                self._cond.wait(max(deadline - time.monotonic(), 0.0))
            return leases

    async def acquire_async(self) -> Lease:
        """`acquire` of one request, waiting without blocking the caller's event loop."""
        deadline = time.monotonic() + self.config.replica_wait_s
        loop = asyncio.get_running_loop()
        while True:
            woken: asyncio.Future[None] = loop.create_future()
            wake = functools.partial(wake_threadsafe, loop, woken)
            with self._cond:
                leases = self._pick(1, deadline)
                if leases is not None:
                    return leases[0]
                self._listeners.add(wake)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken, timeout=max(deadline - time.monotonic(), 0.0))
            finally:
                with self._cond:
                    self._listeners.discard(wake)

    def _pick(self, num_requests: int, deadline: float) -> list[Lease] | None:
        serving = [i for i, state in enumerate(self.states) if state is ReplicaState.SERVING]
        if serving:
            leases = []
            for _ in range(num_requests):
                replica = min(serving, key=lambda i: self.in_flight[i])
                self.in_flight[replica] += 1
                self.num_routed[replica] += 1
                leases.append(Lease(replica=replica, epoch=self.epochs[replica]))
            return leases
        if self.is_closed:
            raise EngineError("the engine router is closed")
        if ReplicaState.RESTARTING not in self.states:
            raise EngineError(f"no engine replica can serve: {self.describe()}")
        if time.monotonic() >= deadline:
            raise EngineError(
                f"no engine replica served for {self.config.replica_wait_s:g} s (rollout.failover.replica_wait_s): "
                f"{self.describe()}"
            )
        return None

    def release(self, replica: int, num_requests: int = 1) -> None:
        with self._cond:
            self.in_flight[replica] -= num_requests

    def watch(self, lease: Lease, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (from any thread) when the leased incarnation goes down (at once if it has); returns
        the function that stops watching."""
        with self._cond:
            if lease.epoch != self.epochs[lease.replica]:
                callback()
                return lambda: None
            token = next(self._tokens)
            self._watchers[lease.replica][token] = callback

        def unwatch() -> None:
            with self._cond:
                self._watchers[lease.replica].pop(token, None)

        return unwatch

    # failures and restarts

    def fail(self, lease: Lease, cause: str) -> bool:
        """Take the leased incarnation out of rotation (restarting it in the background where it can be), unless
        it is already out; returns whether this call took it out."""
        replica = lease.replica
        engine = self.engines[replica]
        with self._cond:
            state = self.states[replica]
            if self.is_closed or lease.epoch != self.epochs[replica] or state is ReplicaState.RESTARTING:
                return False
            if state is ReplicaState.LOST:
                return False
            restart = self.config.restart and isinstance(engine, RestartableEngine)
            self.epochs[replica] += 1
            self.causes[replica] = cause
            self.states[replica] = ReplicaState.RESTARTING if restart else ReplicaState.LOST
            self.num_restarts += int(restart)
            self._record(replica, "down", cause)
            for callback in self._watchers[replica].values():
                callback()
            self._watchers[replica] = {}
            self._notify()
            epoch = self.epochs[replica]
        name = self.names[replica]
        if restart:
            logger.warning("%s failed (%s); restarting it in the background", name, cause)
            thread = threading.Thread(target=self._restart, args=(replica, epoch), name=f"sharpen-restart-{replica}")
            thread.daemon = True
            thread.start()
        else:
            why = "rollout.failover.restart is off" if not self.config.restart else "it cannot be restarted"
            logger.error("%s failed (%s); %s, so the run goes on without it", name, cause, why)
        return True

    def _restart(self, replica: int, epoch: int) -> None:
        engine, name = self.engines[replica], self.names[replica]
        assert isinstance(engine, RestartableEngine)
        started = time.monotonic()
        try:
            engine.restart()
        except Exception as error:
            with self._cond:
                if self.is_closed or epoch != self.epochs[replica]:
                    return
                self.states[replica] = ReplicaState.LOST
                self.causes[replica] = f"its restart failed: {error}"
                self._record(replica, "lost", str(error))
                self._notify()
            logger.error("%s could not be restarted, so the run goes on without it: %s", name, error)
            return
        with self._cond:
            if self.is_closed or epoch != self.epochs[replica]:
                return
            self._record(replica, "restarted", f"{time.monotonic() - started:.1f} s")
            if engine.policy_version == self.version and not self.is_loading:
                self.states[replica] = ReplicaState.SERVING
                self._record(replica, "rejoined", f"version {self.version}")
            else:
                self.states[replica] = ReplicaState.STANDBY
            self._notify()
            state = self.states[replica].value
        logger.warning("%s restarted in %.1f s (%s)", name, time.monotonic() - started, state)

    # weight loads

    def begin_load(self) -> list[Lease]:
        """Leases on the replicas that take a weight load (serving and standby); waits like `acquire` while every
        replica is restarting."""
        deadline = time.monotonic() + self.config.replica_wait_s
        taking = (ReplicaState.SERVING, ReplicaState.STANDBY)
        with self._cond:
            while not (replicas := [i for i, state in enumerate(self.states) if state in taking]):
                if self.is_closed or ReplicaState.RESTARTING not in self.states or time.monotonic() >= deadline:
                    raise EngineError(f"no engine replica can take weights: {self.describe()}")
                self._cond.wait(max(deadline - time.monotonic(), 0.0))
            self.is_loading = True
            return [Lease(replica=i, epoch=self.epochs[i]) for i in replicas]

    def end_load(self, version: PolicyVersion, loaded: list[Lease]) -> None:
        """The replicas of ``loaded`` hold ``version`` now and serve (standby ones rejoin)."""
        with self._cond:
            self.is_loading = False
            for lease in loaded:
                replica = lease.replica
                if lease.epoch != self.epochs[replica] or self.states[replica] is ReplicaState.LOST:
                    continue
                if self.states[replica] is ReplicaState.STANDBY:
                    self._record(replica, "rejoined", f"version {version}")
                self.states[replica] = ReplicaState.SERVING
            if loaded:
                self.version = version
            self._notify()

    # what happened

    def count_retries(self, num_requests: int) -> None:
        with self._cond:
            self.num_retried += num_requests

    def record(self, replica: int, kind: Literal["served_retry"], detail: str = "") -> None:
        with self._cond:
            self._record(replica, kind, detail)

    def _record(
        self, replica: int, kind: Literal["down", "restarted", "rejoined", "lost", "served_retry"], detail: str
    ) -> None:
        self.events.append(ReplicaEvent(at=time.monotonic(), replica=replica, kind=kind, detail=detail))

    def describe(self) -> str:
        """Each replica's state, for error messages."""
        parts = []
        for name, state, cause in zip(self.names, self.states, self.causes, strict=True):
            cause = cause.removeprefix(f"{name}: ")  # the causes name their replica, for the retry errors
            match state:
                case ReplicaState.SERVING:
                    parts.append(f"{name}: serving")
                case ReplicaState.RESTARTING:
                    parts.append(f"{name}: restarting after a failure ({cause})")
                case ReplicaState.STANDBY:
                    parts.append(
                        f"{name}: restarted, waits for the next weight sync (the run is at version {self.version})"
                    )
                case ReplicaState.LOST:
                    parts.append(f"{name}: out of the run ({cause})")
        return "; ".join(parts)

    def pop_metrics(self) -> dict[str, float]:
        """Since the last call: requests sent again, restarts begun, requests sent to each replica; and how many
        replicas serve now."""
        with self._cond:
            retried, restarts, routed = self._reported
            metrics = {
                "rollout/requests_retried": float(self.num_retried - retried),
                "engine/restarts": float(self.num_restarts - restarts),
                "engine/num_serving": float(self.states.count(ReplicaState.SERVING)),
            }
            for replica, (now, then) in enumerate(zip(self.num_routed, routed, strict=True)):
                metrics[f"engine/replica_{replica}/requests"] = float(now - then)
            self._reported = (self.num_retried, self.num_restarts, list(self.num_routed))
            return metrics

    def close(self) -> None:
        """No more requests, restarts or waits: those waiting get an error."""
        with self._cond:
            self.is_closed = True
            self._notify()

    def _notify(self) -> None:
        self._cond.notify_all()
        for listener in self._listeners:
            listener()


def wake_threadsafe(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    """Resolve ``future`` of ``loop`` from any thread (nothing happens once the loop has closed)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
