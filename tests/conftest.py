"""Shared fixtures: the real small model (pulled by `make test`) and a tiny random model with its tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sharpen.config.models import ModelNotFoundError, resolve_model_path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    try:
        return resolve_model_path("smollm2-135m-instruct")
    except ModelNotFoundError as error:
        pytest.fail(f"{error} (`make test` pulls it before running the tests)")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template (the 49k vocab dominates its cost)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in _TOKENIZER_FILES:
        if (smollm2_path / name).is_file():
            shutil.copy2(smollm2_path / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_reward_model_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """A 2-layer random Llama reward model (one label) with SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    folder = tmp_path_factory.mktemp("tiny-rm")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_labels=1,
        pad_token_id=2,
    )
    LlamaForSequenceClassification(config).save_pretrained(folder)
    for name in _TOKENIZER_FILES:
        if (smollm2_path / name).is_file():
            shutil.copy2(smollm2_path / name, folder / name)
    return folder
