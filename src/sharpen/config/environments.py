"""Environment sections of the config: which `Environment` runs the episodes, and the limits of an episode.

Pydantic only (no torch / vllm / ray). Each environment has its own section chosen by ``type``; limits that the
episode loop enforces (turns, tokens, wall clock) are common to all of them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from sharpen.config.browser import BrowserEnvironmentConfig
from sharpen.config.episodes import EpisodeLimitsSection, ToolParserName
from sharpen.config.section import Section


class SingleTurnEnvironmentConfig(Section):
    type: Literal["single_turn"] = "single_turn"


class ToolSection(EpisodeLimitsSection):
    max_turns: int = Field(default=4, ge=1)
    """Policy turns per episode (each turn's token limit is rollout.max_new_tokens)."""
    tool_parser: ToolParserName = "hermes"
    """How tool calls are read from a turn: ``hermes``, ``<tool_call>{json}</tool_call>`` blocks (Hermes, Qwen 2.5/3);
    ``json``, a turn that is one JSON object with ``name`` and ``parameters``; ``llama3_json`` (Llama 3.1-3.3),
    ``qwen3_coder``, ``mistral``, ``harmony`` (gpt-oss): those families' formats; ``auto``, the format the model's
    chat template renders (hermes for a template without tool calls, such as SmolLM2's). The tool instructions in
    the system prompt show the chosen format."""
    max_tool_calls: int = Field(default=4, ge=1)
    """Tool calls per episode; one more ends the episode (truncated)."""
    max_output_chars: int = Field(default=2000, ge=1)
    """Characters of a tool's output shown to the policy; the rest is cut with a note."""


class CalculatorEnvironmentConfig(ToolSection):
    type: Literal["calculator"] = "calculator"


class PythonEnvironmentConfig(ToolSection):
    """The policy's programs run in the run's sandbox (the top-level ``[sandbox]`` section)."""

    type: Literal["python"] = "python"


class TerminalEnvironmentConfig(ToolSection):
    """A persistent bash shell in the run's sandbox per episode (``run_command`` tool calls), on the in-house chores
    of `sharpen.environments.terminal_tasks`, each graded by its checker (1 solved, 0 not). The shell's sandbox
    session lives at most ``sandbox.wall_seconds``: keep that at least this section's ``wall_seconds``."""

    type: Literal["terminal"] = "terminal"
    max_turns: int = Field(default=8, ge=1)
    """Policy turns per episode (each turn's token limit is rollout.max_new_tokens)."""
    max_tool_calls: int = Field(default=16, ge=1)
    """Commands per episode; one more ends the episode (truncated)."""
    command_timeout_seconds: float = Field(default=10.0, gt=0.0)
    """Wall-clock limit of one command; at the limit its process group is killed and the shell is kept."""
    tasks: list[str] = Field(default_factory=list[str])
    """Task names for ``data.type = "environment"`` (`TERMINAL_TASKS`); tasks cycle through them, each with its own
    seed. Empty: every task of the set."""
    instructions: str = (
        "You work in a Linux bash shell, in a directory that holds the task's files. Run one command per tool call "
        "with run_command; the working directory and the files persist between commands, and commands cannot read "
        "from stdin. When the task is done, reply with a short summary and no tool call."
    )
    """The start of every episode's system prompt (the tool's description follows)."""


class RepositoryEnvironmentConfig(ToolSection):
    """A repository task per episode (a real package with a planted bug, `sharpen tasks build`): the policy fixes
    it with ``read_file``, ``search``, ``edit_file``, ``run_tests`` and ``run_command`` in a shell whose workspace is
    its own copy of the task's snapshot; graded outside the shell by the package's own tests with the test files
    restored (1: the failing tests pass and the rest still do, else 0). Like ``terminal``: keep
    ``sandbox.wall_seconds`` at least this section's ``wall_seconds``."""

    type: Literal["repository"] = "repository"
    max_turns: int = Field(default=16, ge=1)
    """Policy turns per episode (each turn's token limit is rollout.max_new_tokens)."""
    max_tool_calls: int = Field(default=32, ge=1)
    """Tool calls per episode; one more ends the episode (truncated)."""
    max_output_chars: int = Field(default=4000, ge=1)
    """Characters of a tool's output shown to the policy (its head and tail)."""
    command_timeout_seconds: float = Field(default=30.0, gt=0.0)
    """Wall-clock limit of one tool call (a test run included); at the limit its process group is killed."""
    tasks_dir: str = ".sharpen-tasks/h11-0.16.0-seed0"
    """The task set folder (`sharpen tasks build`; ``make tasks`` builds this default one)."""
    task_ids: list[str] = Field(default_factory=list[str])
    """Task ids of the set for ``data.type = "environment"``; tasks cycle through them. Empty: every task."""
    instructions: str = (
        "You work at the root of a Python repository with a bug. Find it with search and read_file, fix it with "
        "edit_file (old_string must match the file exactly, indentation included), and check the fix with "
        "run_tests. Paths are relative to the repository's root. run_command runs a bash command; the files "
        "persist between calls. Fix the source, not the tests: the tests are restored before grading. When done, "
        "reply with a short summary and no tool call."
    )
    """The start of every episode's system prompt (the tool's description follows)."""


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


class TextArenaEnvironmentConfig(EpisodeLimitsSection):
    """A textarena game, played as text (needs ``pip install 'sharpen[agents]'``): the policy is one player, a
    scripted opponent the other in a two-player game; the reward is the game's outcome for the policy's player."""

    type: Literal["textarena"] = "textarena"
    max_turns: int = Field(default=16, ge=1)
    """Moves of the policy per episode (the game's own move limit may end it sooner)."""
    env_id: str = "GuessTheNumber-v0"
    """A registered textarena game (``textarena.envs.registration.ENV_REGISTRY``). Word games (Wordle, Hangman, ...)
    need NLTK's word lists downloaded first."""
    num_players: Literal[1, 2] = 1
    """Players of the game: 1, or 2 with the scripted opponent."""
    policy_player: int = Field(default=0, ge=0, le=1)
    """Which player the policy is (0 moves first in most games)."""
    opponent: str = "random"
    """The other player of a two-player game: ``random`` (one of the bracketed moves the game last listed, drawn
    with the episode's seed) or ``path/to/file.py:function`` / ``package.module:function``, called as
    ``function(observation, rng) -> move``."""
    instructions: str = ""
    """The system prompt of every episode (the game's own rules are its first user message)."""

    @model_validator(mode="after")
    def _check_player(self) -> TextArenaEnvironmentConfig:
        if self.policy_player >= self.num_players:
            raise ValueError(
                f"policy_player = {self.policy_player} is not a player of a {self.num_players}-player game"
            )
        return self


class VerifiersEnvironmentConfig(EpisodeLimitsSection):
    """An environment of the ``verifiers`` package (the format of its environment hub), run by verifiers' own code:
    its agents call the policy through sharpen's agent endpoint, which trains on the exact tokens, and its tasks'
    rewards score the episode (needs ``pip install 'sharpen[agents]'``). The sampling is the run's."""

    type: Literal["verifiers"] = "verifiers"
    max_turns: int = Field(default=8, ge=1)
    """Model calls per episode (each call's token limit is rollout.max_new_tokens)."""
    taskset: str = ""
    """The environment: an installed verifiers taskset package, by id (``gsm8k-v1`` imports ``gsm8k_v1``; a hub id
    ``owner/name@version`` imports ``name``). Exactly one of taskset and factory."""
    env_config: dict[str, Any] = Field(default_factory=dict)
    """The rest of verifiers' ``[env]`` block, as its TOML takes it: the taskset's own settings under ``taskset``
    (e.g. ``{taskset = {split = "test"}}``), ``id`` to pair a verifiers Env with the taskset, a seat's settings under
    its name (``agent`` for a single seat: ``{agent = {runtime = {type = "docker"}}}``)."""
    harness: str | None = "null"
    """The program of seats that pin none, for tasksets that bundle none: ``null`` (verifiers' chat loop, with the
    task's MCP tools), ``bash`` (adds shell and file-edit tools, run on this host), None: verifiers' default (bash)."""
    factory: str | None = None
    """Instead of taskset: ``path/to/file.py:function`` or ``package.module:function`` that returns a verifiers
    ``Env``, called with ``kwargs`` (its seats' runtimes and harnesses are its own)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the factory."""

    @model_validator(mode="after")
    def _check_source(self) -> VerifiersEnvironmentConfig:
        if bool(self.taskset) == (self.factory is not None):
            raise ValueError("a verifiers environment needs exactly one of taskset and factory")
        if self.factory is None and self.kwargs:
            raise ValueError("kwargs are the factory's; a taskset takes its settings in env_config.taskset")
        return self


class CustomEnvironmentConfig(EpisodeLimitsSection):
    type: Literal["custom"] = "custom"
    max_turns: int = Field(default=16, ge=1)
    """Policy turns per episode; an agent's model calls count as turns. 16 by default, so that an agent or a
    multi-turn environment written from the docs runs its turns (an environment that ends after one turn is not
    affected); a refused call ends its episode as truncated (``rollout/truncated_fraction``)."""
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
    | TerminalEnvironmentConfig
    | RepositoryEnvironmentConfig
    | GuessNumberEnvironmentConfig
    | GymnasiumEnvironmentConfig
    | TextArenaEnvironmentConfig
    | VerifiersEnvironmentConfig
    | CustomEnvironmentConfig
    | BrowserEnvironmentConfig,
    Field(discriminator="type"),
]
