"""gpt-oss's harmony format: a tool call is a message addressed to the tool,
``<|start|>assistant<|channel|>commentary to=functions.name <|constrain|>json<|message|>{...}<|call|>``.

The model writes the recipient after the channel; the chat template renders history with it before
(``<|start|>assistant to=functions.name<|channel|>commentary json<|message|>``): both are read. A turn's messages
end with ``<|end|>``, ``<|call|>`` or ``<|return|>``, or with the text (the engine may cut the stop token). Only the
``final`` channel is a turn's content; ``analysis`` is reasoning and never content.
"""

from __future__ import annotations

import json
import re

from sharpen.environments.tool_formats.base import ToolCall, ToolCallError, ToolSpecs, call_from_arguments

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
_MESSAGE_END = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")


class HarmonyToolCallParser:
    """Messages addressed ``to=functions.<name>`` (any recipient: the ``functions.`` namespace is dropped), whose
    body is the arguments as JSON."""

    call_format = (
        "<|channel|>commentary to=functions.<tool name> <|constrain|>json<|message|>{<arguments as JSON>}<|call|>"
    )
    markers: tuple[str, ...] = (START, CHANNEL, "<|constrain|>", MESSAGE)  # not the ends: a turn reads alike without

    def __init__(self, *, tools: ToolSpecs = ()) -> None:
        del tools

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        calls: list[ToolCall | ToolCallError] = []
        for header, body in _messages(text):
            recipient = _RECIPIENT.search(header)
            if recipient is None:
                continue
            name = recipient.group(1).removeprefix("functions.")
            if body is None:
                calls.append(ToolCallError(message=f"the call to {name!r} has no <|message|> with its arguments"))
                continue
            try:
                arguments = json.loads(body) if body.strip() else {}
            except json.JSONDecodeError as error:
                calls.append(ToolCallError(message=f"arguments of tool call {name!r} are not valid JSON ({error.msg})"))
                continue
            calls.append(call_from_arguments(name, arguments))
        return calls

    def strip(self, text: str) -> str:
        if MESSAGE not in text:
            return text.strip()
        finals = [body for header, body in _messages(text) if body is not None and _channel(header) == "final"]
        return "\n".join(finals).strip()


def _messages(text: str) -> list[tuple[str, str | None]]:
    """(header, body) of each message of the turn; body None for a header never followed by ``<|message|>``."""
    messages: list[tuple[str, str | None]] = []
    for chunk in text.split(START):
        rest = chunk
        while MESSAGE in rest:
            header, _, rest = rest.partition(MESSAGE)
            end = _MESSAGE_END.search(rest)
            body, rest = (rest, "") if end is None else (rest[: end.start()], rest[end.end() :])
            messages.append((header, body))
        if CHANNEL in rest:
            messages.append((rest, None))
    return messages


def _channel(header: str) -> str:
    match = _CHANNEL_NAME.search(header)
    return match.group(1) if match else ""
