"""The ``[trainer.lora]`` section: LoRA adapters instead of full fine-tuning, and how the engine gets them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from sharpen.config.section import Section


class LoraConfig(Section):
    """LoRA adapters (peft): the base weights stay frozen and only the low-rank matrices A, B of each target module
    train (docs/algorithms.md, LoRA). The engine receives the merged weights W + (alpha / rank) * B @ A of the target
    modules, or the adapter tensors alone (``sync``)."""

    enabled: bool = False
    """Train LoRA adapters instead of every weight (single-device and FSDP2 backends)."""
    rank: int = Field(default=16, ge=1)
    """The adapters' rank r."""
    alpha: int = Field(default=32, gt=0)
    """LoRA alpha: the update B @ A is scaled by alpha / rank."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training (0: none, which keeps the trainer's logprobs equal to the
    engine's merged weights)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names of the linear modules that get adapters (default: the attention and MLP projections of Llama-style
    models)."""
    sync: Literal["auto", "merged", "adapter"] = "auto"
    """How the engine gets the policy: ``merged`` (and ``auto``) sends the merged weights of the target modules
    through the verified buckets; ``adapter`` sends the adapter tensors alone (a few MiB), which the vllm engine
    serves as a LoRA adapter. ``auto`` is merged because vLLM's CPU build generated 2.4x slower with an adapter
    while the sync took 0.11x the time (docs/weight-sync.md, LoRA)."""

    @property
    def syncs_adapter(self) -> bool:
        """Whether the engine receives the adapter tensors alone (LoRA on, ``sync = "adapter"``)."""
        return self.enabled and self.sync == "adapter"

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("trainer.lora.target_modules must name at least one module")
        return value
