"""LoRA adapters (peft) on a HF causal LM: injection, the merged weights an engine loads, adapter persistence. The
reference policy that LoRA gives for free (the base model, adapters disabled) is `frozen.LoraReferencePolicy`,
re-exported here.

Owns the mapping between peft's module names and HF checkpoint names. It does not own the optimizer or the
device: `SingleDeviceBackend` builds the model, calls `apply_lora`, and optimises the parameters that require a
gradient (the adapters); `FSDP2Backend` does the same before sharding. By default the engine never sees an adapter:
`merged_target_weights` yields, for each target module, W + (alpha / rank) * B @ A under the base weight's HF
name, so every engine (hf, vLLM) loads it like any weight and the probe check verifies it. With
``trainer.lora.sync = "adapter"`` the backends send `adapter_state_dict` instead, which the vLLM engine serves as a
LoRA adapter (docs/weight-sync.md, LoRA).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from sharpen.config.schema import LoraConfig
from sharpen.trainer.backends.frozen import LoraReferencePolicy as LoraReferencePolicy  # re-exported

if TYPE_CHECKING:
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import PreTrainedModel

_ADAPTER = "default"  # peft's name of the one adapter
Gather = Callable[[torch.Tensor], torch.Tensor]  # a tensor as a whole: identity, or a DTensor's full_tensor()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


ADAPTER_FILE = "adapter.safetensors"


def apply_lora(model: PreTrainedModel, config: LoraConfig) -> PeftModel:
    """Inject LoRA adapters into ``model`` in place (its base weights are frozen, only A and B require a gradient);
    returns the peft wrapper. ``model`` keeps working as the forward: peft replaces its target modules."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = sorted(set(config.target_modules) - names)
    if missing:
        raise ValueError(f"trainer.lora.target_modules: {missing} matched no module of the model")
    peft_config = PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_config, adapter_name=_ADAPTER)


def _lora_layers(peft_model: PeftModel) -> Iterator[tuple[str, LoraLayer]]:
    """(HF module name, peft LoRA layer) of every target module."""
    from peft.tuners.lora import LoraLayer

    for name, module in peft_model.get_base_model().named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


@torch.no_grad()
def merged_target_weights(peft_model: PeftModel, *, full: Gather = _whole) -> Iterator[tuple[str, torch.Tensor]]:
    """W + (alpha / rank) * B @ A of every target module, under its HF checkpoint name, in the base weight's dtype;
    only these tensors change while LoRA trains (norms, embeddings and the LM head stay the base model's).
    ``full``: how a (sharded) parameter becomes a whole tensor; collective under FSDP2, in the same order on every
    rank."""
    for name, module in _lora_layers(peft_model):
        weight = full(cast(torch.Tensor, module.get_base_layer().weight))  # [out, in]
        a = full(cast(torch.Tensor, module.lora_A[_ADAPTER].weight))  # [r, in]
        b = full(cast(torch.Tensor, module.lora_B[_ADAPTER].weight))  # [out, r]
        scale = float(module.scaling[_ADAPTER])  # alpha / r
        yield f"{name}.weight", (weight + (scale * (b @ a)).to(weight.dtype)).detach()


def _base_name(peft_name: str) -> str | None:
    """The HF name of a tensor of the peft-injected model, or None for an adapter tensor."""
    if ".lora_" in peft_name:
        return None
    return peft_name.replace(".base_layer.", ".")


@torch.no_grad()
def merged_state_dict(peft_model: PeftModel, *, full: Gather = _whole) -> dict[str, torch.Tensor]:
    """The whole model in HF naming with the adapters merged in (what a LoRA run exports)."""
    state = {}
    for name, tensor in peft_model.get_base_model().state_dict().items():
        base_name = _base_name(name)
        if base_name is not None:
            state[base_name] = full(tensor.detach())
    state.update(merged_target_weights(peft_model, full=full))
    return state


def export_merged(peft_model: PeftModel, folder: Path, *, full: Gather = _whole, is_writer: bool = True) -> None:
    """``folder``: the merged model as a HF folder (config, ``model.safetensors``; a tied LM head left to the
    loader) that transformers and vLLM load, and the adapter alone in ``folder/adapter`` (peft's format). Under
    FSDP2 every rank gathers (``full``), only ``is_writer`` writes."""
    from safetensors.torch import save_file

    model = cast("PreTrainedModel", peft_model.get_base_model())
    state = merged_state_dict(peft_model, full=full)
    adapter = adapter_state_dict(peft_model, full=full)
    if not is_writer:
        return
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in state.items()}, str(folder / "model.safetensors"), {"format": "pt"})
    model.config.save_pretrained(folder)
    save_adapter(peft_model, folder / "adapter", state=adapter)


def adapter_state_dict(peft_model: PeftModel, *, full: Gather = _whole) -> dict[str, torch.Tensor]:
    """The adapter tensors (A and B of every target module), peft's names."""
    from peft import get_peft_model_state_dict

    return {name: full(t.detach()).contiguous() for name, t in get_peft_model_state_dict(peft_model).items()}


def save_adapter(peft_model: PeftModel, folder: Path, *, state: dict[str, torch.Tensor] | None = None) -> None:
    """The adapter tensors (``state``, default: the model's own) as ``folder/adapter.safetensors`` plus peft's
    ``adapter_config.json`` (a folder peft's ``PeftModel.from_pretrained`` loads on the base model)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state_dict(peft_model) if state is None else state, str(folder / ADAPTER_FILE))
    peft_model.peft_config[_ADAPTER].save_pretrained(str(folder))


def load_adapter(peft_model: PeftModel, folder: Path, *, device: torch.device) -> None:
    """Restore `save_adapter`'s tensors exactly; refuses a file that does not fit the adapters."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(folder / ADAPTER_FILE), device=str(device))
    expected = set(adapter_state_dict(peft_model))
    if set(state) != expected:
        raise ValueError(
            f"LoRA checkpoint {folder} does not fit the adapters: missing {sorted(expected - set(state))[:3]}, "
            f"unexpected {sorted(set(state) - expected)[:3]}"
        )
    set_peft_model_state_dict(peft_model, state)


def adapter_num_bytes(peft_model: PeftModel) -> int:
    """Bytes of the adapter tensors (what an adapter-only sync would move)."""
    return sum(t.numel() * t.element_size() for t in adapter_state_dict(peft_model).values())
