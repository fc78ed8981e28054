"""Chat rendering: prompt messages -> the token ids the policy is conditioned on, via the tokenizer's chat template.

Owns the one place where messages become tokens, so the engine and the trainer see identical prompt ids. It renders
later turns only as continuations (`render_continuation`): tokens are never re-rendered from text between
turns. Every render goes through `sharpen.control_tokens.template_ids`, so a chat-template marker typed in a message
(a dataset row, an observation, a tool's output, an agent's message) stays text and never becomes the marker's token.
Imports no transformers: any object with HF's ``apply_chat_template`` works.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from sharpen.control_tokens import template_ids
from sharpen.types import Message


class ImageInputError(ValueError):
    """Images given to a model or tokenizer that cannot take them, or an image that cannot be read."""


def render_prompt(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template, ending with the assistant generation prompt.
    Content given as parts renders as its text; images need a vision model's `vision.VisionProcessor`."""
    if not messages:
        raise ValueError("render_prompt: no messages to render")
    return template_ids(tokenizer, _text_messages("render_prompt", messages), add_generation_prompt=True)


def render_messages(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, tools: list[Any] | None = None
) -> list[int]:
    """`render_prompt` for messages as OpenAI clients send them (dicts, assistant ``tool_calls`` included) and tool
    definitions, which the template renders where it puts them (usually the system prompt)."""
    if not messages:
        raise ValueError("render_messages: no messages to render")
    return template_ids(tokenizer, [dict(m) for m in messages], add_generation_prompt=True, tools=tools)


# A conversation that ends with an assistant turn: what a continuation is rendered after. Its content never reaches
# the model; only the tokens the template puts after it do.
_ANCHOR = ({"role": "user", "content": "anchor"}, {"role": "assistant", "content": "anchor"})


def render_continuation(tokenizer: Any, messages: Sequence[Message], *, end_of_turn_id: int) -> list[int]:
    """Token ids that follow an assistant turn ending in ``end_of_turn_id``: ``messages`` (tool results, the next
    user turn) under the chat template, then the assistant generation prompt.

    Multi-turn episodes append these to the tokens generated so far, so past turns are never re-rendered (which
    could re-tokenise the model's text differently, or let a template rewrite history). They are the tokens the
    template puts after the end of an anchor assistant turn: whatever separator the template places between turns
    (SmolLM2's "\\n") belongs to the continuation."""
    if not messages:
        raise ValueError("render_continuation: no messages to render")
    return continuation_ids(tokenizer, _text_messages("render_continuation", messages), end_of_turn_id=end_of_turn_id)


def continuation_ids(tokenizer: Any, messages: list[dict[str, Any]], *, end_of_turn_id: int) -> list[int]:
    """`render_continuation` of messages already as the template reads them (dicts; `vision` renders image parts)."""
    base = _anchor_ids(tokenizer)
    full = template_ids(tokenizer, [*_ANCHOR, *messages], add_generation_prompt=True)
    if end_of_turn_id not in base:
        raise ValueError(
            f"render_continuation: the chat template does not end an assistant turn with token {end_of_turn_id}; "
            "multi-turn episodes need the end-of-turn token the engine stops on"
        )
    end = len(base) - base[::-1].index(end_of_turn_id)  # just past the anchor turn's end-of-turn token
    if full[:end] != base[:end]:
        raise ValueError("render_continuation: the chat template renders past turns differently once more follow")
    return full[end:]


@functools.lru_cache(maxsize=16)
def _anchor_ids(tokenizer: Any) -> list[int]:
    """The anchor conversation's ids, rendered once per tokenizer (half of every continuation's template work);
    read-only."""
    return template_ids(tokenizer, list(_ANCHOR), add_generation_prompt=False)


def _text_messages(where: str, messages: Sequence[Message]) -> list[dict[str, Any]]:
    """``messages`` as the chat template reads them, each content a string; images are an error here (a text-only
    tokenizer has no placeholder for them, and multi-turn observations do not carry images yet)."""
    num_images = sum(len(m.images) for m in messages)
    if num_images:
        raise ImageInputError(
            f"{where}: the messages hold {num_images} image(s), which a text-only tokenizer cannot render: a "
            "vision-language model's prompts go through sharpen.data.vision.VisionProcessor.render_prompt"
        )
    return [{"role": m.role, "content": m.text} for m in messages]
