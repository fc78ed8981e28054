"""Which tool-call format a chat template renders: `parser_for_template`.

Reads only the template's text, for markers that its tool-call rendering writes (checked in this order, since
Qwen3-Coder's template also writes ``<tool_call>``); it renders nothing and loads no tokenizer (`read_chat_template`
reads a model folder's template from its files).
"""

from __future__ import annotations

import json
from pathlib import Path

_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>", "to=", "functions.")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|start_header_id|>", '"parameters": ')),
)


class UnknownToolCallFormatError(ValueError):
    """A chat template renders tool calls, but in none of the formats sharpen reads."""


def parser_for_template(chat_template: str | None) -> str:
    """The name of the `TOOL_CALL_PARSERS` entry that reads what ``chat_template`` renders as tool calls: the first
    format whose markers are all in the template; a template that renders no tool calls (SmolLM2's, plain ChatML)
    gets ``hermes``, the format sharpen's tool environments teach in their system prompt. A template that renders
    ``tool_calls`` in an unknown format is an error: the parser must then be named."""
    text = chat_template or ""
    for name, markers in _MARKERS:
        if all(marker in text for marker in markers):
            return name
    if "tool_calls" in text:
        raise UnknownToolCallFormatError(
            "the chat template renders tool calls in a format sharpen has no parser for (known: harmony, mistral, "
            "qwen3_coder, hermes, llama3_json); name the format's parser in tool_parser, or add one to "
            "sharpen.environments.tool_formats.TOOL_CALL_PARSERS"
        )
    return "hermes"


def read_chat_template(model_dir: Path) -> str | None:
    """The chat template of a Hugging Face model folder: ``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template`` (of a list of named templates, the ``tool_use`` one, else the ``default``); None without one."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config_file = model_dir / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    template = json.loads(config_file.read_text()).get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("tool_use") or named.get("default")
    return template if isinstance(template, str) else None
