"""The shipped environments (calculator, guess-the-number, the gymnasium adapter) and the config registry."""

from __future__ import annotations

import asyncio
import re

import pytest

from sharpen.cli.main import EXIT_USER_ERROR, main
from sharpen.config import load_config
from sharpen.config.environments import (
    CalculatorEnvironmentConfig,
    CustomEnvironmentConfig,
    GuessNumberEnvironmentConfig,
    GymnasiumEnvironmentConfig,
    SingleTurnEnvironmentConfig,
)
from sharpen.config.loader import ConfigError
from sharpen.environments import Environment, EpisodeContext, SingleTurnEnvironment
from sharpen.environments.calculator import CalculatorEnvironment, calculate, evaluate_arithmetic
from sharpen.environments.guess_number import GuessNumberEnvironment
from sharpen.environments.gymnasium_adapter import GymnasiumEnvironment
from sharpen.environments.registry import (
    EnvironmentLoadError,
    build_environment_factory,
    environment_tasks,
    episode_limits,
)

CONTEXT = EpisodeContext(seed=7, sample_index=0, max_turns=20, max_tokens=1000)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(12 + 7) * 3", "57"),
        ("2 ** 10", "1024"),
        ("7 / 2", "3.5"),
        ("-7 // 2", "-4"),
        ("10 % 4", "2"),
        ("1.5e2", "150"),
    ],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert asyncio.run(calculate(expression)) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('id')", "unsupported element Call"),
        ("().__class__", "unsupported element Attribute"),
        ("x + 1", "unsupported element Name"),
        ("9 ** 9 ** 9", "exponent"),
        ("1" + "0" * 400, "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 / 0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 600, "longer than"),
        ("True + 1", "unsupported element Constant"),
    ],
)
def test_calculator_refuses_anything_but_bounded_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        evaluate_arithmetic(expression)


def test_guess_number_gives_hints_and_rewards_the_find():
    [example] = GuessNumberEnvironment.make_tasks(1, seed=0, low=1, high=8)
    assert GuessNumberEnvironment.make_tasks(1, seed=0, low=1, high=8) == [example]  # tasks are seeded
    secret = int(example.answer or 0)
    environment = GuessNumberEnvironment(low=1, high=8)
    assert asyncio.run(environment.reset(example, CONTEXT)) == list(example.prompt)
    low, high = 1, 8
    for _ in range(4):  # binary search finds any of 8 numbers in at most 4 guesses
        guess = (low + high) // 2
        result = asyncio.run(environment.step(f"My guess is {guess}"))
        if result.terminated:
            assert guess == secret and result.reward == 1.0
            break
        assert result.reward == 0.0
        hint = result.observation[0].content
        low, high = (guess + 1, high) if "higher" in hint else (low, guess - 1)
    else:
        pytest.fail("binary search did not find the secret")
    nothing = asyncio.run(environment.step("no idea"))
    assert not nothing.terminated and "one whole number" in nothing.observation[0].content


def test_gymnasium_frozen_lake_is_playable_as_text():
    [example] = GymnasiumEnvironment.make_tasks(1, seed=0, env_id="FrozenLake-v1", instructions="Walk.")
    environment = GymnasiumEnvironment(
        "FrozenLake-v1", env_kwargs={"is_slippery": False}, action_names=["left", "down", "right", "up"]
    )
    system, first = asyncio.run(environment.reset(example, CONTEXT))
    assert system.content == "Walk." and first.content.startswith("[S]FFF")
    rewards = []
    for move in ["right", "right", "down", "down", "down", "right"]:  # the safe path on the 4x4 map
        result = asyncio.run(environment.step(f"I move {move}."))
        rewards.append(result.reward)
    assert result.terminated and rewards == [0.0] * 5 + [1.0]
    assert result.observation[0].content.endswith("HFF[G]")
    assert asyncio.run(environment.step("fly")).observation[0].content.startswith("Unknown action. Legal actions:")


