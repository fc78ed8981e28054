"""The `Environment` contract: what the episode loop drives, one instance per episode.

Owns the protocol and its data (`EpisodeContext`, `StepResult`). An environment sees text (the policy's turn) and
answers with messages; it never sees tokens, the engine or the trainer. Token handling (continuity across turns,
loss masks) is the episode loop's (`sharpen.rollout.episodes`), limits are enforced there too, so an environment
stays a few lines: `reset` returns the first observation, `step` judges one action.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from sharpen.types import Example, Message


class EnvironmentInfraError(RuntimeError):
    """Raised by an environment or a tool when a fault is not the policy's (a sandbox that failed, a service that is
    down). Tools' other exceptions are shown to the policy as error messages; this one ends the episode, which then
    abstains (status infra_error) instead of being scored."""


class EnvironmentCodeError(RuntimeError):
    """Every episode of a step failed in the environment's (or agent's) own code: the run stops with the first
    error, instead of training on nothing and exiting 0."""


@dataclass(kw_only=True, slots=True, frozen=True)
class EpisodeLimits:
    """What the episode loop enforces on every episode."""

    max_turns: int = 1
    """Policy turns per episode."""
    max_tokens: int = 1 << 30
    """Completion tokens (generated plus appended) per episode."""
    wall_seconds: float | None = None
    """Wall-clock budget of the environment's side of an episode (reset plus steps)."""


@dataclass(kw_only=True, slots=True)
class EpisodeContext:
    """What an episode may use besides its task: its own seed and the shared sandbox.

    ``seed`` is derived from (run seed, task key, sample index), so an episode is reproduced by its task and sample
    alone; draw randomness from ``rng`` (seeded with it), never from the global ``random`` module."""

    seed: int
    sample_index: int
    max_turns: int
    """Policy turns the episode may take (the loop stops it after this many)."""
    max_tokens: int
    """Completion tokens (generated plus appended) the episode may hold."""
    wall_seconds: float | None = None
    """Wall-clock budget of the environment's side of the episode (None: unbounded)."""
    sandbox: Any = None
    """A `sharpen.environments.sandbox.SandboxPool` for environments that run code (None when not configured)."""
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)


@dataclass(kw_only=True, slots=True)
class StepResult:
    """The environment's answer to one action."""

    observation: list[Message] = field(default_factory=list[Message])
    """Messages appended to the conversation before the policy's next turn (tool results, a user reply). Ignored
    when the episode ends."""
    reward: float | None = None
    """This step's reward; None everywhere means the episode is scored by the run's reward function instead."""
    terminated: bool = False
    """The task is over (solved, failed, answered)."""
    truncated: bool = False
    """The environment cut the episode short (e.g. too many tool calls)."""
    info: dict[str, Any] = field(default_factory=dict[str, Any])
    """JSON-serialisable details, recorded with the episode (tool calls made, sandbox statuses, ...)."""


@runtime_checkable
class Environment(Protocol):
    """A task the policy acts in over one or more turns. Build one instance per episode (a factory is configured
    per run); ``name`` and ``version`` are recorded with every rollout, so bump the version when behaviour changes."""

    name: str
    version: str

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        """Start the episode; return the first observation (the prompt messages, system prompt included)."""
        ...

    async def step(self, action: str) -> StepResult:
        """Take the policy's turn (its text, without the end-of-turn token) and answer it."""
        ...


@dataclass(kw_only=True, slots=True, frozen=True)
class AgentClient:
    """Where an agent sends its model calls: an OpenAI-compatible server (sharpen's agent endpoint) that serves
    only this episode. Pass these to any OpenAI client (``openai.AsyncOpenAI(base_url=..., api_key=...)``) or agent
    framework; the episode loop records every call's exact tokens under ``api_key``."""

    base_url: str
    """Ends in ``/v1``, as the ``openai`` client expects."""
    api_key: str
    """This episode's key: calls made with it are this episode's (an unknown or finished key gets HTTP 401/409)."""
    model: str
    """The model name to send (the endpoint serves the run's policy under this name)."""
    http_client: Any = None
    """This episode's connections to the endpoint (an ``httpx.AsyncClient``, closed when the episode ends)."""

    def openai_client(self) -> Any:
        """An ``openai.AsyncOpenAI`` for this episode on ``http_client`` (a client that builds its own connections
        costs tens of ms to set up, more than a call); it does not retry a call the endpoint refused or lost."""
        import openai  # the agents extra (or any agent framework) brings it; the core install does not

        return openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, http_client=self.http_client, max_retries=0
        )


@dataclass(kw_only=True, slots=True)
class AgentResult:
    """What an agent environment reports when its episode ends."""

    reward: float | None = None
    """The environment's reward of the episode; None: the run's reward function scores it."""
    is_truncated: bool = False
    """The agent stopped short of finishing (a step limit of its own, an error it caught)."""
    stop_reason: str = "terminated"
    info: dict[str, Any] = field(default_factory=dict[str, Any])
    """JSON-serialisable details, recorded with the episode (the agent's own metrics, rubric components)."""


def environment_shape_error(made: object, *, source: str) -> str | None:
    """Why ``made`` (an environment, or its class) is neither an `Environment` nor an `AgentEnvironment`, in one
    line naming ``source`` (where it came from); None when it is one. A class is checked for the methods (its
    ``name`` and ``version`` may be set per instance)."""
    kind = made if isinstance(made, type) else type(made)
    has = {method for method in ("reset", "step", "run_agent") if callable(getattr(kind, method, None))}
    if "run_agent" not in has and not {"reset", "step"} <= has:
        present = f"it has {', '.join(sorted(has))}()" if has else "it has none of them"
        return (
            f"{source}: {kind.__name__} is not an environment: an Environment has async reset() and step(), an "
            f"AgentEnvironment async run_agent(), and {present} (docs/environments.md)"
        )
    if isinstance(made, type):
        return None
    missing = [attribute for attribute in ("name", "version") if not isinstance(getattr(made, attribute, None), str)]
    if missing:
        return f"{source}: {kind.__name__} has no {' or '.join(missing)} (a string each, recorded with every rollout)"
    return None


@runtime_checkable
class AgentEnvironment(Protocol):
    """An episode driven by agent code that calls the model itself, through an OpenAI-compatible client (the other
    way round from `Environment`, whose ``step`` the episode loop calls with each turn). Any agent framework fits:
    it gets ``client`` and runs. The episode loop serves the calls from the run's engine, records their tokens and
    trains on them; the agent never sees tokens. Build one instance per episode, like an `Environment`."""

    name: str
    version: str

    async def run_agent(self, example: Example, ctx: EpisodeContext, client: AgentClient) -> AgentResult:
        """Run the whole episode; every model call goes to ``client``."""
        ...


EnvironmentFactory = Callable[[], Environment | AgentEnvironment]
"""Builds a fresh environment for each episode."""


class SingleTurnEnvironment:
    """The default: the example's prompt, one answer, done. The run's reward function scores it."""

    name = "single_turn"
    version = "1"

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        return list(example.prompt)

    async def step(self, action: str) -> StepResult:
        return StepResult(terminated=True)
