"""Environments over HTTP (`sharpen serve-env` services in this process): episodes give the same observations and
rewards as in-process, a lost replica or an expired episode is replayed on another and goes on, an episode that does
not replay identically abstains, and the token is required."""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from sharpen.config.environments import CustomEnvironmentConfig, GuessNumberEnvironmentConfig, PythonEnvironmentConfig
from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.base import Environment, EnvironmentInfraError, EpisodeContext, StepResult
from sharpen.environments.registry import build_environment_factory, build_sandbox
from sharpen.environments.remote import RemoteEnvironment, RemoteEnvironmentFactory
from sharpen.environments.service import EnvironmentService
from sharpen.plugins import load_object
from sharpen.types import Example, Message

TOKEN = "remote-env-test-token"
EXAMPLE = Example(task_key="dice/0", prompt=(Message(role="user", content="Roll."),), answer="7")
ACTIONS = ["3", "5", "hold", "7", "1"]


class SeededDiceEnvironment:
    """Observations and rewards drawn from the episode's rng: equal only if the seed travels and nothing repeats."""

    name, version = "seeded_dice", "3"

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        self.rng, self.max_turns, self.turn = ctx.rng, ctx.max_turns, 0
        return [*example.prompt, Message(role="user", content=f"first roll {self.rng.randint(1, 1000)}")]

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        roll = self.rng.randint(1, 1000)
        content = f"turn {self.turn}: you said {action!r}, roll {roll}"
        return StepResult(observation=[Message(role="user", content=content)], reward=roll / 1000, info={"roll": roll})


class UnseededEnvironment(SeededDiceEnvironment):
    """Breaks the contract: its draws come from the global generator, so a replay differs."""

    async def step(self, action: str) -> StepResult:
        return StepResult(observation=[Message(role="user", content=str(random.random()))], reward=0.0)


class SlowEnvironment(SeededDiceEnvironment):
    """Its steps take longer than any episode's wall clock in these tests; ``num_cancelled`` counts steps cut off."""

    num_cancelled = 0

    async def step(self, action: str) -> StepResult:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            SlowEnvironment.num_cancelled += 1
            raise
        return StepResult()


def _config(cls: type, **settings: Any) -> CustomEnvironmentConfig:
    return CustomEnvironmentConfig(factory=f"{__file__}:{cls.__name__}", max_turns=len(ACTIONS), **settings)


def _serve(stack: ExitStack, config: Any) -> EnvironmentService:
    return stack.enter_context(EnvironmentService(config, sandbox=SandboxConfig(), token=TOKEN))


def _context(seed: int) -> EpisodeContext:
    return EpisodeContext(seed=seed, sample_index=0, max_turns=len(ACTIONS), max_tokens=1000)


async def _play(environment: Environment, seed: int, *, between: Any = None) -> list[Any]:
    transcript: list[Any] = [await environment.reset(EXAMPLE, _context(seed))]
    for turn, action in enumerate(ACTIONS):
        if between is not None:
            between(turn)
        result = await environment.step(action)
        transcript.append((result.observation, result.reward, result.terminated, result.truncated, result.info))
        if result.terminated or result.truncated:  # the episode loop steps an ended episode no further
            break
    return transcript


@pytest.fixture(autouse=True)
def token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", TOKEN)


@pytest.fixture
def two_replicas() -> Iterator[list[EnvironmentService]]:
    with ExitStack() as stack:
        yield [_serve(stack, _config(SeededDiceEnvironment)) for _ in range(2)]


def test_an_episode_over_http_is_the_in_process_episode(two_replicas: list[EnvironmentService]) -> None:
    config = _config(SeededDiceEnvironment, remote={"urls": [s.url for s in two_replicas]})
    remote = build_environment_factory(config)
    local = build_environment_factory(_config(SeededDiceEnvironment))
    assert isinstance(remote, RemoteEnvironmentFactory)
    assert (remote.name, remote.version) == ("seeded_dice", "3")
    for seed in (0, 1, 12345):
        assert asyncio.run(_play(remote(), seed)) == asyncio.run(_play(local(), seed))  # type: ignore[arg-type]
    assert all(s.num_open == 0 for s in two_replicas), "an episode is forgotten after its last turn"
    remote.close()


