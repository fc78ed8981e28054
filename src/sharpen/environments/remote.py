"""The environment's client backend (``environment.remote``): `RemoteEnvironment`, an `Environment` whose episodes
run on `sharpen serve-env` replicas (service.py), and `RemoteEnvironmentFactory`, one per run.

Owns moving an episode when its replica is lost. An episode is deterministic given its example, seed and actions
(the environment contract: randomness comes from the episode's seed), so when the replica that holds it dies or
forgets it (expiry), the client resets it on another replica and replays the actions so far, checking that every
observation, reward and end flag comes back as recorded; then the step goes on there. An episode that does not
replay identically, or that no replica can take, raises `EnvironmentInfraError`: the fault is not the policy's and
the episode abstains. An episode's steps go to the replica that opened it, by the address that replica advertised
(so a Kubernetes Service in front of several replicas opens episodes but never moves one). A step is sent once per
turn under one Idempotency-Key, so a retry never applies an action twice. Does not start replicas; the episode loop
cannot tell this environment from a local one.
"""

from __future__ import annotations

import functools
from typing import Any

from sharpen.config.service import RemoteConfig
from sharpen.environments.base import EnvironmentInfraError, EpisodeContext, StepResult
from sharpen.environments.wire import decode_messages, decode_step, encode_context, encode_example, encode_messages
from sharpen.serving.replicas import ReplicaClient, ReplicaLost, ServiceRequestError, ServiceUnavailable, new_key
from sharpen.types import Example, Message

MAX_MOVES = 2
"""Replicas an episode may move to after the first (each move replays it)."""


class RemoteEnvironmentFactory:
    """Builds a `RemoteEnvironment` per episode, all sharing one client; asks a replica for the environment's name
    and version at construction (a wrong token or no live replica fails here, before any episode)."""

    def __init__(self, config: RemoteConfig) -> None:
        self.client = ReplicaClient(config, what="environment")
        try:
            info = self.client.call("GET", "/v1/info")[1]
        except BaseException:
            self.client.close()
            raise
        self.name, self.version = str(info["name"]), str(info["version"])

    def __call__(self) -> RemoteEnvironment:
        return RemoteEnvironment(client=self.client, name=self.name, version=self.version)

    def close(self) -> None:
        self.client.close()


class RemoteEnvironment:
    """One episode on a replica; the same ``reset``/``step`` as the environment it serves."""

    def __init__(self, *, client: ReplicaClient, name: str, version: str) -> None:
        self.client, self.name, self.version = client, name, version
        self.num_moves = 0
        self._key = new_key()
        self._url = ""
        self._episode_id = ""
        self._start: dict[str, Any] = {}
        self._first: list[dict[str, str]] = []
        self._steps: list[tuple[str, dict[str, Any]]] = []

    @property
    def replica_url(self) -> str:
        """The replica that holds the episode now ("" before reset)."""
        return self._url

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        self._start = {"example": encode_example(example), "context": encode_context(ctx)}
        first = await self._call(self._open, f"{self._key}:reset")
        self._first = first
        return decode_messages(first)

    async def step(self, action: str) -> StepResult:
        turn = len(self._steps)
        while True:
            try:
                answer = await self._call(self._step_here, action, turn, f"{self._key}:{self.num_moves}:{turn}")
                break
            except ReplicaLost as error:
                if self.num_moves >= MAX_MOVES:
                    raise EnvironmentInfraError(
                        f"environment replicas lost {self.num_moves + 1} times: {error}"
                    ) from None
                self.num_moves += 1
                await self.client.in_thread(functools.partial(self._move, str(error)))
        self._steps.append((action, answer))
        return decode_step(answer)

    async def _call(self, job: Any, *args: Any) -> Any:
        try:
            return await self.client.in_thread(functools.partial(job, *args))
        except ReplicaLost:
            raise
        except (ServiceUnavailable, ServiceRequestError) as error:
            raise EnvironmentInfraError(f"environment service: {error}") from None

    def _open(self, key: str) -> list[dict[str, str]]:
        url, answer = self.client.call("POST", "/v1/episodes", self._start, key=key)
        self._url = self.client.pin(url, answer)  # the replica itself, when it was reached through a Service
        self._episode_id = str(answer["episode_id"])
        return answer["observation"]

    def _step_here(self, action: str, turn: int, key: str) -> dict[str, Any]:
        path = f"/v1/episodes/{self._episode_id}/step"
        return self.client.call("POST", path, {"action": action, "turn": turn}, key=key, pin=self._url)[1]

    def _move(self, why: str) -> None:
        """Rebuild the episode on a replica (another one, unless the lost one merely forgot it) and replay it."""
        try:
            first = self._open(f"{self._key}:reset:{self.num_moves}")
            if first != self._first:
                raise EnvironmentInfraError(f"the episode did not replay after '{why}': another first observation")
            for turn, (action, recorded) in enumerate(self._steps):
                replayed = self._step_here(action, turn, f"{self._key}:{self.num_moves}:{turn}")
                if _comparable(replayed) != _comparable(recorded):
                    raise EnvironmentInfraError(f"the episode did not replay after '{why}': step {turn} differs")
        except (ServiceUnavailable, ServiceRequestError) as error:
            raise EnvironmentInfraError(f"the episode could not be moved after '{why}': {error}") from None


def _comparable(step: dict[str, Any]) -> tuple[Any, ...]:
    """What a replayed step must reproduce: its observation, reward and end flags (``info`` may hold timings)."""
    return (
        encode_messages(decode_step(step).observation),
        step.get("reward"),
        step.get("terminated"),
        step.get("truncated"),
    )
