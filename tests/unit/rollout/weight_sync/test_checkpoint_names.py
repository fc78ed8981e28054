"""`CheckpointNames`: the trainer's in-memory weights of a transformers MoE model, renamed and split into what
`save_pretrained` writes (the per-expert names vLLM loads); a dense model has no renaming."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.rollout.weight_sync.checkpoint_names import CheckpointNames

COMMON = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
COMMON |= {"num_key_value_heads": 2, "max_position_embeddings": 64}


def _model(family: str):
    import transformers

    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config)
    config = transformers.Qwen3MoeConfig(**COMMON, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    return transformers.Qwen3MoeForCausalLM(config)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_in_memory_weights_become_the_checkpoint_weights(family: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = _model(family)
    model.save_pretrained(tmp_path)
    written = load_file(str(tmp_path / "model.safetensors"))
    names = CheckpointNames.of(model.config)
    assert names is not None
    renamed = dict(names(model.state_dict().items()))
    assert renamed.keys() == written.keys()
    assert any(".experts.3." in name for name in renamed)  # split per expert
    for name, tensor in written.items():
        assert torch.equal(renamed[name], tensor), name


def test_a_dense_model_has_no_renaming() -> None:
    from transformers import LlamaConfig

    assert CheckpointNames.of(LlamaConfig(**COMMON, intermediate_size=48)) is None


def test_a_vision_language_model_has_no_renaming(tiny_idefics3_path: Path) -> None:
    """Its config is not a causal LM's (nothing is built for it): vLLM's own loader names its weights as today."""
    from transformers import AutoConfig

    assert CheckpointNames.of(AutoConfig.from_pretrained(tiny_idefics3_path)) is None