def test_a_real_environment_type_gives_the_same_game(two_replicas: list[EnvironmentService]) -> None:
    with ExitStack() as stack:
        service = _serve(stack, GuessNumberEnvironmentConfig())
        remote = build_environment_factory(GuessNumberEnvironmentConfig(remote={"urls": [service.url]}))
        local = build_environment_factory(GuessNumberEnvironmentConfig())
        assert asyncio.run(_play(remote(), 3)) == asyncio.run(_play(local(), 3))  # type: ignore[arg-type]
        remote.close()  # type: ignore[attr-defined]


def test_a_lost_replica_mid_episode_is_replayed_on_another(two_replicas: list[EnvironmentService]) -> None:
    factory = RemoteEnvironmentFactory(
        _config(SeededDiceEnvironment, remote={"urls": [s.url for s in two_replicas]}).remote
    )  # type: ignore[arg-type]
    environment = factory()
    holder: list[EnvironmentService] = []

    def lose_the_replica(turn: int) -> None:
        if turn == 3:
            holder.extend(s for s in two_replicas if s.url == environment.replica_url)
            holder[0].close()

    moved = asyncio.run(_play(environment, 7, between=lose_the_replica))
    local = build_environment_factory(_config(SeededDiceEnvironment))()
    assert moved == asyncio.run(_play(local, 7))  # type: ignore[arg-type]
    assert environment.num_moves == 1 and holder
    factory.close()


def test_an_expired_episode_is_replayed_and_goes_on() -> None:
    with ExitStack() as stack:
        service = _serve(stack, _config(SeededDiceEnvironment, service={"idle_seconds": 0.3}))
        factory = RemoteEnvironmentFactory(_config(SeededDiceEnvironment, remote={"urls": [service.url]}).remote)  # type: ignore[arg-type]
        environment = factory()

        def idle(turn: int) -> None:
            if turn == 2:
                _wait_for(lambda: "sharpen_open_episodes 0" in httpx.get(service.url + "/metrics").text)

        transcript = asyncio.run(_play(environment, 11, between=idle))
        local = build_environment_factory(_config(SeededDiceEnvironment))()
        assert transcript == asyncio.run(_play(local, 11))  # type: ignore[arg-type]
        assert environment.num_moves == 1
        factory.close()


def test_an_episode_that_does_not_replay_abstains() -> None:
    with ExitStack() as stack:
        service = _serve(stack, _config(UnseededEnvironment, service={"idle_seconds": 0.3}))
        factory = RemoteEnvironmentFactory(_config(UnseededEnvironment, remote={"urls": [service.url]}).remote)  # type: ignore[arg-type]
        environment: RemoteEnvironment = factory()

        def idle(turn: int) -> None:
            if turn == 2:
                _wait_for(lambda: "sharpen_open_episodes 0" in httpx.get(service.url + "/metrics").text)

        with pytest.raises(EnvironmentInfraError, match="did not replay"):
            asyncio.run(_play(environment, 5, between=idle))
        factory.close()


def test_the_token_is_required(two_replicas: list[EnvironmentService], monkeypatch: pytest.MonkeyPatch) -> None:
    url = two_replicas[0].url
    assert httpx.post(url + "/v1/episodes", json={}).status_code == 401
    assert httpx.get(url + "/readyz").status_code == 200
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", "wrong")
    with pytest.raises(RuntimeError, match="401"):
        RemoteEnvironmentFactory(_config(SeededDiceEnvironment, remote={"urls": [url]}).remote)  # type: ignore[arg-type]


