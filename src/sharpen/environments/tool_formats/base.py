"""What every tool-call format shares: the parsed call, the error the policy is told, the parser protocol, and
reading JSON payloads.

A format module only finds where its calls are in a turn; turning a payload into a `ToolCall` (or a
`ToolCallError` whose message is the policy's feedback) happens here, so every format words its errors alike.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

ToolSpecs = Sequence[Mapping[str, Any]]
"""The tools a parser may be told about: OpenAI-style specs (``{"type": "function", "function": {...}}``) or their
``function`` parts, as `sharpen.environments.tools.tool_spec` writes them."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(kw_only=True, slots=True, frozen=True)
class ToolCallError:
    """A tool call the parser could not read; ``message`` is what the policy is told."""

    message: str


class ToolCallParser(Protocol):
    call_format: str
    """How one call is written, for tool instructions shown to the policy (placeholders in angle brackets)."""
    markers: tuple[str, ...]
    """The tokens a call is found by, which some families' tokenizers hold as special tokens (`completion_text`
    keeps them); a message's end (``<|call|>``, ``<|eom_id|>``) is not one: a turn reads alike without it, as when
    the engine cuts its stop token."""

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        """The tool calls in one policy turn, in order (empty: the turn calls no tool)."""
        ...

    def strip(self, text: str) -> str:
        """The text of the turn outside its tool calls (a message's content beside its calls)."""
        ...


class ToolCallParserFactory(Protocol):
    def __call__(self, *, tools: ToolSpecs = ()) -> ToolCallParser:
        """A parser; ``tools`` are the specs of the callable tools, for formats whose arguments are untyped text."""
        ...


def call_from_object(data: object, *, arguments_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | ToolCallError:
    """A call from a decoded JSON object ``{"name": ..., <arguments key>: {...}}``; arguments may be double-encoded
    (a JSON string holding the object), as some models write them."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return ToolCallError(message='a tool call must be a JSON object with a string "name"')
    key = next((k for k in arguments_keys if k in data), arguments_keys[0])
    return call_from_arguments(data["name"], data.get(key, {}), key=key)


def call_from_arguments(name: str, arguments: object, *, key: str = "arguments") -> ToolCall | ToolCallError:
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCallError(message=f'"{key}" of tool call {name!r} is not valid JSON')
    if not isinstance(arguments, dict):
        return ToolCallError(message=f'"{key}" of tool call {name!r} must be a JSON object')
    return ToolCall(name=name, arguments=arguments)


def call_from_json(payload: str, *, arguments_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | ToolCallError:
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as error:
        return ToolCallError(message=f"tool call is not valid JSON ({error.msg} at column {error.colno})")
    return call_from_object(data, arguments_keys=arguments_keys)


_DECODER = json.JSONDecoder()


def decode_json_sequence(text: str, *, separator: str) -> tuple[list[Any], str]:
    """The JSON values at the start of ``text``, separated by ``separator`` (and whitespace), and an error message
    (empty when all of ``text`` was read)."""
    values: list[Any] = []
    position = 0
    while True:
        position = _skip_space(text, position)
        try:
            value, position = _DECODER.raw_decode(text, position)
        except json.JSONDecodeError as error:
            return values, f"tool call is not valid JSON ({error.msg} at column {error.colno})"
        values.append(value)
        position = _skip_space(text, position)
        if position == len(text):
            return values, ""
        if not text.startswith(separator, position):
            return values, f"unexpected text after a tool call: {text[position : position + 40]!r}"
        position += len(separator)


def decode_json_value(text: str) -> tuple[Any, str]:
    """The one JSON value that is all of ``text`` (surrounding whitespace aside), and an error message (empty: read)."""
    position = _skip_space(text, 0)
    try:
        value, position = _DECODER.raw_decode(text, position)
    except json.JSONDecodeError as error:
        return None, f"tool call is not valid JSON ({error.msg} at column {error.colno})"
    rest = text[position:].strip()
    return value, f"unexpected text after a tool call: {rest[:40]!r}" if rest else ""


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def parameter_types(tools: ToolSpecs) -> dict[str, dict[str, Any]]:
    """Tool name -> parameter name -> the parameter's JSON schema, from OpenAI-style specs."""
    types: dict[str, dict[str, Any]] = {}
    for spec in tools:
        function = spec.get("function", spec)
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[str(function["name"])] = dict(properties)
    return types
