"""One process, one device: a HF causal LM, AdamW, optional bf16 autocast and gradient checkpointing.

Owns the parameters, the optimizer and their persistence. Knows nothing of rollouts or losses: it turns token
ids into per-token logprobs and applies accumulated gradients. A vision-language model (Qwen2-VL) also scores rows
that hold images, from the same `ImagePart`s the engine saw (`data.vision.VisionProcessor` makes the pixel inputs).

The forward pass itself is `scoring` (shared with `fsdp2`, the critic and the frozen scorers); the LoRA adapters are
`lora`'s, the reference policy of the KL term is `frozen.ReferencePolicy`. `resolve_device` picks the device.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sharpen.config.schema import TrainerConfig
from sharpen.data.vision import VisionProcessor, is_vision_model, model_class
from sharpen.trainer.algorithms.sampling_mask import SamplingMask
from sharpen.trainer.backends.base import (
    PROCESSOR_FILES,
    ScoresTokenLogprobs,
    TokenScores,
    checkpointing_kwargs,
    replay_routes_of,
)
from sharpen.trainer.backends.cpu_memory import FreedMemory
from sharpen.trainer.backends.lora import (
    adapter_state_dict,
    apply_lora,
    export_merged,
    load_adapter,
    merged_target_weights,
    save_adapter,
)
from sharpen.trainer.backends.scoring import autocast_to, rows_image_inputs, score_tokens, score_top_k
from sharpen.trainer.optim import build_adamw
from sharpen.trainer.precision import (
    LossScaler,
    PrecisionChoice,
    keep_lm_head_float32,
    loss_scaler_for,
    resolve_precision,
)
from sharpen.types import ImagePart
from sharpen.weight_shards import WeightShard

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class SingleDeviceBackend(ScoresTokenLogprobs):
    rank = 0  # one process: the data-parallel collectives are identities
    num_ranks = 1
    is_writer = True

    def __init__(self, config: TrainerConfig, *, model_path: Path, dtype: str) -> None:
        torch.set_num_threads(config.resolved_num_threads)
        self.config = config
        self.model_path = Path(model_path)
        self.device = resolve_device(config.device)
        # a process-wide setting of the C library (`cpu_memory`), bounded after every optimizer step
        self.freed_memory = FreedMemory.keep(config.reuse_cpu_memory_mb) if self.device.type == "cpu" else None
        self.precision: PrecisionChoice = resolve_precision(
            config.precision, self.device, num_threads=config.resolved_num_threads
        )
        model = model_class(self.model_path).from_pretrained(self.model_path, dtype=getattr(torch, dtype))
        # transformers wraps `to` with functools.wraps, which its stubs leave unbound (self is not passed)
        self.model: PreTrainedModel = model.to(self.device)  # pyright: ignore[reportArgumentType]
        self.vision = VisionProcessor.from_pretrained(self.model_path) if is_vision_model(self.model_path) else None
        """A vision-language model's image processor (rows with images); None for a text-only model."""
        self.model.config.use_cache = False
        if config.lm_head_float32:
            keep_lm_head_float32(self.model)
        self.loss_scaler: LossScaler | None = loss_scaler_for(self.precision)
        """fp16's dynamic loss scale (`train_micro_batches` scales, `clip_and_step` unscales); None otherwise."""
        self.router = replay_routes_of(self.model, config, name=str(self.model_path))
        self.lora: PeftModel | None = None  # the adapters' wrapper when trainer.lora.enabled (self.model is its base)
        if config.lora.enabled:
            self.lora = apply_lora(self.model, config.lora)
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(self.model))
        self.model.train()
        self.optimizer = build_adamw(
            (p for p in self.model.parameters() if p.requires_grad),  # all of them, or the LoRA adapters alone
            learning_rate=config.learning_rate,
            betas=config.betas,
            weight_decay=config.weight_decay,
        )

    def score_tokens(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        target_mask: torch.Tensor,
        *,
        temperature: float,
        use_autocast: bool = True,
        with_entropy: bool = False,
        entropy_requires_grad: bool = False,
        position_ids: torch.Tensor | None = None,
        prompt_lengths: Sequence[int] | None = None,
        images: Sequence[tuple[ImagePart, ...]] = (),
        sampling_mask: SamplingMask | None = None,
    ) -> TokenScores:
        """``use_autocast=False`` computes in the weights' own dtype even when the precision is bf16 (autocast).
        With ``prompt_lengths`` (right-padded rows), each prompt that rows share runs once (prefix.py); rows with
        ``images`` (one tuple per row) run whole, their pixel inputs made from the images."""
        image_inputs = self._image_inputs(input_ids, position_ids, images)
        with autocast_to(self.device, self.precision.autocast_dtype if use_autocast else None):
            if (
                image_inputs is None
                and prompt_lengths is not None
                and position_ids is None
                and attention_mask is not None
            ):
                from sharpen.trainer.prefix import score_shared_prompts  # transformers' cache classes: import late

                return score_shared_prompts(
                    self.model,
                    input_ids,
                    attention_mask,
                    target_mask,
                    prompt_lengths=prompt_lengths,
                    temperature=temperature,
                    with_entropy=with_entropy,
                    entropy_requires_grad=entropy_requires_grad,
                    logits_chunk_tokens=self.config.logits_chunk_tokens,
                    sampling_mask=sampling_mask,
                )
            return score_tokens(
                self.model,
                input_ids,
                attention_mask,
                target_mask,
                temperature=temperature,
                with_entropy=with_entropy,
                entropy_requires_grad=entropy_requires_grad,
                position_ids=position_ids,
                logits_chunk_tokens=self.config.logits_chunk_tokens,
                image_inputs=image_inputs,
                sampling_mask=sampling_mask,
            )

    def _image_inputs(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, images: Sequence[tuple[ImagePart, ...]]
    ) -> dict[str, torch.Tensor] | None:
        """The model's pixel inputs of the rows' images, or None when the rows hold none."""
        if position_ids is not None and any(images):
            raise ValueError("rows with images cannot be packed (trainer.packing = false for image prompts)")
        return rows_image_inputs(self.vision, input_ids, images, model=str(self.model_path))

    def score_top_k(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        target_mask: torch.Tensor,
        *,
        temperature: float,
        k: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's k most likely tokens at each target and their logprobs (with gradient), each
        [num_targets, k] (`scoring.score_top_k`; the top-k distillation variant)."""
        with autocast_to(self.device, self.precision.autocast_dtype):
            return score_top_k(self.model, input_ids, attention_mask, target_mask, temperature=temperature, k=k)

    def all_reduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        return dict(values)

    def all_reduce_max(self, value: int) -> int:
        return value

    def clip_and_step(self, *, skip_above: float = math.inf) -> float:
        """Clip the accumulated gradient, step the optimizer, clear gradients; returns the pre-clip grad norm.
        A non-finite norm (a NaN or Inf anywhere in the gradient) skips the optimizer step: one NaN would poison
        AdamW's moments for good; so does a norm above ``skip_above`` (a spike the stability guards leave out).
        The caller sees the norm and counts the skip. Under fp16 the gradients are unscaled first, and a non-finite
        norm lowers the loss scale (`precision.LossScaler`)."""
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_([p.grad for p in self.model.parameters() if p.grad is not None])
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        is_finite = bool(torch.isfinite(grad_norm))
        if self.loss_scaler is not None:
            self.loss_scaler.update(is_finite=is_finite)
        if is_finite and float(grad_norm) <= skip_above:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.freed_memory is not None:
            self.freed_memory.bound()
        return float(grad_norm)

    @torch.no_grad()
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors in HF checkpoint naming (what an engine loads), detached, on their device.

        A tied output embedding is left out: it is the input embedding, and loaders rebuild the tie. With LoRA: the
        merged weights of the target modules only (nothing else changes; `lora.merged_target_weights`), or with
        ``trainer.lora.sync = "adapter"`` the adapter tensors alone (peft's names; `lora.adapter_state_dict`)."""
        if self.lora is not None:
            if self.config.lora.syncs_adapter:
                yield from adapter_state_dict(self.lora).items()
            else:
                yield from merged_target_weights(self.lora)
            return
        is_tied = getattr(self.model.config, "tie_word_embeddings", False)
        for name, tensor in self.model.state_dict().items():
            if is_tied and name == "lm_head.weight":
                continue
            yield name, tensor.detach()

    def weight_shards(self) -> list[WeightShard]:
        """`named_weights`, each whole (one rank holds the model)."""
        return [
            WeightShard.whole(name, order, tensor.to("cpu", copy=True))
            for order, (name, tensor) in enumerate(self.named_weights())
        ]

    def save(self, folder: Path) -> None:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:  # the base weights are the model folder's: only the adapters are state
            save_adapter(self.lora, folder / "lora")
        else:
            state = {name: tensor.contiguous() for name, tensor in self.named_weights()}
            save_file(state, str(folder / "model.safetensors"))
        torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
        if self.loss_scaler is not None:
            self.loss_scaler.save(folder)

    def load(self, folder: Path) -> None:
        from safetensors.torch import load_file

        if self.lora is not None:
            load_adapter(self.lora, folder / "lora", device=self.device)
        else:
            state = load_file(str(folder / "model.safetensors"), device=str(self.device))
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            allowed_missing = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
            if set(missing) - allowed_missing or unexpected:
                raise ValueError(
                    f"checkpoint {folder} does not fit the model: missing {missing}, unexpected {unexpected}"
                )
        self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location=self.device))
        if self.loss_scaler is not None:
            self.loss_scaler.load(folder)

    def export(self, folder: Path) -> None:
        """A HF folder (config, safetensors, tokenizer) that transformers and vLLM load. With LoRA: the merged model
        (base + adapters) in the same layout, and the adapter alone under ``folder/adapter`` (peft's format)."""
        folder.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            export_merged(self.lora, folder)
        else:
            self.model.save_pretrained(folder, safe_serialization=True)
        for name in PROCESSOR_FILES:
            if (self.model_path / name).is_file():
                shutil.copy2(self.model_path / name, folder / name)
        generation_config = self.model_path / "generation_config.json"
        if generation_config.is_file():
            shutil.copy2(generation_config, folder / "generation_config.json")
