"""Tool-call formats whose arguments are JSON: Hermes/Qwen blocks, Llama 3's JSON turns, Mistral's ``[TOOL_CALLS]``.

Each parser finds where a turn's calls are and leaves reading the JSON to `base`; it does not run the calls.
"""

from __future__ import annotations

import re

from sharpen.environments.tool_formats.base import (
    ToolCall,
    ToolCallError,
    ToolSpecs,
    call_from_arguments,
    call_from_json,
    call_from_object,
    decode_json_sequence,
    decode_json_value,
)


class HermesToolCallParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen 2.5/3). An opened block
    that is never closed is an error, so a truncated call is not silently dropped."""

    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    call_format = '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>'
    markers: tuple[str, ...] = ("<tool_call>", "</tool_call>")

    def __init__(self, *, tools: ToolSpecs = ()) -> None:
        del tools  # JSON arguments carry their own types

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        calls: list[ToolCall | ToolCallError] = [call_from_json(m.group(1).strip()) for m in self._BLOCK.finditer(text)]
        if text.count("<tool_call>") > len(calls):
            calls.append(ToolCallError(message="a <tool_call> block is not closed with </tool_call>"))
        return calls

    @classmethod
    def strip(cls, text: str) -> str:
        """The text outside the closed ``<tool_call>`` blocks (a message's content beside its tool calls)."""
        return cls._BLOCK.sub("", text).strip()


class JsonToolCallParser:
    """A turn that is exactly one JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.x); any other turn
    calls no tool. `Llama3JsonToolCallParser` also reads ``<|python_tag|>`` and several calls."""

    call_format = '{"name": "<tool name>", "parameters": {<arguments as JSON>}}'
    markers: tuple[str, ...] = ()

    def __init__(self, *, tools: ToolSpecs = ()) -> None:
        del tools

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        stripped = text.strip()
        if not (stripped.startswith("{") and stripped.endswith("}")):
            return []
        return [call_from_json(stripped, arguments_keys=("parameters",))]

    def strip(self, text: str) -> str:
        return "" if self.parse(text) else text.strip()


PYTHON_TAG = "<|python_tag|>"
_LLAMA_END = re.compile(r"(?:<\|eom_id\|>|<\|eot_id\|>)\s*$")


class Llama3JsonToolCallParser:
    """Llama 3.1-3.3 JSON calls ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is read too), as the whole
    turn or after ``<|python_tag|>``; several calls are separated by ``;`` (the official templates render one call
    per turn and refuse more). A turn that starts with ``{`` is read as calls, so a malformed one is reported."""

    call_format = '{"name": "<tool name>", "parameters": {<arguments as JSON>}}'
    markers: tuple[str, ...] = (PYTHON_TAG,)

    def __init__(self, *, tools: ToolSpecs = ()) -> None:
        del tools

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        payload = self._payload(text)
        if payload is None:
            return []
        values, error = decode_json_sequence(payload, separator=";")
        calls = [call_from_object(value, arguments_keys=("parameters", "arguments")) for value in values]
        if error:
            calls.append(ToolCallError(message=error))
        return calls

    def strip(self, text: str) -> str:
        body = _LLAMA_END.sub("", text)
        if PYTHON_TAG in body:
            return body.split(PYTHON_TAG, 1)[0].strip()
        return "" if self._payload(body) is not None else body.strip()

    @staticmethod
    def _payload(text: str) -> str | None:
        body = _LLAMA_END.sub("", text)
        if PYTHON_TAG in body:
            return body.split(PYTHON_TAG, 1)[1]
        stripped = body.strip()
        return stripped if stripped.startswith("{") else None


TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MISTRAL_END = re.compile(r"</s>\s*$")


class MistralToolCallParser:
    """Mistral's calls after ``[TOOL_CALLS]``: a JSON list ``[{"name": ..., "arguments": {...}, "id": ...}]``
    (tokenizers before v11: Mistral 7B v0.3, Nemo, Small 3.1) or, from v11, one ``[TOOL_CALLS]name[ARGS]{...}`` per
    call (v11 writes ``[CALL_ID]id`` before ``[ARGS]``; ``name{...}`` without ``[ARGS]`` is read too). Call ids are
    not kept: the environment answers calls in order."""

    call_format = "[TOOL_CALLS]<tool name>[ARGS]{<arguments as JSON>}"
    markers: tuple[str, ...] = (TOOL_CALLS, ARGS, CALL_ID)

    def __init__(self, *, tools: ToolSpecs = ()) -> None:
        del tools

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        if TOOL_CALLS not in text:
            return []
        calls: list[ToolCall | ToolCallError] = []
        for segment in _MISTRAL_END.sub("", text).split(TOOL_CALLS)[1:]:
            segment = segment.strip()
            if not segment:  # a repeated marker
                continue
            if segment[0] in "[{":
                calls.extend(self._listed_calls(segment))
            else:
                calls.append(self._named_call(segment))
        return calls

    def strip(self, text: str) -> str:
        return _MISTRAL_END.sub("", text).split(TOOL_CALLS, 1)[0].strip()

    @staticmethod
    def _listed_calls(segment: str) -> list[ToolCall | ToolCallError]:
        value, error = decode_json_value(segment)
        if error:
            return [ToolCallError(message=error)]
        items = value if isinstance(value, list) else [value]
        if not items:
            return [ToolCallError(message="[TOOL_CALLS] is followed by an empty list")]
        return [call_from_object(item) for item in items]

    @staticmethod
    def _named_call(segment: str) -> ToolCall | ToolCallError:
        head, separator, arguments = segment.partition(ARGS)
        if not separator:
            brace = segment.find("{")
            if brace < 0:
                return ToolCallError(message="a tool call must be [TOOL_CALLS]name[ARGS]{arguments as JSON}")
            head, arguments = segment[:brace], segment[brace:]
        name = head.partition(CALL_ID)[0].strip()
        if not name or any(c.isspace() or c in "[]{}" for c in name):
            return ToolCallError(message=f"{name!r} after [TOOL_CALLS] is not a tool name")
        value, error = decode_json_value(arguments)
        if error:
            return ToolCallError(message=f"arguments of tool call {name!r}: {error}")
        return call_from_arguments(name, value)