def test_the_registry_builds_what_the_config_names():
    cases = [
        (SingleTurnEnvironmentConfig(), SingleTurnEnvironment),
        (CalculatorEnvironmentConfig(max_tool_calls=2), CalculatorEnvironment),
        (GuessNumberEnvironmentConfig(low=3, high=9), GuessNumberEnvironment),
        (GymnasiumEnvironmentConfig(), GymnasiumEnvironment),
    ]
    for config, cls in cases:
        environment = build_environment_factory(config)()
        assert isinstance(environment, cls) and isinstance(environment, Environment)
    assert build_environment_factory(CalculatorEnvironmentConfig(max_tool_calls=2))().max_tool_calls == 2  # type: ignore[attr-defined]
    limits = episode_limits(CalculatorEnvironmentConfig(max_turns=3, max_episode_tokens=99, wall_seconds=5.0))
    assert (limits.max_turns, limits.max_tokens, limits.wall_seconds) == (3, 99, 5.0)
    assert episode_limits(SingleTurnEnvironmentConfig()).max_turns == 1
    tasks = environment_tasks(GuessNumberEnvironmentConfig(low=3, high=9), size=5, seed=1)
    assert len(tasks) == 5 and all(3 <= int(t.answer or 0) <= 9 for t in tasks)
    with pytest.raises(ValueError, match="does not make its own tasks"):
        environment_tasks(CalculatorEnvironmentConfig(), size=5, seed=1)


def test_recipes_choose_environments_by_type_and_bad_combinations_are_one_error():
    config = load_config(None, ['environment.type="guess_number"', 'data.type="environment"', "data.size=8"])
    assert config.environment.type == "guess_number" and config.data.type == "environment"
    with pytest.raises(ConfigError, match="makes its own tasks"):
        load_config(None, ['data.type="environment"'])
    with pytest.raises(ConfigError, match="max_tool_calls"):
        load_config(None, ['environment.type="calculator"', "environment.max_tool_calls=0"])


def test_custom_environments_load_from_a_file_or_a_module_with_one_clear_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "envs.py").write_text("from sharpen.environments import SingleTurnEnvironment as Mine\n")
    monkeypatch.chdir(tmp_path)
    make = build_environment_factory(CustomEnvironmentConfig(factory="envs.py:Mine"))
    assert isinstance(make(), SingleTurnEnvironment)
    make = build_environment_factory(CustomEnvironmentConfig(factory="sharpen.environments:SingleTurnEnvironment"))
    assert isinstance(make(), SingleTurnEnvironment)
    for spec, message in [
        ("envs.py", "expected 'path/to/file.py:Name'"),
        ("missing.py:Mine", "no file"),
        ("envs.py:Theirs", "has no attribute 'Theirs'"),
        ("no_such_module_xyz:Env", "cannot import it"),
    ]:
        with pytest.raises(EnvironmentLoadError, match=message):
            build_environment_factory(CustomEnvironmentConfig(factory=spec))
    assert main(["train", 'environment={type = "custom", factory = "envs.py:Theirs"}']) == EXIT_USER_ERROR
    assert capsys.readouterr().err.startswith("sharpen: environment.factory = 'envs.py:Theirs'")
    assert not (tmp_path / "runs").exists()  # refused before any run directory or engine exists


_WRONG_SHAPES = """
class NoMethods:
    name, version = "none", "1"

class HalfEnvironment:
    name, version = "half", "1"
    async def reset(self, example, ctx):
        return []

def make_nameless():
    class Nameless:
        async def run_agent(self, example, ctx, client):
            return None
    return Nameless()
"""


