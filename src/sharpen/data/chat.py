"""Chat rendering: prompt messages -> the token ids the policy is conditioned on, via the tokenizer's chat template.

Owns the one place where messages become tokens, so the engine and the trainer see identical prompt ids. It does
not render completions or later turns (tokens are never re-rendered from text between turns). Imports no
transformers: any object with HF's ``apply_chat_template`` works.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sharpen.types import Message


def render_prompt(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template, ending with the assistant generation prompt."""
    if not messages:
        raise ValueError("render_prompt: no messages to render")
    rendered = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=True,
        tokenize=True,
    )
    # transformers < 5 returns the ids; transformers >= 5 returns a BatchEncoding (a Mapping) holding them.
    ids = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered
    if len(ids) > 0 and not isinstance(ids[0], int):
        raise ValueError(f"render_prompt: expected a flat list of token ids, got a list of {type(ids[0]).__name__}")
    return [int(token_id) for token_id in ids]
