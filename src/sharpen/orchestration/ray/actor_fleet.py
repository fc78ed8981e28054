"""The one replica mechanism of every Ray-hosted fleet (sandbox, environment, reward model): N actors of one class.

An `ActorFleet` places ``config.num_replicas`` actors that each reserve `FleetConfig`'s resources per replica
(``num_cpus``, ``num_gpus``, ``memory_mb``), has Ray restart a dead one (``max_restarts``), waits for them to start
(bounded by ``start_timeout_s``), grows or shrinks (`scale`), asks Ray's autoscaler for room (`request_resources`)
and ends them (`close`). A `Probe` tells a replica that Ray is restarting from one dead for good, with or without
waiting; the fleet and its users share that rule.

How a replica is addressed is its user's: a `ServiceFleet` (`fleets.py`) hands out one URL per replica, and its
clients pin a sandbox session or an environment episode to one; a `RewardModelPool` (`reward_actors.py`) spreads
stateless calls over the actors. Does not decide when to scale and does not retry calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.autoscaler.sdk import request_resources
from ray.exceptions import RayActorError

from sharpen.config.service import FleetConfig

logger = logging.getLogger(__name__)

MAX_FAILED_PROBES = 3
"""Failed calls before a replica counts as dead for good (one meets the death, the next the restart)."""


class Probe:
    """Whether one replica lives: ``method()`` is called on it until it answers (``is_alive``, its ``answer``) or
    fails `MAX_FAILED_PROBES` times (dead for good). A call that met the actor dying fails, and the next call, sent
    after a pause that lets Ray see the death, waits for Ray's restart; an actor that Ray does not restart fails
    every call at once."""

    def __init__(self, actor: Any, method: str) -> None:
        self.actor, self.method = actor, method
        self.is_alive: bool | None = None
        """None while it is not known yet."""
        self.answer: Any = None
        self.last_error = ""
        self._num_failed = 0
        self._resend_at = 0.0
        self._ref: Any = getattr(actor, method).remote()

    def wait(self, timeout_s: float) -> bool:
        """Whether ``is_alive`` is known, waiting up to ``timeout_s`` (0: only look) for the replica's answer."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while self.is_alive is None:
            if self._ref is None:
                if self._resend_at > deadline:
                    return False
                time.sleep(max(self._resend_at - time.monotonic(), 0.0))
                self._ref = getattr(self.actor, self.method).remote()
            ready, _ = ray.wait([self._ref], timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                return False
            try:
                self.answer = ray.get(self._ref)
                self.is_alive = True
            except RayActorError as error:
                self.last_error = str(error).strip().splitlines()[-1]  # a constructor's own error ends it
                self._num_failed += 1
                self._ref = None
                self._resend_at = time.monotonic() + 0.1 * self._num_failed
                if self._num_failed == MAX_FAILED_PROBES:
                    self.is_alive = False
        return True


class ActorFleet:
    """``config.num_replicas`` actors of ``actor_class(*args, **kwargs)``, named ``what/0``, ``what/1``, ... in the
    order they started. A replica is ready once it answers ``ready_method`` (the answers are kept in ``answers``,
    one per live replica); ``what`` names the fleet in errors; every wait is bounded by ``start_timeout_s``."""

    ready_method = "__ray_ready__"
    """The method a started replica answers: Ray's no-op, which answers once the constructor is done."""

    def __init__(
        self,
        actor_class: type,
        config: FleetConfig,
        *,
        what: str,
        start_timeout_s: float,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.config, self.what, self.start_timeout_s = config, what, start_timeout_s
        memory = {} if config.memory_mb is None else {"memory": config.memory_mb << 20}
        self._actor_class = ray.remote(actor_class).options(
            num_cpus=config.num_cpus, num_gpus=config.num_gpus, max_restarts=config.max_restarts, **memory
        )
        self._args, self._kwargs = tuple(args), dict(kwargs or {})
        self.actors: list[Any] = []
        self.names: list[str] = []
        self.answers: list[Any] = []
        self._num_started = 0
        try:
            self.scale(config.num_replicas)
        except BaseException:
            self.close()
            raise

    @property
    def bundle(self) -> dict[str, float]:
        """One replica's resources, as Ray's scheduler and autoscaler count them."""
        gpus = {} if self.config.num_gpus == 0 else {"GPU": self.config.num_gpus}
        memory = {} if self.config.memory_mb is None else {"memory": float(self.config.memory_mb * (1 << 20))}
        return {"CPU": self.config.num_cpus, **gpus, **memory}

    def scale(self, num_replicas: int) -> list[Any]:
        """Grow (new replicas, waited for) or shrink (the newest replicas end, after `refresh` told the users) to
        ``num_replicas``; the live replicas' answers."""
        if num_replicas < 1:
            raise ValueError(f"{self.what} fleet: num_replicas must be >= 1, got {num_replicas}")
        leaving = self.actors[num_replicas:]
        del self.actors[num_replicas:], self.names[num_replicas:]
        for _ in range(num_replicas - len(self.actors)):
            self.actors.append(self._actor_class.remote(*self._args, **self._kwargs))
            self.names.append(f"{self.what}/{self._num_started}")
            self._num_started += 1
        try:
            return self.refresh()
        finally:
            self._end(leaving)

    def refresh(self) -> list[Any]:
        """Ask every replica ``ready_method`` (waiting for one that Ray is restarting), drop those dead for good, and
        return (and keep in ``answers``) the others' answers."""
        deadline = time.monotonic() + self.start_timeout_s
        probes = [Probe(actor, self.ready_method) for actor in self.actors]  # all at once: they start side by side
        answers: list[Any] = []
        last_error = ""
        for name, probe in zip(list(self.names), probes, strict=True):
            if not probe.wait(deadline - time.monotonic()):
                raise RuntimeError(
                    f"{self.what} fleet: replica {name} did not start within {self.start_timeout_s:g} s; the "
                    f"cluster has {ray.available_resources()} available for replicas of {self.bundle}"
                )
            if probe.is_alive:
                answers.append(probe.answer)
                continue
            last_error = probe.last_error
            logger.warning("%s fleet: replica %s died for good and leaves the fleet: %s", self.what, name, last_error)
            index = self.actors.index(probe.actor)
            del self.actors[index], self.names[index]
        if not answers:
            raise RuntimeError(f"{self.what} fleet: no replica is alive; the last one failed with: {last_error}")
        self.answers = answers
        return answers

    def request_resources(self, num_replicas: int) -> None:
        """Ask Ray's autoscaler for room for ``num_replicas`` replicas (before `scale`, on an autoscaling cluster)."""
        request_resources(bundles=[self.bundle] * num_replicas)

    def close(self) -> None:
        """End every replica; safe to repeat."""
        self._end(self.actors)
        self.actors, self.names, self.answers = [], [], []

    def _end(self, actors: list[Any]) -> None:
        """End ``actors`` for good (no restart)."""
        for actor in actors:
            ray.kill(actor, no_restart=True)
