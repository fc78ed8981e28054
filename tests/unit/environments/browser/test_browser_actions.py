"""Turning a turn's text into browser actions: tool calls read by the framework's parser, each bad one answered
with an error message (the episode goes on), the task's own reward when it ends. Real Chromium, MiniWoB's
click-test-2 ("Click button ONE.", with ONE shown first)."""

from __future__ import annotations

import asyncio
from typing import Any

from sharpen.environments.base import EpisodeContext
from sharpen.environments.browser import BrowserEnvironment, BrowserPool
from sharpen.types import Example


def call(name: str, **arguments: Any) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def click_test_2(seed: int = 5) -> Example:
    return BrowserEnvironment.make_tasks(1, seed=seed, tasks=["click-test-2"])[0]


def run_turns(pool: BrowserPool, actions: list[str], **options: Any) -> tuple[list[Any], list[Any]]:
    async def main() -> tuple[list[Any], list[Any]]:
        environment = BrowserEnvironment(pool=pool, **options)
        context = EpisodeContext(seed=1, sample_index=0, max_turns=8, max_tokens=4096)
        first = await environment.reset(click_test_2(), context)
        return first, [await environment.step(action) for action in actions]

    return asyncio.run(main())


def test_the_first_observation_lists_the_tools_and_shows_the_page(pool: BrowserPool) -> None:
    first, _ = run_turns(pool, [])
    system, user = first
    assert system.role == "system" and '"name": "click"' in system.content and '"name": "done"' in system.content
    assert user.content == 'Task: Click button ONE.\nPage:\n[1] button "ONE"\n[2] button "TWO"'


def test_bad_actions_are_answered_with_errors_and_the_episode_goes_on(pool: BrowserPool) -> None:
    bad = [
        "I would click the first button.",  # no tool call
        '<tool_call>{"name": "click", "arguments": {"id": 1}',  # not closed
        "<tool_call>click(1)</tool_call>",  # not JSON
        call("hover", id=1),  # no such tool
        call("click", id="one"),  # wrong argument type
        call("click", element=1),  # wrong argument name
        call("click", id=42),  # no such element
        call("press", key="Hyper"),  # no such key
    ]
    _, results = run_turns(pool, bad)
    expected = [
        "no tool call found",
        "not closed with </tool_call>",
        "tool call is not valid JSON",
        "unknown tool 'hover'",
        "argument 'id' must be a JSON integer",
        "unknown arguments ['element'], missing arguments ['id']",
        "no element [42] on the page",
        "unknown key 'Hyper'",
    ]
    for result, message in zip(results, expected, strict=True):
        assert not result.terminated and result.reward == 0.0
        assert result.info["num_invalid_actions"] == 1
        feedback, page_text = result.observation[0].content.split("\n\n", 1)
        assert feedback.startswith("error:") and message in feedback
        assert page_text.startswith("Task: Click button ONE.")


def test_the_right_click_scores_1_after_valid_moves_and_calls_after_the_end_are_not_run(pool: BrowserPool) -> None:
    _, results = run_turns(
        pool, [call("scroll", dx=0, dy=10), call("click", id=1) + call("click", id=2)], parser="hermes"
    )
    assert results[0].observation[0].content.startswith("scrolled by (0, 10)")
    assert results[1].terminated and results[1].reward == 1.0
    assert results[1].info["task_reward"] == 1.0
    assert results[1].info["actions"] == ["click", "click"]


def test_the_wrong_click_scores_0_and_done_without_solving_scores_0(pool: BrowserPool) -> None:
    _, wrong = run_turns(pool, [call("click", id=2)])
    assert wrong[0].terminated and wrong[0].reward == 0.0 and wrong[0].info["task_reward"] == -1.0
    _, gave_up = run_turns(pool, [call("done")])
    assert gave_up[0].terminated and gave_up[0].reward == 0.0 and gave_up[0].info["task_reward"] is None


def test_the_json_parser_reads_a_turn_that_is_one_json_object(pool: BrowserPool) -> None:
    _, results = run_turns(pool, ['{"name": "click", "parameters": {"id": 1}}'], parser="json")
    assert results[0].terminated and results[0].reward == 1.0


def test_the_demonstration_comes_before_the_task(pool: BrowserPool) -> None:
    first, _ = run_turns(pool, [], demonstration=True, instructions="Click things.")
    assert [m.role for m in first] == ["system", "user", "assistant", "user"]
    assert first[0].content == "Click things."
    assert first[2].content == call("click", id=3)
