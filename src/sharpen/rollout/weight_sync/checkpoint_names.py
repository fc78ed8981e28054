"""The trainer's weight names turned into a checkpoint's, for the engines that load checkpoint names (vLLM).

transformers 5 holds some families' weights differently in memory than in their checkpoints: an MoE layer's experts
as one fused tensor (Mixtral's ``mlp.experts.gate_up_proj``, ``[experts, 2 x intermediate, hidden]``) that its
checkpoints, and vLLM's loaders, name per expert (``block_sparse_moe.experts.E.w1.weight``, ``w3``, ``w2``). A sync
sends what the trainer holds; `CheckpointNames` applies transformers' own reverse conversion (what `save_pretrained`
writes) to each tensor as it arrives, on a meta-device model of the config (no memory). Dense families have no
conversion: `CheckpointNames.of` returns None and their tensors pass untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


class CheckpointNames:
    """Renames (and splits) in-memory weights into checkpoint weights, one tensor at a time."""

    def __init__(self, meta_model: Any) -> None:
        self.meta_model = meta_model

    @staticmethod
    def of(config: Any) -> CheckpointNames | None:
        """The renaming for a transformers ``config`` (a model's ``PretrainedConfig``), or None when its family has no
        checkpoint conversion (the dense families, the vision-language models here: nothing is built for them)."""
        from transformers import AutoModelForCausalLM
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping

        if not get_checkpoint_conversion_mapping(config.model_type):
            return None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return CheckpointNames(model) if get_model_conversion_mapping(model, add_legacy=False) else None

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        from transformers.core_model_loading import revert_weight_conversion

        for name, tensor in weights:
            yield from revert_weight_conversion(self.meta_model, {name: tensor}).items()