def _wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_messages_with_images_cross_the_wire_unchanged() -> None:
    from sharpen.environments.wire import decode_messages, encode_messages
    from sharpen.types import ImagePart, TextPart

    messages = [
        Message(role="user", content="plain"),
        Message(
            role="user", content=(TextPart(text="look:"), ImagePart(data=b"\x89PNG\x00\xff"), ImagePart(path="/a.png"))
        ),
    ]
    assert decode_messages(httpx.Response(200, json=encode_messages(messages)).json()) == messages


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make system-deps)")
def test_a_code_environment_runs_its_programs_in_the_servers_sandbox() -> None:
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    with ExitStack() as stack:
        server_sandbox = SandboxConfig(backend="bwrap", wall_seconds=5.0)
        service = stack.enter_context(
            EnvironmentService(PythonEnvironmentConfig(), sandbox=server_sandbox, token=TOKEN)
        )
        config = PythonEnvironmentConfig(remote={"urls": [service.url]})
        assert build_sandbox(config, SandboxConfig()) is None, "the client needs no sandbox of its own"
        factory = build_environment_factory(config)
        environment = factory()

        async def play() -> StepResult:
            await environment.reset(EXAMPLE, EpisodeContext(seed=0, sample_index=0, max_turns=4, max_tokens=99))
            return await environment.step(call)

        result = asyncio.run(play())
        factory.close()  # type: ignore[attr-defined]
    assert result.observation == [Message(role="tool", content="status: ok\nstdout:\n42")]


def test_the_episode_loop_gets_the_same_rollouts_from_a_remote_environment() -> None:
    from sharpen.environments.base import EpisodeLimits
    from sharpen.environments.guess_number import GuessNumberEnvironment
    from sharpen.rollout.engines.scripted import ScriptedEngine
    from sharpen.rollout.episodes import EpisodeRunner
    from sharpen.testing import ByteChatTokenizer
    from sharpen.types import SamplingParams

    tokenizer = ByteChatTokenizer()
    examples = GuessNumberEnvironment.make_tasks(3, seed=4, low=1, high=8)
    guesses = [f"I guess {g}" for g in range(1, 9)]

    def rollouts(make_environment: Any) -> list[Any]:
        engine = ScriptedEngine(guesses, encode=tokenizer.encode, eos_token_id=tokenizer.eos_token_id)
        limits = EpisodeLimits(max_turns=8)
        # lockstep: the scripted engine hands out its texts in request order, which must not depend on timing
        runner = EpisodeRunner(
            tokenizer=tokenizer, make_environment=make_environment, limits=limits, scheduling="lockstep"
        )
        groups = runner.generate_groups(
            engine, examples, sampling=SamplingParams(max_new_tokens=32), num_samples=2, seed=0
        )
        return [
            (r.prompt_ids, r.completion_ids, r.loss_mask, r.episode.stop_reason, r.episode.seed, r.episode.environment)
            for group in groups
            for r in group.rollouts
        ]

    with ExitStack() as stack:
        service = _serve(stack, GuessNumberEnvironmentConfig(high=8))
        remote = build_environment_factory(GuessNumberEnvironmentConfig(high=8, remote={"urls": [service.url]}))
        assert rollouts(remote) == rollouts(build_environment_factory(GuessNumberEnvironmentConfig(high=8)))
        remote.close()  # type: ignore[attr-defined]


def test_a_step_past_the_episodes_wall_clock_is_cut_off_on_the_server() -> None:
    with ExitStack() as stack:
        service = _serve(stack, _config(SlowEnvironment))
        factory = RemoteEnvironmentFactory(_config(SlowEnvironment, remote={"urls": [service.url]}).remote)  # type: ignore[arg-type]
        environment = factory()
        ctx = EpisodeContext(seed=0, sample_index=0, max_turns=3, max_tokens=100, wall_seconds=0.5)

        async def play() -> StepResult:
            await environment.reset(EXAMPLE, ctx)
            return await environment.step("roll")

        with pytest.raises(EnvironmentInfraError, match="504"):
            asyncio.run(play())
        factory.close()
    served = load_object(f"{__file__}:SlowEnvironment", what="the served class")  # the copy the server loaded
    assert served.num_cancelled == 1
