"""Adapter-only weight sync (``trainer.lora.sync = "adapter"``): one version of a LoRA policy's adapter tensors as a
checked peft folder that an engine with LoRA support (vLLM's ``LoRARequest``) loads.

Owns the folders, one per version in a private temporary directory, and their checks: every tensor must be an
adapter matrix (``lora_A`` / ``lora_B``, peft's names) of a module the run's `LoraConfig` targets, with the rank it
names, and the file is read back and compared tensor by tensor (xxh3 checksums) with what the trainer sent before
the engine is told to load it. What proves that the engine applies it is the probe check, as for every sync.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from sharpen.config.schema import LoraConfig
from sharpen.rollout.weight_sync.buckets import BucketError, bytes_checksum, combine_checksums

if TYPE_CHECKING:
    import torch

ADAPTER_FILE = "adapter_model.safetensors"
"""The tensor file of a peft adapter folder (what vLLM's and peft's loaders look for)."""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts as ``max_lora_rank`` (vllm.config.lora.MaxLoRARanks)."""


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of rank ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise BucketError(f"trainer.lora.rank = {rank} is above the largest LoRA rank vLLM serves ({VLLM_LORA_RANKS[-1]})")


def tensor_checksum(tensor: torch.Tensor) -> str:
    """xxh3 of the tensor's bytes (its dtype's layout, contiguous, on the host)."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return bytes_checksum(flat)


def peft_adapter_config(config: LoraConfig) -> dict[str, object]:
    """peft's ``adapter_config.json`` for ``config``'s adapters (what `apply_lora` injects: no bias, no rsLoRA)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": sorted(config.target_modules),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def check_adapter_tensor(name: str, tensor: torch.Tensor, config: LoraConfig) -> None:
    """Refuse a tensor that is not one of ``config``'s adapter matrices: a base weight (a sync in the wrong mode),
    another module, or another rank."""
    parts = name.split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise BucketError(
            f"{name!r} is not a LoRA adapter tensor: an adapter-only sync sends peft's lora_A / lora_B weights alone "
            '(is the trainer syncing merged weights? trainer.lora.sync must be "adapter" on both sides)'
        )
    if parts[-3] not in config.target_modules:
        raise BucketError(f"{name!r}: module {parts[-3]!r} is not in trainer.lora.target_modules")
    rank_dim = 0 if parts[-2] == "lora_A" else 1
    if tensor.dim() != 2 or tensor.shape[rank_dim] != config.rank:
        raise BucketError(f"{name!r} has shape {tuple(tensor.shape)}, not rank {config.rank} on dim {rank_dim}")


class AdapterFolders:
    """Writes each synced version's adapter as a peft folder and checks it; keeps the newest two (the engine's
    current adapter stays on disk until the next one has loaded)."""

    def __init__(self, config: LoraConfig) -> None:
        self.config = config
        self.root = Path(tempfile.mkdtemp(prefix="sharpen-lora-"))
        self._folders: list[Path] = []
        self._count = 0
        self.checksum = ""
        """The combined checksum of the last adapter written (sorted by name)."""

    def write(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> tuple[Path, dict[str, float]]:
        """The folder of version ``version``'s adapter and the sync's metrics; `BucketError` when a tensor is not
        an adapter matrix of the run's config, a target module has no pair of matrices, or the written file reads
        back different."""
        from safetensors.torch import load_file, save_file

        started = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            check_adapter_tensor(name, tensor, self.config)
            if name in tensors:
                raise BucketError(f"adapter tensor {name!r} sent twice")
            tensors[name] = tensor.detach().to("cpu").contiguous()
        if not tensors:
            raise BucketError("the adapter sync sent no tensors")
        modules = {name.rsplit(".", 2)[0] for name in tensors}
        unpaired = sorted(m for m in modules if {f"{m}.lora_A.weight", f"{m}.lora_B.weight"} - set(tensors))
        if unpaired:
            raise BucketError(f"adapter modules without both lora_A and lora_B: {unpaired[:3]}")
        sent = {name: tensor_checksum(tensor) for name, tensor in tensors.items()}
        self._count += 1
        folder = self.root / f"v{version}-{self._count}"
        folder.mkdir()
        save_file(tensors, str(folder / ADAPTER_FILE), {"format": "pt", "sharpen_version": str(version)})
        (folder / "adapter_config.json").write_text(json.dumps(peft_adapter_config(self.config), indent=1))
        written = {name: tensor_checksum(tensor) for name, tensor in load_file(str(folder / ADAPTER_FILE)).items()}
        if written != sent:
            wrong = sorted(name for name in sent if written.get(name) != sent[name])
            shutil.rmtree(folder, ignore_errors=True)
            raise BucketError(f"the adapter file of version {version} reads back different: {wrong[:3]}")
        self._folders.append(folder)
        while len(self._folders) > 2:
            shutil.rmtree(self._folders.pop(0), ignore_errors=True)
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        metrics = {
            "sync/num_tensors": float(len(tensors)),
            "sync/gib": num_bytes / 2**30,
            "sync/write_seconds": time.perf_counter() - started,
        }
        self.checksum = combine_checksums([sent[name] for name in sorted(sent)])
        return folder, metrics

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
