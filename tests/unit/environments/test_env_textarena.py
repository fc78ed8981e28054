"""The textarena adapter end to end with scripted policies: a single-player game won by binary search, a
two-player game against the scripted opponent (random or named), seeded, and the config registry."""

from __future__ import annotations

import asyncio
import random
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("textarena", reason="the agents extra is not installed")

from sharpen.config import load_config
from sharpen.config.environments import TextArenaEnvironmentConfig
from sharpen.environments import Environment, EpisodeContext
from sharpen.environments.registry import build_environment_factory, environment_tasks
from sharpen.environments.textarena_adapter import TextArenaEnvironment, import_textarena, random_opponent
from sharpen.plugins import PluginLoadError

CONTEXT = EpisodeContext(seed=7, sample_index=0, max_turns=20, max_tokens=1000)


def first_listed(observation: str, rng: random.Random) -> str:
    """An opponent that takes the first free cell the game lists."""
    return re.findall(r"\[\d\]", observation.rsplit("Available Moves:", 1)[-1])[0]


def _play_tictactoe(environment: TextArenaEnvironment, seed: int) -> tuple[list[str], float | None]:
    [example] = TextArenaEnvironment.make_tasks(1, seed=seed, env_id="TicTacToe-v0", instructions="")
    observation = asyncio.run(environment.reset(example, CONTEXT))[-1].content
    seen = [observation]
    for _ in range(9):
        free = re.findall(r"\[\d\]", observation.rsplit("Available Moves:", 1)[-1])
        result = asyncio.run(environment.step(f"I take {free[0]}"))
        if result.terminated:
            return seen, result.reward
        observation = result.observation[0].content
        seen.append(observation)
    raise AssertionError("the game did not end")


def test_a_single_player_game_is_won_by_binary_search_and_rewarded_by_its_outcome():
    [example] = TextArenaEnvironment.make_tasks(1, seed=0, env_id="GuessTheNumber-v0", instructions="Play well.")
    environment = TextArenaEnvironment("GuessTheNumber-v0")
    assert isinstance(environment, Environment)
    state = random.getstate()
    system, first = asyncio.run(environment.reset(example, CONTEXT))
    assert system.content == "Play well." and "between 1 and 20" in first.content
    low, high, rewards = 1, 20, []
    for _ in range(10):
        guess = (low + high) // 2
        result = asyncio.run(environment.step(f"My guess: [{guess}]"))
        rewards.append(result.reward)
        if result.terminated:
            break
        [hint] = result.observation
        assert hint.content in ("The target number is higher.", "The target number is lower.")
        low, high = (guess + 1, high) if "higher" in hint.content else (low, guess - 1)
    assert result.terminated and result.reward == 1.0 and set(rewards[:-1]) <= {None}
    assert "Congratulations" in result.info["outcome"]
    assert random.getstate() == state  # the game's draws come from its own generator, not the process's
    invalid = TextArenaEnvironment("GuessTheNumber-v0")
    asyncio.run(invalid.reset(example, CONTEXT))
    assert "invalid move" in asyncio.run(invalid.step("no idea")).observation[0].content


def test_a_two_player_game_is_played_against_the_scripted_opponent_and_is_reproducible_by_seed():
    seen, reward = _play_tictactoe(TextArenaEnvironment("TicTacToe-v0", num_players=2), seed=1)
    assert reward in (-1.0, 0.0, 1.0)
    assert seen[0].startswith("You are Player 0 in Tic Tac Toe.")
    assert all("[Player 1] [" in observation for observation in seen[1:])  # the opponent's moves are shown
    assert not any("[Player 0]" in observation for observation in seen)  # the policy's own are not repeated
    assert _play_tictactoe(TextArenaEnvironment("TicTacToe-v0", num_players=2), seed=1) == (seen, reward)
    second = TextArenaEnvironment("TicTacToe-v0", num_players=2, policy_player=1, opponent=f"{__file__}:first_listed")
    seen, reward = _play_tictactoe(second, seed=1)
    assert seen[0].count("[Player 0] [0]") == 1 and reward is not None  # the opponent moved first, in cell 0


def test_the_random_opponent_picks_among_the_moves_the_game_last_listed():
    rng = random.Random(0)
    moves = {random_opponent("rules: say [4]\nAvailable Moves: '[1]', '[5]'", rng) for _ in range(20)}
    assert moves == {"[1]", "[5]"}
    assert random_opponent("no moves here", rng) == "[pass]"


def test_the_config_section_builds_the_adapter_its_tasks_and_checks_the_players():
    config = TextArenaEnvironmentConfig(env_id="TicTacToe-v0", num_players=2, policy_player=1)
    environment = build_environment_factory(config)()
    assert isinstance(environment, TextArenaEnvironment) and environment.policy_player == 1
    tasks = environment_tasks(config, size=3, seed=2)
    assert [t.task_key for t in tasks] == ["TicTacToe-v0/0", "TicTacToe-v0/1", "TicTacToe-v0/2"]
    assert len({t.metadata["env_seed"] for t in tasks}) == 3
    loaded = load_config(None, ['environment.type="textarena"', 'data.type="environment"', "data.size=4"])
    assert loaded.environment.type == "textarena"
    with pytest.raises(ValueError, match="not a player of a 1-player game"):
        TextArenaEnvironmentConfig(policy_player=1)
    with pytest.raises(ValueError, match="not found in registry"):
        asyncio.run(TextArenaEnvironment("NoSuchGame-v0").reset(tasks[0], CONTEXT))
    with pytest.raises(PluginLoadError, match=r"environment\.opponent"):
        TextArenaEnvironment("TicTacToe-v0", num_players=2, opponent=f"{Path(__file__).parent}/nothere.py:f")


def test_a_missing_extra_names_the_install_command(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "textarena", None)
    with pytest.raises(PluginLoadError, match=r"pip install 'sharpen\[agents\]'"):
        import_textarena()
