"""render_prompt: chat template with the generation prompt, as a flat list of ints, for both return shapes."""

from __future__ import annotations

import pytest

from sharpen.data import render_prompt
from sharpen.types import Message

_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
_MESSAGES = (Message(role="system", content="be brief"), Message(role="user", content="hi there"))


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "be", "brief", "hi", "there"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = _TEMPLATE
    return tokenizer


def test_render_prompt_with_a_real_tokenizer():
    ids = render_prompt(_tiny_tokenizer(), _MESSAGES)
    assert ids == [1, 3, 6, 7, 2, 1, 4, 8, 9, 2, 1, 5]
    assert all(type(i) is int for i in ids)


class _FakeTokenizer:
    def __init__(self, result):
        self.result = result
        self.calls = []

    def apply_chat_template(self, conversation, **kwargs):
        self.calls.append((conversation, kwargs))
        return self.result


@pytest.mark.parametrize("result", [[5, 6, 7], {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}])
def test_render_prompt_accepts_both_return_shapes(result):
    tokenizer = _FakeTokenizer(result)
    assert render_prompt(tokenizer, _MESSAGES) == [5, 6, 7]
    ((conversation, kwargs),) = tokenizer.calls
    assert conversation == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert kwargs["add_generation_prompt"] is True and kwargs["tokenize"] is True


def test_render_prompt_rejects_batched_output_and_no_messages():
    with pytest.raises(ValueError, match="flat list"):
        render_prompt(_FakeTokenizer([[1, 2]]), _MESSAGES)
    with pytest.raises(ValueError, match="no messages"):
        render_prompt(_FakeTokenizer([1]), ())
