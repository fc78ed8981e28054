"""The verifiers adapter: a verifiers taskset's rows become Examples, and `run_agent` runs verifiers' own episode
(its chat program, interception server and rewards) against an OpenAI-compatible server, single- and multi-turn.

The environments are vf_arithmetic.py and vf_guessing.py beside this file (importable by id: pytest puts this folder
on sys.path); the server is tests/support/openai_standin.py with scripted replies. Each episode starts verifiers' chat
program in a subprocess (~2 s)."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from typing import Any

import pytest

pytest.importorskip("verifiers.v1", reason="the agents extra is not installed")

from sharpen.config import load_config
from sharpen.config.environments import VerifiersEnvironmentConfig
from sharpen.environments import AgentClient, AgentEnvironment, EnvironmentInfraError, EpisodeContext
from sharpen.environments.registry import build_environment_factory, environment_tasks, episode_limits
from sharpen.environments.verifiers_adapter import VerifiersEnvironment, import_verifiers
from sharpen.plugins import PluginLoadError
from support.openai_standin import OpenAIStandin


def _context(max_turns: int = 4) -> EpisodeContext:
    return EpisodeContext(seed=3, sample_index=0, max_turns=max_turns, max_tokens=256)


def _arithmetic(messages: list[dict[str, Any]]) -> str:
    question = messages[-1]["content"]
    a, b = (int(word) for word in question.rstrip("?").split() if word.isdigit())
    return f"It is {a + b}" if a < 5 else f"It is {a + b + 1}"  # right for the first two sums, wrong after


def _guesser(messages: list[dict[str, Any]]) -> str:
    num_user_turns = sum(m["role"] == "user" for m in messages)
    return ["5", "7", "6", "2"][num_user_turns - 1]


async def _play(environment: VerifiersEnvironment, example, server: OpenAIStandin, max_turns: int = 4):
    client = AgentClient(base_url=server.base_url, api_key=server.open_key(), model="sharpen-policy")
    return await environment.run_agent(example, _context(max_turns), client)


def test_a_taskset_becomes_examples_with_stable_keys_prompts_answers_and_task_data():
    environment = VerifiersEnvironment(taskset="vf-arithmetic")
    examples = environment.make_tasks(4)
    assert isinstance(environment, AgentEnvironment) and len(examples) == 4
    first = examples[0]
    assert [(m.role, m.content) for m in first.prompt] == [
        ("system", "Answer with the number."),
        ("user", "What is 1 + 3?"),
    ]
    assert first.answer == "4" and first.metadata["verifiers_task"]["info"] == {"a": 1, "b": 3}
    assert first.task_key.startswith("vf-arithmetic/")
    assert [e.task_key for e in VerifiersEnvironment(taskset="vf-arithmetic").make_tasks(4)] == [
        e.task_key for e in examples
    ]
    assert len({e.task_key for e in examples}) == 4
    assert len(environment.make_tasks(100)) == 6  # a taskset with fewer rows gives all of them
    built = VerifiersEnvironment(factory="vf_arithmetic:make_env").make_tasks(2)
    assert [e.task_key for e in built] == [e.task_key for e in examples[:2]]


def test_a_single_turn_episode_is_verifiers_own_rollout_and_rewards():
    environment = VerifiersEnvironment(taskset="vf-arithmetic")
    right, _, wrong = environment.make_tasks(3)

    async def run():
        async with OpenAIStandin(_arithmetic) as server:
            results = [await _play(environment, example, server) for example in (right, wrong)]
            return results, server.requests

    (solved, failed), requests = asyncio.run(run())
    assert solved.reward == 1.0 and failed.reward == 0.0
    assert solved.info["rewards"] == {"brief": 1.0, "correct": 1.0}
    assert solved.info["reward_weights"] == {"brief": 0.0, "correct": 1.0}
    assert not solved.is_truncated and solved.stop_reason == "agent_completed"
    [(key, body), (other_key, _)] = requests
    assert key != other_key  # each episode's calls carry its own key
    assert body["messages"] == [
        {"role": "system", "content": "Answer with the number."},
        {"role": "user", "content": "What is 1 + 3?"},
    ]
    assert body["stream"] is True and body["model"] == "sharpen-policy"
    assert not [name for name in os.environ if name.startswith("SHARPEN_AGENT_API_KEY_")]  # the key is gone


def test_a_multi_turn_episode_plays_every_turn_and_verifiers_ends_it_at_the_turn_limit():
    environment = VerifiersEnvironment(taskset="vf-guessing")
    [example] = environment.make_tasks(1)  # the secret is 6: the scripted guesses are 5, 7, 6

    async def run():
        async with OpenAIStandin(_guesser) as server:
            solved = await _play(environment, example, server, max_turns=4)
            calls = [body["messages"] for _, body in server.requests]
            cut = await _play(environment, example, server, max_turns=1)
            return solved, calls, cut

    solved, calls, cut = asyncio.run(run())
    assert solved.reward == 1.0 and solved.info["metrics"] == {"num_guesses": 3.0}
    assert solved.info["num_model_calls"] == 3
    assert calls[-1][1:] == [
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Higher."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Lower."},
    ]
    assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(calls))
    assert cut.reward == 0.0 and cut.is_truncated and cut.info["num_model_calls"] == 1


def test_a_failed_verifiers_episode_is_an_infrastructure_error():
    [example] = VerifiersEnvironment(taskset="vf-arithmetic").make_tasks(1)

    async def run():
        async with OpenAIStandin(_arithmetic) as server:
            client = AgentClient(base_url=server.base_url, api_key="not-a-key", model="sharpen-policy")
            await VerifiersEnvironment(taskset="vf-arithmetic").run_agent(example, _context(), client)

    with pytest.raises(EnvironmentInfraError, match="the verifiers episode failed"):
        asyncio.run(run())


def test_the_config_section_builds_the_adapter_and_its_tasks():
    config = VerifiersEnvironmentConfig(taskset="vf-arithmetic", max_turns=3)
    environment = build_environment_factory(config)()
    assert isinstance(environment, VerifiersEnvironment) and environment.harness == "null"
    assert episode_limits(config).max_turns == 3
    assert len(environment_tasks(config, size=2, seed=0)) == 2
    loaded = load_config(
        None, ['environment={type = "verifiers", taskset = "vf-arithmetic"}', 'data.type="environment"']
    )
    assert loaded.environment.type == "verifiers"
    for bad, message in [
        ({}, "exactly one of taskset and factory"),
        ({"taskset": "a", "factory": "m:f"}, "exactly one of taskset and factory"),
        ({"taskset": "a", "kwargs": {"x": 1}}, "kwargs are the factory's"),
    ]:
        with pytest.raises(ValueError, match=message):
            VerifiersEnvironmentConfig(**bad)


def test_a_taskset_or_factory_that_does_not_load_is_one_clear_error():
    with pytest.raises(PluginLoadError, match=r"environment\.taskset = 'no-such-taskset'"):
        VerifiersEnvironment(taskset="no-such-taskset").make_tasks(1)
    with pytest.raises(PluginLoadError, match="not a verifiers Env"):
        VerifiersEnvironment(factory="random:random").make_tasks(1)


def test_a_missing_extra_names_the_install_command(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # an import of it now raises ImportError
    with pytest.raises(PluginLoadError, match=r"pip install 'sharpen\[agents\]'"):
        import_verifiers()
    with pytest.raises(PluginLoadError, match=r"pip install 'sharpen\[agents\]'"):
        build_environment_factory(VerifiersEnvironmentConfig(taskset="vf-arithmetic"))
