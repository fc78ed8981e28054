"""Tools: JSON-schema specs from Python functions, the tool-call parsers, calling tools safely, the tool-use turn."""

from __future__ import annotations

import asyncio

import pytest

from sharpen.environments import EpisodeContext
from sharpen.environments.tool_use import ToolEnvironment
from sharpen.environments.tools import (
    HermesToolCallParser,
    JsonToolCallParser,
    ToolCall,
    ToolCallError,
    call_tool,
    tool_spec,
)
from sharpen.types import Example, Message


def lookup(city: str, year: int = 2020, *, exact: bool | None = None) -> str:
    """Population of a city.

    Args:
        city: the city's name
        year (int): the census year
    """
    return f"{city} {year} {exact}"


async def slow_add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


def test_tool_spec_is_json_schema_from_the_signature_and_docstring():
    assert tool_spec(lookup) == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Population of a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city's name"},
                    "year": {"type": "integer", "description": "the census year"},
                    "exact": {"type": "boolean"},
                },
                "required": ["city"],
            },
        },
    }

    def bad(*values: int) -> int:
        return 0

    with pytest.raises(ValueError, match=r"\*args"):
        tool_spec(bad)

    def untyped(thing: set) -> int:
        return 0

    with pytest.raises(ValueError, match="no JSON-schema equivalent"):
        tool_spec(untyped)


def test_hermes_parser_reads_every_block_and_reports_malformed_ones():
    parser = HermesToolCallParser()
    text = (
        'thinking <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
        '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": 2}"}\n</tool_call>'
    )
    assert parser.parse(text) == [ToolCall(name="a", arguments={"x": 1}), ToolCall(name="b", arguments={"y": 2})]
    assert parser.parse("no calls here") == []
    [error] = parser.parse("<tool_call>{not json}</tool_call>")
    assert isinstance(error, ToolCallError) and "not valid JSON" in error.message
    [error] = parser.parse('<tool_call>{"arguments": {}}</tool_call>')
    assert isinstance(error, ToolCallError) and '"name"' in error.message
    [error] = parser.parse('<tool_call>{"name": "a", "arguments": [1]}</tool_call>')
    assert isinstance(error, ToolCallError) and "JSON object" in error.message
    calls = parser.parse('<tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{"name": "b"')
    assert calls[0] == ToolCall(name="a", arguments={}) and isinstance(calls[1], ToolCallError)
    assert "not closed" in calls[1].message  # a truncated call is not silently dropped


def test_json_parser_takes_a_turn_that_is_one_object():
    parser = JsonToolCallParser()
    assert parser.parse(' {"name": "a", "parameters": {"x": 1}} ') == [ToolCall(name="a", arguments={"x": 1})]
    assert parser.parse("The answer is {x}.") == []


def test_call_tool_turns_every_failure_into_a_message_for_the_policy():
    tools = {"lookup": lookup, "slow_add": slow_add}

    def run(name: str, arguments: dict, max_chars: int = 100) -> str:
        return asyncio.run(call_tool(tools, ToolCall(name=name, arguments=arguments), max_chars=max_chars))

    assert run("lookup", {"city": "Oslo"}) == "Oslo 2020 None"
    assert run("slow_add", {"a": 1, "b": 2.5}) == "3.5"  # async tools are awaited; results become JSON
    assert run("nope", {}).startswith("error: unknown tool 'nope' (available: lookup, slow_add)")
    assert "missing arguments ['city']" in run("lookup", {})
    assert "unknown arguments ['town']" in run("lookup", {"city": "x", "town": "y"})
    assert "must be a JSON integer" in run("lookup", {"city": "x", "year": "2020"})
    assert "must be a JSON number" in run("slow_add", {"a": True, "b": 1})  # a bool is not a number
    assert run("lookup", {"city": "x" * 500}, max_chars=20).endswith("[output truncated at 20 characters]")

    def broken(x: int) -> str:
        """Always fails."""
        raise KeyError(x)

    assert asyncio.run(call_tool({"broken": broken}, ToolCall(name="broken", arguments={"x": 3}), max_chars=99)) == (
        "error: KeyError: 3"
    )


def test_tool_environment_turn_protocol():
    environment = ToolEnvironment([lookup], max_tool_calls=2)
    example = Example(
        task_key="t/0",
        prompt=(Message(role="system", content="Be brief."), Message(role="user", content="Oslo?")),
    )
    context = EpisodeContext(seed=0, sample_index=0, max_turns=4, max_tokens=100)
    system, user = asyncio.run(environment.reset(example, context))
    assert system.role == "system" and system.content.startswith("Be brief.\n\nYou may call tools.")
    assert '"name": "lookup"' in system.content and user.content == "Oslo?"

    call = '<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call>'
    result = asyncio.run(environment.step(call))
    assert not result.terminated and not result.truncated and result.reward is None
    assert result.observation == [Message(role="tool", content="Oslo 2020 None")]
    assert result.info == {"tool_calls": [{"name": "lookup", "arguments": {"city": "Oslo"}}]}
    bad = asyncio.run(environment.step("<tool_call>oops</tool_call>"))
    assert bad.observation[0].content.startswith("error: tool call is not valid JSON")
    capped = asyncio.run(environment.step(call))
    assert capped.truncated and capped.info["stop"] == "max_tool_calls"
    done = asyncio.run(environment.step("It has 700k people."))
    assert done.terminated and done.info == {"num_tool_calls": 2}
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ToolEnvironment([lookup], parser="xml")
