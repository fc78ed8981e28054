"""`CheckpointNames`: the trainer's in-memory weights of a transformers MoE model, renamed and split into what
`save_pretrained` writes (the per-expert names vLLM loads); a dense model has no renaming."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.rollout.weight_sync.checkpoint_names import CheckpointNames
from support.tiny_moe import COMMON, tiny_moe


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_in_memory_weights_become_the_checkpoint_weights(family: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = tiny_moe(family)
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
