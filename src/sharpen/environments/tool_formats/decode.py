"""The text of a completion: `completion_text`, the one decode of a completion's token ids.

Engines (``hf``, ``vllm``), the agent endpoint and the loop's joined completions decode here, so every reader of a
completion's text sees the same string. It skips special tokens as ``skip_special_tokens=True`` does (end of turn,
padding, chat markers), except the tool-call formats' markers (`TOOL_CALL_MARKERS`): some families' tokenizers hold
them as special tokens (gpt-oss's ``<|channel|>`` and ``<|message|>``, Mistral's ``[TOOL_CALLS]``, Llama 3's
``<|python_tag|>``), and a decode that skipped them would lose every call the policy makes in those formats. It only
makes text: the tokens recorded and trained on stay the engine's, never re-tokenised from it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sharpen.environments.tool_formats.harmony import HarmonyToolCallParser
from sharpen.environments.tool_formats.json_formats import (
    HermesToolCallParser,
    JsonToolCallParser,
    Llama3JsonToolCallParser,
    MistralToolCallParser,
)
from sharpen.environments.tool_formats.qwen3_coder import Qwen3CoderToolCallParser

_FORMATS = (
    HermesToolCallParser,
    JsonToolCallParser,
    Llama3JsonToolCallParser,
    Qwen3CoderToolCallParser,
    MistralToolCallParser,
    HarmonyToolCallParser,
)
TOOL_CALL_MARKERS: frozenset[str] = frozenset(marker for parser in _FORMATS for marker in parser.markers)
"""Every format's markers: the special tokens a completion's text keeps."""

_SKIPPED: weakref.WeakKeyDictionary[Any, tuple[int, frozenset[int]]] = weakref.WeakKeyDictionary()
"""tokenizer -> (its length when seen, the ids `completion_text` skips): a token added later changes the length."""


def completion_text(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """``token_ids`` decoded without their special tokens, tool-call markers aside (kept as their text)."""
    skipped = _skipped_ids(tokenizer)
    return tokenizer.decode([i for i in token_ids if i not in skipped], skip_special_tokens=False)


def local_decoder(model_path: Path) -> Callable[[list[int]], str] | None:
    """`completion_text` with the tokenizer of the model folder at ``model_path``, for an engine whose server sends
    text decoded without any special token (vLLM's and SGLang's servers); None when there is no such folder here
    (a server's model that only the server holds) or no tokenizer in it: the server's own text is then all there
    is."""
    folder = Path(model_path)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return lambda ids: completion_text(tokenizer, ids)


def visible_text(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """``token_ids`` decoded without any special token, tool-call markers included: text shown as a message's
    content where no parser reads it."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def _skipped_ids(tokenizer: Any) -> frozenset[int]:
    size = len(tokenizer)
    cached = _SKIPPED.get(tokenizer)
    if cached is not None and cached[0] == size:
        return cached[1]
    special = {i: token.content for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    special.update(zip(tokenizer.all_special_ids, tokenizer.all_special_tokens, strict=True))
    skipped = frozenset(i for i, content in special.items() if content not in TOOL_CALL_MARKERS)
    _SKIPPED[tokenizer] = (size, skipped)
    return skipped
