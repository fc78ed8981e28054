"""From config to live environments: the per-episode factory, the episode limits, and environment-made tasks.

Owns the mapping of ``environment.type`` to classes, so orchestration (and `sharpen replay`) build environments the
same way. It does not run episodes.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

from sharpen.config import ConfigError, SharpenConfig
from sharpen.config.browser import BrowserEnvironmentConfig
from sharpen.config.environments import (
    CalculatorEnvironmentConfig,
    CustomEnvironmentConfig,
    EnvironmentConfig,
    GuessNumberEnvironmentConfig,
    GymnasiumEnvironmentConfig,
    PythonEnvironmentConfig,
    RepositoryEnvironmentConfig,
    SingleTurnEnvironmentConfig,
    TerminalEnvironmentConfig,
    TextArenaEnvironmentConfig,
    ToolSection,
    VerifiersEnvironmentConfig,
)
from sharpen.config.episodes import EpisodeLimitsSection
from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.base import (
    EnvironmentFactory,
    EpisodeLimits,
    SingleTurnEnvironment,
    environment_shape_error,
)
from sharpen.environments.browser import BrowserEnvironmentFactory, build_browser_factory, make_browser_tasks
from sharpen.environments.calculator import CalculatorEnvironment
from sharpen.environments.guess_number import GuessNumberEnvironment
from sharpen.environments.gymnasium_adapter import GymnasiumEnvironment
from sharpen.environments.python_tool import PythonEnvironment
from sharpen.environments.remote import RemoteEnvironmentFactory
from sharpen.environments.repository import RepositoryEnvironment, check_session_output
from sharpen.environments.sandbox import Sandbox, SandboxPool
from sharpen.environments.sandbox.remote import RemoteSandbox, RemoteSandboxPool
from sharpen.environments.terminal import TerminalEnvironment
from sharpen.environments.textarena_adapter import TextArenaEnvironment, import_textarena
from sharpen.environments.tool_formats import UnknownToolCallFormatError, parser_for_template, read_chat_template
from sharpen.environments.verifiers_adapter import VerifiersEnvironment, import_verifiers
from sharpen.plugins import PluginLoadError, check_call, load_object
from sharpen.rewards.code_tests import pytest_ro_binds
from sharpen.types import Example


def build_environment_factory(config: EnvironmentConfig, *, model_path: Path | None = None) -> EnvironmentFactory:
    """A callable that builds a fresh environment for each episode (on `sharpen serve-env` replicas when the
    section has ``remote``). ``model_path`` (the policy's folder) gives the chat template that ``tool_parser =
    "auto"`` reads."""
    if isinstance(config, EpisodeLimitsSection) and config.remote is not None:
        return RemoteEnvironmentFactory(config.remote)
    if isinstance(config, ToolSection | BrowserEnvironmentConfig) and config.tool_parser == "auto":
        config = config.model_copy(update={"tool_parser": resolve_tool_parser(model_path)})
    match config:
        case SingleTurnEnvironmentConfig():
            return SingleTurnEnvironment
        case CalculatorEnvironmentConfig():
            return partial(
                CalculatorEnvironment,
                parser=config.tool_parser,
                max_tool_calls=config.max_tool_calls,
                max_output_chars=config.max_output_chars,
            )
        case PythonEnvironmentConfig():
            return partial(
                PythonEnvironment,
                parser=config.tool_parser,
                max_tool_calls=config.max_tool_calls,
                max_output_chars=config.max_output_chars,
            )
        case TerminalEnvironmentConfig():
            TerminalEnvironment.make_tasks(0, seed=0, tasks=config.tasks)  # an unknown task name: one error now
            return partial(TerminalEnvironment, **_shell_options(config))
        case RepositoryEnvironmentConfig():
            RepositoryEnvironment.make_tasks(0, seed=0, tasks_dir=config.tasks_dir, task_ids=config.task_ids)
            return partial(RepositoryEnvironment, tasks_dir=config.tasks_dir, **_shell_options(config))
        case GuessNumberEnvironmentConfig():
            return partial(GuessNumberEnvironment, low=config.low, high=config.high)
        case CustomEnvironmentConfig():
            factory = load_object(config.factory, what="environment.factory")
            if isinstance(factory, type):  # a class: its shape is known before any episode (a function's is not)
                error = environment_shape_error(factory, source=f"environment.factory = {config.factory!r}")
                if error is not None:
                    raise ConfigError(error)
            return partial(factory, **config.kwargs)
        case GymnasiumEnvironmentConfig():
            return partial(
                GymnasiumEnvironment,
                config.env_id,
                env_kwargs=config.env_kwargs,
                action_names=config.action_names,
                instructions=config.instructions,
            )
        case TextArenaEnvironmentConfig():
            import_textarena()  # a missing extra or an opponent that does not load: one error now, not per episode
            factory = partial(
                TextArenaEnvironment,
                config.env_id,
                num_players=config.num_players,
                policy_player=config.policy_player,
                opponent=config.opponent,
                instructions=config.instructions,
            )
            factory()
            return factory
        case VerifiersEnvironmentConfig():
            import_verifiers()
            return partial(VerifiersEnvironment, **_verifiers_arguments(config))
        case BrowserEnvironmentConfig():
            return build_browser_factory(config)


def _shell_options(config: TerminalEnvironmentConfig | RepositoryEnvironmentConfig) -> dict[str, Any]:
    """What a shell environment (terminal, repository) takes from its section besides its tasks."""
    return {
        "parser": config.tool_parser,
        "max_tool_calls": config.max_tool_calls,
        "max_output_chars": config.max_output_chars,
        "command_timeout_seconds": config.command_timeout_seconds,
        "instructions": config.instructions,
    }


def resolve_tool_parser(model_path: Path | None) -> str:
    """The tool-call parser for ``tool_parser = "auto"``: the format the model's chat template renders."""
    if model_path is None:
        raise ConfigError('environment.tool_parser = "auto" needs the model\'s chat template; name the parser here')
    try:
        return parser_for_template(read_chat_template(model_path))
    except UnknownToolCallFormatError as error:
        raise ConfigError(f'environment.tool_parser = "auto" for {model_path}: {error}') from None


def close_environment_factory(factory: EnvironmentFactory) -> None:
    """Release what a factory of `build_environment_factory` holds: a browser pool, a replica client. The others
    (an environment class, a partial of one) hold nothing."""
    if isinstance(factory, BrowserEnvironmentFactory | RemoteEnvironmentFactory):
        factory.close()


def _verifiers_arguments(config: VerifiersEnvironmentConfig) -> dict[str, Any]:
    return {
        "taskset": config.taskset,
        "env_config": config.env_config,
        "factory": config.factory,
        "kwargs": config.kwargs,
        "harness": config.harness,
    }


def build_sandbox(config: EnvironmentConfig, sandbox: SandboxConfig) -> SandboxPool | RemoteSandboxPool | None:
    """The pool of ``sandbox`` (the run's [sandbox] section) for environments that run code (probed now: a host
    without the isolation the config asks for fails here, before anything slow starts; with ``backend = "remote"``
    a replica is asked), else None. The caller closes it."""
    if isinstance(config, RepositoryEnvironmentConfig):  # the policy and the grader run the package's tests
        sandbox = _with_pytest(sandbox)
        check_session_output(  # refused here, in one line, when an episode's worst case overflows its shell
            tasks_dir=config.tasks_dir,
            max_turns=config.max_turns,
            max_tool_calls=config.max_tool_calls,
            max_output_chars=config.max_output_chars,
            max_output_bytes=sandbox.max_output_bytes,
        )
    # remote: the replicas run the code
    runs_code = isinstance(config, PythonEnvironmentConfig | TerminalEnvironmentConfig | RepositoryEnvironmentConfig)
    if runs_code and config.remote is None:
        return RemoteSandboxPool(sandbox) if sandbox.backend == "remote" else SandboxPool(sandbox)
    return None


def sandbox_for_run(config: SharpenConfig) -> SandboxConfig:
    """The run's [sandbox] as the sandbox that runs the run's code needs it, wherever that sandbox is (this process,
    `sharpen serve-sandbox` replicas, a sandbox fleet): pytest bound read-only (`pytest_ro_binds`) when HumanEval's
    checker or the repository environment's shell and grader run pytest in it. A replica serves what this returns;
    a client's own binds do nothing on ``backend = "remote"``."""
    if config.data.type == "humaneval" or isinstance(config.environment, RepositoryEnvironmentConfig):
        return _with_pytest(config.sandbox)
    return config.sandbox


def _with_pytest(sandbox: SandboxConfig) -> SandboxConfig:
    binds = [bind for bind in pytest_ro_binds() if bind not in sandbox.extra_ro_binds]
    return sandbox.model_copy(update={"extra_ro_binds": [*sandbox.extra_ro_binds, *binds]})


def open_sandbox(sandbox: SandboxConfig) -> Sandbox | RemoteSandbox:
    """A `Sandbox` of the [sandbox] section (code-test rewards), or its client when ``backend = "remote"``. The
    caller closes it."""
    return RemoteSandbox(sandbox) if sandbox.backend == "remote" else Sandbox(sandbox)


def episode_limits(config: EnvironmentConfig) -> EpisodeLimits:
    if isinstance(config, SingleTurnEnvironmentConfig):
        return EpisodeLimits()
    return EpisodeLimits(
        max_turns=config.max_turns, max_tokens=config.max_episode_tokens, wall_seconds=config.wall_seconds
    )


def environment_tasks(config: EnvironmentConfig, *, size: int, seed: int) -> list[Example]:
    """Tasks generated by environments that make their own (``data.type = "environment"``)."""
    match config:
        case GuessNumberEnvironmentConfig():
            return GuessNumberEnvironment.make_tasks(size, seed=seed, low=config.low, high=config.high)
        case GymnasiumEnvironmentConfig():
            return GymnasiumEnvironment.make_tasks(
                size, seed=seed, env_id=config.env_id, instructions=config.instructions
            )
        case TextArenaEnvironmentConfig():
            return TextArenaEnvironment.make_tasks(
                size, seed=seed, env_id=config.env_id, instructions=config.instructions
            )
        case VerifiersEnvironmentConfig():
            return VerifiersEnvironment(**_verifiers_arguments(config)).make_tasks(size)
        case BrowserEnvironmentConfig():
            return make_browser_tasks(config, size=size, seed=seed)
        case TerminalEnvironmentConfig():
            return TerminalEnvironment.make_tasks(size, seed=seed, tasks=config.tasks)
        case RepositoryEnvironmentConfig():
            return RepositoryEnvironment.make_tasks(
                size, seed=seed, tasks_dir=config.tasks_dir, task_ids=config.task_ids
            )
        case CustomEnvironmentConfig(tasks=str(tasks)):
            return custom_tasks(tasks, size=size, seed=seed)
        case _:
            raise ValueError(f"environment {config.type!r} does not make its own tasks; configure a data source")


def custom_tasks(spec: str, *, size: int, seed: int) -> list[Example]:
    """The tasks of a user's task function (``environment.tasks``), checked: it is called ``(num_tasks, seed=...)``
    and returns `Example`s, else one `PluginLoadError` naming what is wrong, before any engine starts."""
    what = f"environment.tasks = {spec!r}"
    make = check_call(load_object(spec, what="environment.tasks"), ("num_tasks",), {"seed": seed}, what=what)
    made = make(size, seed=seed)
    if isinstance(made, str | bytes | dict) or not isinstance(made, Iterable):
        raise PluginLoadError(f"{what} returned one {type(made).__name__}, not a list of sharpen.types.Example")
    examples = list(made)
    for index, example in enumerate(examples):
        if not isinstance(example, Example):
            raise PluginLoadError(
                f"{what}: item {index} is a {type(example).__name__}, not a sharpen.types.Example "
                "(task_key, prompt messages, answer, metadata)"
            )
    if not examples:
        raise PluginLoadError(f"{what} returned no tasks for num_tasks={size}")
    return examples


EnvironmentLoadError = PluginLoadError
"""The error of a custom environment (or task function) that cannot be loaded, under its earlier name; new code
catches `sharpen.plugins.PluginLoadError`, which custom rewards raise too."""
