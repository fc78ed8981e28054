"""Environment sections of the config: which `Environment` runs the episodes, and the limits of an episode.

Pydantic only (no torch / vllm / ray). Each environment has its own section chosen by ``type``; limits that the
episode loop enforces (turns, tokens, wall clock) are common to all of them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from sharpen.config.section import Section


class EpisodeLimitsSection(Section):
    max_turns: int = Field(default=1, ge=1)
    """Policy turns per episode (each turn's token limit is rollout.max_new_tokens)."""
    max_episode_tokens: int = Field(default=1024, ge=1)
    """Completion tokens per episode, generated plus appended by the environment (keep prompt + this within the
    engine's max_model_len)."""
    wall_seconds: float | None = Field(default=120.0, gt=0.0)
    """Wall-clock budget of the environment's side of one episode (its reset and steps); an episode that exceeds
    it ends and abstains (status timeout). None: unbounded."""


class SingleTurnEnvironmentConfig(Section):
    type: Literal["single_turn"] = "single_turn"


class ToolSection(EpisodeLimitsSection):
    max_turns: int = Field(default=4, ge=1)
    """Policy turns per episode (each turn's token limit is rollout.max_new_tokens)."""
    tool_parser: Literal["hermes", "json"] = "hermes"
    """How tool calls are read from a turn: ``<tool_call>{json}</tool_call>`` blocks (Hermes, Qwen) or a turn that
    is one JSON object with ``name`` and ``parameters`` (Llama 3)."""
    max_tool_calls: int = Field(default=4, ge=1)
    """Tool calls per episode; one more ends the episode (truncated)."""
    max_output_chars: int = Field(default=2000, ge=1)
    """Characters of a tool's output shown to the policy; the rest is cut with a note."""


class CalculatorEnvironmentConfig(ToolSection):
    type: Literal["calculator"] = "calculator"


class PythonEnvironmentConfig(ToolSection):
    """The policy's programs run in the run's sandbox (the top-level ``[sandbox]`` section)."""

    type: Literal["python"] = "python"


class GuessNumberEnvironmentConfig(EpisodeLimitsSection):
    type: Literal["guess_number"] = "guess_number"
    max_turns: int = Field(default=6, ge=1)
    """Guesses per game."""
    low: int = 1
    """Smallest secret number."""
    high: int = 16
    """Largest secret number."""


class GymnasiumEnvironmentConfig(EpisodeLimitsSection):
    type: Literal["gymnasium"] = "gymnasium"
    max_turns: int = Field(default=16, ge=1)
    """Actions per episode."""
    env_id: str = "FrozenLake-v1"
    """A registered gymnasium environment with a discrete action space."""
    env_kwargs: dict[str, Any] = Field(default_factory=lambda: {"is_slippery": False})
    """Keyword arguments of ``gymnasium.make``."""
    action_names: list[str] = Field(default_factory=lambda: ["left", "down", "right", "up"])
    """Names the policy may use for the actions, in action-index order (empty: indices only)."""
    instructions: str = (
        "You walk on a frozen lake from S to the goal G; H is a hole. Your position is in brackets. "
        "Reply with one move: left, down, right or up."
    )
    """The system prompt of every episode."""


class CustomEnvironmentConfig(EpisodeLimitsSection):
    type: Literal["custom"] = "custom"
    factory: str
    """Your environment: ``path/to/file.py:ClassName`` or ``package.module:ClassName`` (a class or function that
    returns a fresh `Environment`), called with ``kwargs`` once per episode."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the factory."""
    tasks: str | None = None
    """For ``data.type = "environment"``: a function ``(num_tasks, *, seed) -> list[Example]``, named like factory."""


EnvironmentConfig = Annotated[
    SingleTurnEnvironmentConfig
    | CalculatorEnvironmentConfig
    | PythonEnvironmentConfig
    | GuessNumberEnvironmentConfig
    | GymnasiumEnvironmentConfig
    | CustomEnvironmentConfig,
    Field(discriminator="type"),
]
