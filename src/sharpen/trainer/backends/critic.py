"""The value model of PPO with a critic, on one device: the policy's decoder (a separate copy) with a scalar head; for
a vision-language model its base model (vision tower and decoder), which takes the rows' images.

Owns the critic's parameters, its optimizer and their persistence. Knows nothing of rollouts, GAE or losses: it
turns token ids into per-position values and applies accumulated gradients, like `SingleDeviceBackend` does for
the policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from sharpen.config.algorithm import CriticConfig
from sharpen.data.vision import VisionProcessor, is_vision_model, model_class
from sharpen.trainer.backends.scoring import autocast_to, rows_image_inputs
from sharpen.trainer.optim import build_adamw
from sharpen.trainer.precision import Precision
from sharpen.types import ImagePart

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ValueNetwork(nn.Module):
    """A causal LM's decoder (no LM head; a vision-language model's base model) and a linear head from its last
    hidden state to one value."""

    def __init__(self, decoder: nn.Module, *, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.decoder = decoder
        self.head = nn.Linear(hidden_size, 1, dtype=dtype)
        # A zero head makes every initial value exactly 0, whatever the seed: the first advantages are the
        # (discounted) rewards themselves, and two runs of one recipe start from the same critic.
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)


class ValueModel:
    def __init__(
        self,
        config: CriticConfig,
        *,
        model_path: Path,
        dtype: str,
        device: torch.device,
        precision: Precision,
        gradient_checkpointing: bool,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        self.config = config
        self.device = device
        # bf16 autocast under bf16; float32 under fp16 too: the critic's backward (trainer.py) applies no loss scale
        self.autocast_dtype = torch.bfloat16 if precision == "bf16" else None
        self.model_path = Path(model_path)
        self.vision = VisionProcessor.from_pretrained(model_path) if is_vision_model(model_path) else None
        torch_dtype = getattr(torch, dtype)
        model: PreTrainedModel = model_class(model_path).from_pretrained(model_path, dtype=torch_dtype)
        model.config.use_cache = False
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # The LM head is dropped (with tied embeddings it is the input embedding, which the decoder keeps); a
        # vision-language model keeps its vision tower, which embeds the images at their placeholders.
        body = model.get_decoder() if self.vision is None else model.base_model
        hidden_size = model.config.get_text_config().hidden_size
        network = ValueNetwork(body, hidden_size=hidden_size, dtype=torch_dtype)
        self.network: ValueNetwork = network.to(device)
        self.network.train()
        self.optimizer = build_adamw(
            self.network.parameters(), learning_rate=config.learning_rate, betas=betas, weight_decay=weight_decay
        )

    def values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        target_mask: torch.Tensor,
        images: Sequence[tuple[ImagePart, ...]] = (),
    ) -> torch.Tensor:
        """Value of each state from which a target token is predicted; [batch, seq - 1] float32, 0 elsewhere.

        ``input_ids``/``attention_mask``: [batch, seq]; ``target_mask``: [batch, seq - 1], True where
        ``input_ids[:, t + 1]`` is a completion token. Position t holds V(s_t), read from the hidden state at
        token t: the same positions as the policy's logprobs, so advantages, logprobs and values line up.
        ``images``: each row's (a vision-language model's image rows).
        """
        return self.values_and_final_values(input_ids, attention_mask, target_mask, images)[0]

    def values_and_final_values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        target_mask: torch.Tensor,
        images: Sequence[tuple[ImagePart, ...]] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`values` ([batch, seq - 1]) and, in the same forward pass, each row's value of the state after its last
        token ([batch] float32): V read from the hidden state at the row's last attended (right-padded) position,
        the state from which the next token would be generated; GAE bootstraps a truncated completion with it."""
        last = attention_mask.sum(dim=1) - 1  # [batch]: right padding, so the last real token's position
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        image_inputs = rows_image_inputs(self.vision, input_ids, images, model=str(self.model_path)) or {}
        with autocast_to(self.device, self.autocast_dtype):
            hidden = self.network.decoder(
                input_ids=input_ids, attention_mask=attention_mask, **image_inputs
            ).last_hidden_state
            selected = hidden[:, :-1][target_mask]  # [num_targets, hidden]
            scores = self.network.head(selected).squeeze(-1).float()  # [num_targets]
            final = self.network.head(hidden[rows, last]).squeeze(-1).float()  # [batch]
        values = torch.zeros(target_mask.shape, dtype=torch.float32, device=input_ids.device)
        values[target_mask] = scores
        return values, final

    def clip_and_step(self, max_grad_norm: float) -> float:
        """Clip the accumulated gradient, step the optimizer, clear gradients; returns the pre-clip grad norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.network.parameters(), max_grad_norm)
        if torch.isfinite(grad_norm):  # a non-finite gradient skips the step (see SingleDeviceBackend)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def save(self, folder: Path) -> None:
        """Weights (safetensors) and optimizer state into ``folder`` (the trainer passes ``checkpoint/critic``)."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.detach().contiguous() for name, tensor in self.network.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"))
        torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")

    def load(self, folder: Path) -> None:
        from safetensors.torch import load_file

        state = load_file(str(folder / "model.safetensors"), device=str(self.device))
        missing, unexpected = self.network.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"critic checkpoint {folder} does not fit: missing {missing}, unexpected {unexpected}")
        self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location=self.device))
