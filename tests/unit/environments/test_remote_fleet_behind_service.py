"""Stateful replicas behind one shared address, as in Kubernetes: three real replicas (environment services, sandbox
services) behind a round-robin proxy that sends every request to the next replica, like a ClusterIP Service without
session affinity. With each replica advertising its own address, the client opens episodes and sessions through the
proxy and then talks to the replica that holds them: no episode is replayed or lost. The control, the same fleet
without advertised addresses, shows what the issue reported: episodes moved and abandoned, sessions lost."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from sandbox_checks import sandbox_config

from sharpen.config.environments import CustomEnvironmentConfig
from sharpen.config.sandbox import SandboxConfig
from sharpen.config.service import RemoteConfig
from sharpen.environments.base import EnvironmentInfraError, EpisodeContext, StepResult
from sharpen.environments.registry import build_environment_factory
from sharpen.environments.remote import RemoteEnvironment, RemoteEnvironmentFactory
from sharpen.environments.sandbox import ExecutionStatus, SandboxPool
from sharpen.environments.sandbox.remote import RemoteSandbox
from sharpen.environments.sandbox.service import SandboxService
from sharpen.environments.service import EnvironmentService
from sharpen.types import Example, Message
from support.round_robin_proxy import RoundRobinProxy

TOKEN = "fleet-behind-service-token"
NUM_REPLICAS = 3
NUM_EPISODES = 6
ACTIONS = ["a", "b", "c", "d"]
EXAMPLE = Example(task_key="count/0", prompt=(Message(role="user", content="Count."),), answer="")
ECHO_UPPER = "import sys\nfor line in sys.stdin: print(line.upper(), end='', flush=True)"


class SeededCountEnvironment:
    """Each observation holds a draw of the episode's rng and the turn: a replayed or misplaced step would show."""

    name, version = "seeded_count", "1"

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        self.rng, self.turn = ctx.rng, 0
        return [*example.prompt, Message(role="user", content=f"start {self.rng.randint(1, 10**6)}")]

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        content = f"turn {self.turn}: {action} {self.rng.randint(1, 10**6)}"
        return StepResult(observation=[Message(role="user", content=content)], reward=float(self.turn))


def _config(**settings: Any) -> CustomEnvironmentConfig:
    return CustomEnvironmentConfig(factory=f"{__file__}:SeededCountEnvironment", max_turns=len(ACTIONS), **settings)


@pytest.fixture(autouse=True)
def token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", TOKEN)


def _advertise_own_urls(replicas: list[Any]) -> None:
    """What the chart does with each pod's IP: every replica advertises the address it listens on."""
    for replica in replicas:
        replica.advertise_url = replica.url


async def _play(environment: RemoteEnvironment, seed: int) -> list[Any]:
    ctx = EpisodeContext(seed=seed, sample_index=0, max_turns=len(ACTIONS), max_tokens=1000)
    transcript: list[Any] = [await environment.reset(EXAMPLE, ctx)]
    for action in ACTIONS:
        result = await environment.step(action)
        transcript.append((result.observation, result.reward))
    return transcript


def _play_episodes(factory: RemoteEnvironmentFactory) -> tuple[list[RemoteEnvironment], list[Any]]:
    """NUM_EPISODES episodes at once; their transcripts, or the EnvironmentInfraError of each that abstained."""
    environments = [factory() for _ in range(NUM_EPISODES)]

    async def play_all() -> list[Any]:
        plays = (_play(environment, seed) for seed, environment in enumerate(environments))
        return await asyncio.gather(*plays, return_exceptions=True)

    return environments, asyncio.run(play_all())


@pytest.fixture
def environment_fleet() -> Iterator[list[EnvironmentService]]:
    with ExitStack() as stack:
        yield [
            stack.enter_context(EnvironmentService(_config(), sandbox=SandboxConfig(), token=TOKEN))
            for _ in range(NUM_REPLICAS)
        ]


def test_episodes_through_a_round_robin_service_are_never_replayed_or_lost(
    environment_fleet: list[EnvironmentService],
) -> None:
    _advertise_own_urls(environment_fleet)
    with RoundRobinProxy([s.url for s in environment_fleet]) as proxy:
        factory = RemoteEnvironmentFactory(RemoteConfig(urls=[proxy.url], backoff_s=0.01))
        environments, transcripts = _play_episodes(factory)
        factory.close()
    lost = [t for t in transcripts if isinstance(t, BaseException)]
    assert lost == [], "0 episodes lost"
    assert sum(e.num_moves for e in environments) == 0, "0 episodes replayed"
    local = build_environment_factory(_config())
    expected = [asyncio.run(_play(local(), seed)) for seed in range(NUM_EPISODES)]  # type: ignore[arg-type]
    assert transcripts == expected
    # The proxy spread the episodes over every replica, and no step went through it.
    assert {backend for (backend, path) in proxy.num_requests if path == "/v1/episodes"} == set(proxy.backends)
    assert proxy.paths_served("/v1/episodes/") == 0
    assert {e.replica_url for e in environments} == {s.url for s in environment_fleet}
    assert all(s.num_open == 0 for s in environment_fleet), "every episode ended where it ran"


def test_without_advertised_addresses_the_service_moves_and_loses_episodes(
    environment_fleet: list[EnvironmentService],
) -> None:
    with RoundRobinProxy([s.url for s in environment_fleet]) as proxy:
        factory = RemoteEnvironmentFactory(RemoteConfig(urls=[proxy.url], backoff_s=0.01))
        environments, transcripts = _play_episodes(factory)
        factory.close()
    num_lost = sum(isinstance(t, EnvironmentInfraError) for t in transcripts)
    num_replayed = sum(e.num_moves for e in environments)
    assert num_replayed > 0 and num_lost > 0, (num_replayed, num_lost)
    assert all(e.replica_url == proxy.url for e in environments)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make system-deps)")
@pytest.mark.parametrize("is_advertised", [True, False])
def test_relay_sessions_through_a_round_robin_service(is_advertised: bool) -> None:
    config = sandbox_config(backend="bwrap", max_concurrency=2)
    with ExitStack() as stack:
        replicas = []
        for _ in range(NUM_REPLICAS):
            pool = stack.enter_context(SandboxPool(config))
            replicas.append(stack.enter_context(SandboxService(config, pool=pool, token=TOKEN)))
        if is_advertised:
            _advertise_own_urls(replicas)
        proxy = stack.enter_context(RoundRobinProxy([s.url for s in replicas]))
        client_config = SandboxConfig(backend="remote", remote=RemoteConfig(urls=[proxy.url], backoff_s=0.01))
        remote = stack.enter_context(RemoteSandbox(client_config))
        sessions = [remote.open_python_session(ECHO_UPPER) for _ in range(NUM_REPLICAS)]
        answers = []
        for i, session in enumerate(sessions):
            for word in (b"one", b"two", b"three"):
                is_sent = session.send(b"%d %s" % (i, word), timeout=60)
                answers.append(
                    session.receive(timeout=60) if is_sent else None
                )  # a loaded machine starts python slowly
        results = [session.close(grace_seconds=0.0) for session in sessions]
    if is_advertised:
        assert answers == [b"%d %s" % (i, w) for i in range(NUM_REPLICAS) for w in (b"ONE", b"TWO", b"THREE")]
        assert all(r.status != ExecutionStatus.SANDBOX_ERROR for r in results), [r.detail for r in results]
        assert proxy.paths_served("/v1/sessions/") == 0, "every relay call went to its session's replica"
    else:
        assert any(r.status == ExecutionStatus.SANDBOX_ERROR and "lost" in r.detail for r in results)
