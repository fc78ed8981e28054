"""Tool-call formats: where a policy's turn holds tool calls, for each model family's chat format.

Owns reading calls out of text (`TOOL_CALL_PARSERS`, by name), choosing a format from a chat template
(`parser_for_template`) and the one decode of a completion's ids that keeps the formats' markers (`decode`). Each
parser returns the calls in order, or a `ToolCallError` whose message the policy is told, never raises; ``strip``
gives the text beside the calls. It does not run calls, describe tools to the policy or decide when an episode
ends (`sharpen.environments.tools`, `ToolEnvironment`).

| name          | format                                                                        | families          |
|---------------|-------------------------------------------------------------------------------|-------------------|
| `hermes`      | ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``                  | Hermes, Qwen 2.5/3 |
| `json`        | the whole turn is ``{"name": ..., "parameters": {...}}``                      | Llama 3 (strict)   |
| `llama3_json` | ``<|python_tag|>`` or whole-turn JSON calls, ``;``-separated                  | Llama 3.1-3.3      |
| `qwen3_coder` | ``<tool_call><function=f><parameter=p>v</parameter></function></tool_call>`` | Qwen3-Coder        |
| `mistral`     | ``[TOOL_CALLS][{...}]``, ``[TOOL_CALLS]f[ARGS]{...}``                         | Mistral, Devstral  |
| `harmony`     | ``<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}``    | gpt-oss            |
"""

from __future__ import annotations

from sharpen.environments.tool_formats.base import (
    ToolCall,
    ToolCallError,
    ToolCallParser,
    ToolCallParserFactory,
    ToolSpecs,
)
from sharpen.environments.tool_formats.detect import (
    UnknownToolCallFormatError,
    parser_for_template,
    read_chat_template,
)
from sharpen.environments.tool_formats.harmony import HarmonyToolCallParser
from sharpen.environments.tool_formats.json_formats import (
    HermesToolCallParser,
    JsonToolCallParser,
    Llama3JsonToolCallParser,
    MistralToolCallParser,
)
from sharpen.environments.tool_formats.qwen3_coder import Qwen3CoderToolCallParser

TOOL_CALL_PARSERS: dict[str, ToolCallParserFactory] = {
    "hermes": HermesToolCallParser,
    "json": JsonToolCallParser,
    "llama3_json": Llama3JsonToolCallParser,
    "qwen3_coder": Qwen3CoderToolCallParser,
    "mistral": MistralToolCallParser,
    "harmony": HarmonyToolCallParser,
}

__all__ = [
    "TOOL_CALL_PARSERS",
    "HarmonyToolCallParser",
    "HermesToolCallParser",
    "JsonToolCallParser",
    "Llama3JsonToolCallParser",
    "MistralToolCallParser",
    "Qwen3CoderToolCallParser",
    "ToolCall",
    "ToolCallError",
    "ToolCallParser",
    "ToolCallParserFactory",
    "ToolSpecs",
    "UnknownToolCallFormatError",
    "parser_for_template",
    "read_chat_template",
]
