"""Qwen3-Coder's XML-style tool calls: ``<tool_call><function=name><parameter=p>value</parameter></function>
</tool_call>``.

A parameter's value is text: the template writes strings as they are, objects and lists as JSON, and other values
with Python's ``str`` (``42``, ``True``, ``None``). So the parameter's type comes from the tool's spec (the parser is
built with the tools' specs); a parameter the specs do not type stays a string, as in vLLM's ``qwen3_coder`` parser.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from sharpen.environments.tool_formats.base import ToolCall, ToolCallError, ToolSpecs, parameter_types

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)
_JSON_KINDS: dict[str, type | tuple[type, ...]] = {"integer": int, "number": (int, float), "object": dict}
_JSON_KINDS["array"] = list


class Qwen3CoderToolCallParser:
    """``<tool_call>`` blocks each holding one ``<function=name>`` with ``<parameter=name>`` values (Qwen3-Coder,
    Qwen3.5); a bare ``<function=...>`` without the block is read too. Unclosed blocks, functions or parameters, and
    values that do not fit their parameter's type, are errors."""

    call_format = (
        "<tool_call>\n<function=<tool name>>\n<parameter=<argument name>>\n<value>\n</parameter>\n</function>\n"
        "</tool_call>"
    )
    markers: tuple[str, ...] = ("<tool_call>", "</tool_call>")

    def __init__(self, *, tools: ToolSpecs = ()) -> None:
        self.parameters = parameter_types(tools)

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        blocks = [m.group(1) for m in _BLOCK.finditer(text)]
        if not blocks and "<tool_call>" not in text:
            blocks = [m.group(0) for m in _FUNCTION.finditer(text)]
            if text.count("<function=") > len(blocks):
                blocks.append("<function=")  # reported as not closed
        calls = [self._call(block) for block in blocks]
        if text.count("<tool_call>") > len(_BLOCK.findall(text)):
            calls.append(ToolCallError(message="a <tool_call> block is not closed with </tool_call>"))
        return calls

    def strip(self, text: str) -> str:
        if "<tool_call>" in text:
            return _BLOCK.sub("", text).strip()
        return _FUNCTION.sub("", text).strip()

    def _call(self, block: str) -> ToolCall | ToolCallError:
        function = _FUNCTION.fullmatch(block.strip())
        if function is None:
            return ToolCallError(
                message="a tool call must be <tool_call><function=name><parameter=name>value</parameter>"
                "</function></tool_call>"
            )
        name, body = function.group(1).strip(), function.group(2)
        if not name:
            return ToolCallError(message="<function=> needs the tool's name")
        if _PARAMETER.sub("", body).strip():
            return ToolCallError(
                message=f"tool call {name!r}: text outside <parameter=name>...</parameter> (a parameter not closed?)"
            )
        types = self.parameters.get(name, {})
        arguments: dict[str, Any] = {}
        for match in _PARAMETER.finditer(body):
            parameter, value = match.group(1).strip(), _trim_newlines(match.group(2))
            converted = _convert(value, types.get(parameter))
            if isinstance(converted, ToolCallError):
                return ToolCallError(message=f"tool call {name!r}, parameter {parameter!r}: {converted.message}")
            arguments[parameter] = converted
        return ToolCall(name=name, arguments=arguments)


def _trim_newlines(value: str) -> str:
    """The value without the one newline the template writes on each side of it."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _convert(value: str, schema: Mapping[str, Any] | None) -> Any:
    """``value`` as its parameter's JSON type (a `ToolCallError` when it is not one)."""
    kind = schema.get("type") if schema else None
    if kind is None or kind == "string" or not isinstance(kind, str):
        return value
    text = value.strip()
    if text in ("null", "None"):
        return None
    if kind == "boolean":
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        return ToolCallError(message=f"expected true or false, got {text[:40]!r}")
    if kind not in _JSON_KINDS:
        return value
    try:
        decoded = json.loads(text)
    except json.JSONDecodeError:
        return ToolCallError(message=f"expected a JSON {kind}, got {text[:40]!r}")
    if isinstance(decoded, bool) or not isinstance(decoded, _JSON_KINDS[kind]):
        return ToolCallError(message=f"expected a JSON {kind}, got {text[:40]!r}")
    return decoded
