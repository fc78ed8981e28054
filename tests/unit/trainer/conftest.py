"""Shared fixtures of the trainer unit tests: one torch thread, and a tiny random tied Llama saved to disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

VOCAB = 128
PAD = 0


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: a 32-wide model gains nothing from more, and on a busy 2-core machine a second thread
    spin-waiting for a core turns each 10 us matmul into 15 ms."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=PAD,
    )
    folder = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder
