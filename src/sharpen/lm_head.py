"""The LM head in float32 (``trainer.lm_head_float32``): `keep_lm_head_float32` makes a model's output embedding a
`Float32Head`, whose logits are computed in float32 whatever the model's dtype or autocast. One module for the
trainer's backends and the hf engine, which import nothing of each other (docs/algorithms.md, Precision)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Float32Head", "keep_lm_head_float32"]


class Float32Head(nn.Linear):
    """An LM head (`nn.Linear`) that computes its logits in float32 from float32 inputs, outside any autocast: its
    weight is used in float32 (master weights are float32 already; a float16 or bfloat16 weight is upcast, so its
    rounding stays, as in vLLM's ``head_dtype = "float32"``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=input.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(input.float(), self.weight.float(), bias)


def keep_lm_head_float32(model: nn.Module) -> None:
    """Make ``model``'s output embedding (its LM head) a `Float32Head` in place: the same parameters and names (a
    tied head stays tied), only its forward changes. Every scoring path calls the head module, so each gets float32
    logits."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear and not isinstance(head, Float32Head):
        raise ValueError(f"trainer.lm_head_float32 needs a plain linear LM head; this model's is {type(head).__name__}")
    head.__class__ = Float32Head
