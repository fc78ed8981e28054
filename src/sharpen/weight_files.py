"""A model's weights as Hugging Face's safetensors files: the one writer of a folder of shards and its index, which
transformers, vLLM and SGLang load.

Owns the files (names, shard sizes, ``model.safetensors.index.json``), nothing about where the tensors come from:
FSDP2's export feeds it the weights it gathers (`trainer/backends/fsdp2.py`), the SGLang engine the weights of a
sync (`rollout/engines/sglang.py`). It sits in the lowest layer, beside `types`, so that the trainer and rollout,
which may not import each other, both can; it imports nothing of sharpen, and torch only when it writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(kw_only=True, slots=True)
class WrittenWeights:
    """What `write_safetensors` wrote: each weight's file (the index's ``weight_map``) and the bytes of all."""

    files: dict[str, str]
    num_bytes: int

    @property
    def num_tensors(self) -> int:
        return len(self.files)


def write_safetensors(
    weights: Iterable[tuple[str, torch.Tensor]],
    folder: Path,
    *,
    max_shard_bytes: int,
    dtype: torch.dtype | None = None,
) -> WrittenWeights:
    """Write ``weights`` into ``folder`` (made if missing) as they come, one shard in memory at a time: consecutive
    weights fill a shard up to ``max_shard_bytes`` (a larger weight gets one alone). One shard is
    ``model.safetensors``; several are ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``.
    ``dtype``: floating-point weights are written in it (None: as they are). A name given twice is a `ValueError`."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = num_bytes = 0
    written: list[tuple[Path, list[str]]] = []  # (file under a provisional name, its weights)
    names: set[str] = set()

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            path = folder / f"model-{len(written) + 1:05d}.safetensors.partial"
            save_file(shard, str(path), metadata={"format": "pt"})
            written.append((path, list(shard)))
            shard, shard_bytes = {}, 0

    for name, tensor in weights:
        if name in names:
            raise ValueError(f"weight {name!r} given twice")
        names.add(name)
        cpu = _cpu_copy(tensor, dtype)
        size = cpu.numel() * cpu.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard[name] = cpu
        shard_bytes += size
        num_bytes += size
    flush()
    # the final names count the shards, known only now
    files: dict[str, str] = {}
    for number, (path, shard_names) in enumerate(written, start=1):
        final = SINGLE_FILE if len(written) == 1 else f"model-{number:05d}-of-{len(written):05d}.safetensors"
        path.rename(folder / final)
        files.update(dict.fromkeys(shard_names, final))
    if len(written) > 1:
        index = {"metadata": {"total_size": num_bytes}, "weight_map": files}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return WrittenWeights(files=files, num_bytes=num_bytes)


def _cpu_copy(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` on the CPU, contiguous, in ``dtype`` if floating-point, in storage of its own: safetensors refuses
    tensors that share storage (tied weights), so one that was not copied on the way is cloned."""
    cpu = tensor.detach().to("cpu")
    if dtype is not None and cpu.is_floating_point():
        cpu = cpu.to(dtype)
    cpu = cpu.contiguous()
    return cpu.clone() if cpu.data_ptr() == tensor.data_ptr() else cpu
