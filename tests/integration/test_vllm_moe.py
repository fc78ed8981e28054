"""A Mixture-of-Experts model through vLLM's CPU build: a tiny random Mixtral (head_dim 64, the CPU attention
kernels' smallest; 4 experts, 2 a token) serves, and a weight sync from a trainer that holds its experts fused
(transformers 5: ``mlp.experts.gate_up_proj``) reaches vLLM's per-expert weights: the engine's probe logprobs then
match the trainer's, as for a dense model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sharpen.config.engines import VllmEngineConfig
from sharpen.config.schema import TrainerConfig
from sharpen.orchestration.weight_sync import WeightSync
from sharpen.testing import TOKENIZER_FILES
from sharpen.trainer import SingleDeviceBackend, Trainer

pytestmark = pytest.mark.slow

TOLERANCE = 1e-3
PROBE = [1, 504, 3458, 282, 4193, 314, 260, 2451, 30]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    import shutil

    from transformers import MixtralConfig, MixtralForCausalLM

    folder = tmp_path_factory.mktemp("tiny-mixtral")
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    MixtralForCausalLM(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (smollm2_path / name).is_file():
            shutil.copy2(smollm2_path / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator:
    from sharpen.rollout.engines.vllm import VllmEngine

    engine = VllmEngine(VllmEngineConfig(max_model_len=256), model_path=model_path, dtype="float32", seed=0)
    yield engine
    engine.close()


def mean_abs(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def test_a_sync_of_fused_experts_reaches_the_per_expert_weights(engine, model_path: Path) -> None:
    config = TrainerConfig(micro_batch_size=4, num_threads=1, precision="float32")
    trainer = Trainer(
        config, backend=SingleDeviceBackend(config, model_path=model_path, dtype="float32"), pad_token_id=2
    )
    assert mean_abs(engine.score(PROBE), trainer.compute_logprobs(PROBE)) < TOLERANCE  # the same model at start
    names = [name for name, _ in trainer.named_weights()]
    assert "model.layers.0.mlp.experts.gate_up_proj" in names  # fused in the trainer
    with torch.no_grad():  # every expert and every router moves
        for name, parameter in trainer.backend.model.named_parameters():
            scale = 0.5 if name.endswith("mlp.gate.weight") else 0.05
            parameter.add_(torch.randn_like(parameter) * scale)
    before = engine.score(PROBE)
    assert mean_abs(before, trainer.compute_logprobs(PROBE)) > 10 * TOLERANCE
    metrics = WeightSync(probe_ids=PROBE, tolerance=TOLERANCE, verify=True)(trainer, engine, version=1)
    assert metrics["sync/probe_mismatch_mean"] < TOLERANCE
