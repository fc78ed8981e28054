"""Control tokens: text never becomes the tokenizer's special tokens, and prompts given as ids stay in its vocabulary.

Owns the one place where a chat template's text becomes token ids (`template_ids`: prompts, multi-turn
continuations, the agent endpoint's chats, vision prompts, the reward-model server's inputs all render through it),
the tokenisation of free text (`encode_text`), and the check of prompts given as token ids (`check_token_ids`).

The policy is *split, never refuse*: a control token typed as text -- a chat-template marker such as ``<|im_end|>``,
BOS/EOS, a tool-call delimiter, any added token marked special, and any other added token the chat template itself
writes (Qwen's ``<tool_call>``) -- becomes the ordinary tokens of its characters, so the policy reads what was typed
and no turn can be forged. Refusing would end every episode whose tool output merely quotes a template (a file of a
tokenizer's docs, a web page about chat formats); splitting costs nothing and loses no text.

How: when no string of the messages holds a control token's text (nearly always), the tokenizer renders the chat as
it always does. Otherwise each such occurrence in the messages is swapped for a private-use placeholder, the
template is rendered to text (so every control token left in the text is the template's own), the text is cut at
those markers -- exactly where the tokenizer itself cuts at added tokens -- and each piece between them is
tokenised with the typed occurrences put back and special tokens split (``split_special_tokens``). The result is then
checked: control ids appear only where the template wrote one. For benign text the pieces tokenise as the whole text
does (tested on SmolLM2's and a Llama-3-style template), so ids do not depend on which path rendered them.

It does not guard what a caller renders itself: ``/v1/completions`` with a text prompt is the raw-prompt route, where
the agent is the template's author (`sharpen.rollout.agent_session`). Imports no transformers: any tokenizer with HF's
``apply_chat_template``, ``__call__`` and ``added_tokens_decoder`` works; one without ``added_tokens_decoder``
(sharpen.testing's byte tokenizer, which renders ids itself) has no text that could become a control token.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: a placeholder is OPEN index CLOSE
_PLACEHOLDER = re.compile(f"{_OPEN}([0-9]+){_CLOSE}")


class TokenIdError(ValueError):
    """A prompt given as token ids that are not ids of the tokenizer's vocabulary."""


@dataclass(frozen=True, slots=True)
class ControlTokens:
    """A tokenizer's control tokens: their text -> id, and how the tokenizer matches them."""

    ids: Mapping[str, int]
    special: frozenset[str]
    """Those marked special (split by ``split_special_tokens``); the others are added tokens the template writes."""
    lstrip: frozenset[str]
    rstrip: frozenset[str]
    pattern: re.Pattern[str] | None
    """Any of them, longest first (None: the tokenizer has none)."""

    def split(self, text: str) -> list[str]:
        """``text`` cut at the control tokens in it: text, token, text, ..., text (odd positions are tokens)."""
        return [text] if self.pattern is None else self.pattern.split(text)


@functools.lru_cache(maxsize=16)
def control_tokens(tokenizer: Any) -> ControlTokens:
    """The tokenizer's added tokens marked special, and those others that its chat template writes."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}  # None: a tokenizer that renders ids itself
    template = getattr(tokenizer, "chat_template", None)
    template_text = template if isinstance(template, str) else ""
    chosen = {
        token_id: token
        for token_id, token in added.items()
        if token.content and (token.special or token.content in template_text)
    }
    contents = sorted({token.content for token in chosen.values()}, key=len, reverse=True)
    return ControlTokens(
        ids={token.content: int(token_id) for token_id, token in chosen.items()},
        special=frozenset(token.content for token in chosen.values() if token.special),
        lstrip=frozenset(token.content for token in chosen.values() if token.lstrip),
        rstrip=frozenset(token.content for token in chosen.values() if token.rstrip),
        pattern=re.compile("(" + "|".join(map(re.escape, contents)) + ")") if contents else None,
    )


def template_ids(
    tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools: list[Any] | None = None
) -> list[int]:
    """The flat token ids of ``messages`` (dicts as the template reads them) under the tokenizer's chat template; a
    control token typed anywhere in the messages or tools becomes ordinary tokens (the module's policy)."""
    controls = control_tokens(tokenizer)
    typed: list[str] = []  # what each placeholder stands for
    hidden_messages, hidden_tools = _hide_typed(messages, controls, typed), _hide_typed(tools, controls, typed)
    if not typed:  # nothing typed: the tokenizer's own render, ids unchanged
        extra = {} if tools is None else {"tools": tools}
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **extra
        )
        # transformers < 5 returns the ids; transformers >= 5 returns a BatchEncoding (a Mapping) holding them.
        return _flat_ids(rendered["input_ids"] if isinstance(rendered, Mapping) else rendered)
    extra = {} if tools is None else {"tools": hidden_tools}
    text = tokenizer.apply_chat_template(
        hidden_messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
    )
    if not isinstance(text, str):
        raise ValueError(f"chat template: expected the rendered text, got {type(text).__name__}")
    return _encode_pieces(tokenizer, controls, controls.split(text), typed)


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of free text (no template) with every control token typed in it split into ordinary tokens;
    ``add_special_tokens`` adds the tokenizer's own (BOS) around it, as ``tokenizer(text)`` does."""
    controls = control_tokens(tokenizer)
    parts = controls.split(text)
    if any(marker not in controls.special for marker in parts[1::2]):  # an added token the template writes
        if add_special_tokens:  # not needed yet: a tokenizer without a template has no such control tokens
            raise ValueError("encode_text: add_special_tokens with a non-special control token typed in the text")
        return _encode_text_piece(tokenizer, controls, parts)
    return _flat_ids(tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True)["input_ids"])