def test_a_wrong_shaped_environment_is_one_clear_error_before_any_episode(tmp_path, monkeypatch, capsys):
    """A class with neither reset()/step() nor run_agent() is refused when the run is built (before the engine
    starts); a factory function's product, whose class is known only once it is called, when the first episode
    starts: the run's error, once, not an error per episode."""
    from sharpen.environments import EpisodeLimits
    from sharpen.rollout.engines.scripted import ScriptedEngine
    from sharpen.rollout.episodes import EpisodeRunner
    from sharpen.types import Example, Message, SamplingParams

    (tmp_path / "shapes.py").write_text(_WRONG_SHAPES)
    monkeypatch.chdir(tmp_path)
    for name, present in (("NoMethods", "it has none of them"), ("HalfEnvironment", "it has reset()")):
        with pytest.raises(ConfigError, match=rf"{name} is not an environment: .* and {re.escape(present)}"):
            build_environment_factory(CustomEnvironmentConfig(factory=f"shapes.py:{name}"))
    assert main(["train", 'environment={type = "custom", factory = "shapes.py:NoMethods"}']) == EXIT_USER_ERROR
    assert "NoMethods is not an environment" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # refused before any run directory or engine exists
    make = build_environment_factory(CustomEnvironmentConfig(factory="shapes.py:make_nameless"))
    runner = EpisodeRunner(tokenizer=None, make_environment=make, limits=EpisodeLimits(max_turns=2))
    engine = ScriptedEngine(["a"], encode=lambda text: [1], eos_token_id=2)
    example = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")
    with pytest.raises(ConfigError, match=r"the environment factory: Nameless has no name or version"):
        runner.generate_groups(engine, [example], sampling=SamplingParams(max_new_tokens=4), num_samples=4, seed=0)


_TASK_FUNCTIONS = """
from sharpen.types import Example, Message

def good(num_tasks, *, seed):
    return [Example(task_key=f"t/{i}", prompt=(Message(role="user", content=str(i + seed)),)) for i in range(num_tasks)]

def no_seed(num_tasks):
    return []

def dicts(num_tasks, seed=0):
    return [{"prompt": "q", "answer": "a"}] * num_tasks

def one_example(num_tasks, seed=0):
    return Example(task_key="t/0", prompt=(Message(role="user", content="q"),))

def empty(num_tasks, seed=0):
    return []

NOT_CALLABLE = 3
"""


def test_a_task_function_of_the_wrong_shape_is_one_clear_error_before_any_engine(tmp_path, monkeypatch, capsys):
    """`environment.tasks` is called (num_tasks, seed=...) and must return Examples; anything else is one line
    naming what is wrong when the run is built, not a TypeError or AttributeError deep in the loop."""
    (tmp_path / "tasks.py").write_text(_TASK_FUNCTIONS)
    monkeypatch.chdir(tmp_path)

    def tasks_of(name: str) -> list:
        config = CustomEnvironmentConfig(factory="sharpen.environments:SingleTurnEnvironment", tasks=f"tasks.py:{name}")
        return environment_tasks(config, size=3, seed=5)

    assert [t.prompt[0].content for t in tasks_of("good")] == ["5", "6", "7"]
    for name, message in [
        ("no_seed", r"cannot be called \(num_tasks, seed=...\): got an unexpected keyword argument 'seed'"),
        ("dicts", r"item 0 is a dict, not a sharpen.types.Example"),
        ("one_example", r"returned one Example, not a list of sharpen.types.Example"),
        ("empty", r"returned no tasks for num_tasks=3"),
        ("NOT_CALLABLE", r"is not callable \(type int\)"),
    ]:
        with pytest.raises(EnvironmentLoadError, match=rf"^environment.tasks = 'tasks.py:{name}'.*{message}"):
            tasks_of(name)
    environment = '{type = "custom", factory = "sharpen.environments:SingleTurnEnvironment", tasks = "tasks.py:dicts"}'
    assert main(["train", f"environment={environment}", 'data={type = "environment"}']) == EXIT_USER_ERROR
    assert capsys.readouterr().err.startswith("sharpen: environment.tasks = 'tasks.py:dicts': item 0 is a dict")
    assert not (tmp_path / "runs").exists()  # refused before any run directory or engine exists
