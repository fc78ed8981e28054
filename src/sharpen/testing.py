"""Tiny random models for tests and benchmarks: a 2-layer Llama (causal LM, or a one-label reward model) with
SmolLM2's tokenizer and chat template, built in a second from a fixed seed. The 49k vocabulary dominates its size.
torch and transformers are imported only when a model is built. And `ByteChatTokenizer`, a chat tokenizer without
a model, for tests and benchmarks of the episode path."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, ClassVar

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def save_tiny_llama(folder: Path, *, tokenizer_from: Path, reward_model: bool = False, hidden_size: int = 32) -> Path:
    """Write the model and the tokenizer files of ``tokenizer_from`` into ``folder``; returns ``folder``. Seeded
    (``torch.manual_seed(0)``), so the same call gives the same weights. ``reward_model``: a sequence classifier
    with one label instead of a causal LM."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    make_config: Any = LlamaConfig  # its stubs lack PretrainedConfig's generic keywords (num_labels)
    shape = {
        "vocab_size": 49152,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    if reward_model:
        model = LlamaForSequenceClassification(make_config(**shape, num_labels=1, pad_token_id=2))
    else:
        config = make_config(
            **shape,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
        )
        model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy2(tokenizer_from / name, Path(folder) / name)
    return Path(folder)


class ByteChatTokenizer:
    """A ChatML tokenizer over bytes, for tests and benchmarks of everything but the model: each message is
    ``<|im_start|> role content <|im_end|> "\\n"``, each byte of text one token (its value + 16), below those the
    special tokens. It renders a chat in microseconds where a Jinja chat template takes hundreds, so benchmarks of
    millions of episodes measure the episode path, not the template."""

    pad_token_id, im_start_id, eos_token_id = 0, 1, 2
    role_ids: ClassVar[dict[str, int]] = {"system": 3, "user": 4, "assistant": 5, "tool": 6}
    newline_id = 16 + ord("\n")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [16 + byte for byte in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 16 for i in ids if i >= 16).decode(errors="replace")

    def apply_chat_template(
        self, conversation: list[dict[str, Any]], *, add_generation_prompt: bool, tokenize: bool, **_: Any
    ) -> list[int]:
        assert tokenize, "ByteChatTokenizer renders token ids only"
        ids: list[int] = []
        for message in conversation:
            ids += [self.im_start_id, self.role_ids[message["role"]], *self.encode(message["content"] or "")]
            ids += [self.eos_token_id, self.newline_id]
        return [*ids, self.im_start_id, self.role_ids["assistant"]] if add_generation_prompt else ids