def check_token_ids(ids: Any, *, vocab_size: int, where: str) -> list[int]:
    """``ids`` as a list of ints, each in ``[0, vocab_size)``; anything else is one `TokenIdError` naming the first
    bad id, so a bad prompt is refused before an engine sees it (an out-of-range id is a device-side assert on
    CUDA, and an engine error would stop the run)."""
    if not isinstance(ids, list) or not ids:
        raise TokenIdError(f"{where}: expected a non-empty list of token ids, got {type(ids).__name__}")
    for position, token_id in enumerate(ids):
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise TokenIdError(f"{where}: token {position} is {token_id!r}, not an integer token id")
        if not 0 <= token_id < vocab_size:
            raise TokenIdError(
                f"{where}: token {position} is {token_id}, outside the vocabulary (ids 0 to {vocab_size - 1})"
            )
    return list(ids)


def _hide_typed(value: Any, controls: ControlTokens, typed: list[str]) -> Any:
    """``value`` (messages, tools) with every control token in its strings, and every placeholder character, swapped
    for a placeholder; ``typed`` collects what each stands for. Returns ``value`` itself when nothing was swapped."""
    if isinstance(value, str):
        if controls.pattern is None or (_OPEN not in value and not controls.pattern.search(value)):
            return value
        pieces = re.split(f"({_OPEN})", value)
        out: list[str] = []
        for index, piece in enumerate(pieces):
            parts = [piece] if index % 2 else controls.split(piece)
            for part_index, part in enumerate(parts):
                if index % 2 or part_index % 2:  # a control token or a placeholder character as typed
                    out.append(f"{_OPEN}{len(typed)}{_CLOSE}")
                    typed.append(part)
                else:
                    out.append(part)
        return "".join(out)
    if isinstance(value, Mapping):
        items = {key: _hide_typed(item, controls, typed) for key, item in value.items()}
        return value if all(items[key] is item for key, item in value.items()) else items
    if isinstance(value, list | tuple):
        items = [_hide_typed(item, controls, typed) for item in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else type(value)(items)
    return value


def _encode_pieces(tokenizer: Any, controls: ControlTokens, pieces: list[str], typed: list[str]) -> list[int]:
    """Token ids of rendered text already cut at the template's control tokens (`ControlTokens.split`): each token
    its id, the text between them tokenised with the typed occurrences put back, as text."""
    ids: list[int] = []
    for index, piece in enumerate(pieces):
        if index % 2:
            ids.append(controls.ids[piece])
            continue
        if index > 0 and pieces[index - 1] in controls.rstrip:  # the tokenizer folds this space into the token
            piece = piece.lstrip()
        if index + 1 < len(pieces) and pieces[index + 1] in controls.lstrip:
            piece = piece.rstrip()
        text = _PLACEHOLDER.sub(lambda match: typed[int(match.group(1))], piece)
        ids += _encode_text_piece(tokenizer, controls, controls.split(text))
    template_markers = [controls.ids[p] for p in pieces[1::2]]
    control_ids = set(controls.ids.values())
    if [token_id for token_id in ids if token_id in control_ids] != template_markers:
        raise RuntimeError(
            "chat template: typed text became control tokens although it was tokenised with them split (is the "
            "tokenizer shared with another thread?)"
        )
    return ids


def _encode_text_piece(tokenizer: Any, controls: ControlTokens, parts: list[str]) -> list[int]:
    """Token ids of text cut at control tokens typed in it (`ControlTokens.split`), all of it as text: special ones
    split by the tokenizer, the others (added tokens the template writes) as their first character and the rest."""
    ids: list[int] = []
    run: list[str] = []  # text and special tokens: tokenised together, so text keeps its natural merges
    for index, part in enumerate(parts):
        if index % 2 and part not in controls.special:
            ids += _split_encode(tokenizer, "".join(run)) + _split_encode(tokenizer, part[:1])
            run = [part[1:]]
        else:
            run.append(part)
    return ids + _split_encode(tokenizer, "".join(run))


def _split_encode(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    return _flat_ids(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _flat_ids(ids: Sequence[Any]) -> list[int]:
    if len(ids) > 0 and not isinstance(ids[0], int):
        raise ValueError(f"chat template: expected a flat list of token ids, got a list of {type(ids[0]).__name__}")
    return [int(token_id) for token_id in ids]
