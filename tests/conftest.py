"""Shared fixtures: the real small model (pulled by `make test`), and tiny random models (a Llama, a Qwen2-VL, an
Idefics3, a Mixtral) with its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharpen.config.models import ModelNotFoundError, resolve_model_path
from sharpen.testing import save_tiny_idefics3, save_tiny_llama, save_tiny_mixtral, save_tiny_qwen2_vl


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    try:
        return resolve_model_path("smollm2-135m-instruct")
    except ModelNotFoundError as error:
        pytest.fail(f"{error} (`make test` pulls it before running the tests)")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template (the 49k vocab dominates its cost)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer_from=smollm2_path)


@pytest.fixture(scope="session")
def tiny_moe_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """A 2-layer random Mixtral (4 experts, 2 a token) with SmolLM2's tokenizer and chat template."""
    return save_tiny_mixtral(tmp_path_factory.mktemp("tiny-moe"), tokenizer_from=smollm2_path)


@pytest.fixture(scope="session")
def tiny_reward_model_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """A 2-layer random Llama reward model (one label) with SmolLM2's tokenizer and chat template."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-rm"), tokenizer_from=smollm2_path, reward_model=True)


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """A tiny random Qwen2-VL (a vision-language model) with SmolLM2's tokenizer plus Qwen2-VL's vision tokens."""
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"), tokenizer_from=smollm2_path)


@pytest.fixture(scope="session")
def tiny_idefics3_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """A tiny random Idefics3 (SmolVLM's architecture; the vision-language model vLLM's CPU build serves) with
    SmolLM2's tokenizer plus Idefics3's image tokens."""
    return save_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3"), tokenizer_from=smollm2_path)
