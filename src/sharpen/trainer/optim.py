"""The optimizer every trainer backend and the critic build: AdamW, in torch's fused kernel.

torch's AdamW defaults to its per-tensor loop on the CPU (the multi-tensor and fused paths are chosen by default only
on CUDA). The fused kernel runs the same update (the same float32 arithmetic per element, in one pass over each
tensor) and exists on both the CPU and CUDA; measured here on SmolLM2-135M's 272 float32 tensors, 2 threads: 0.05-0.07
s per step against 0.3-1.0 s for the loop (`benchmarks/limit.py` prints the optimizer's time on its own). It is not
bit-identical to the loop (another operation order), so a run resumes with the optimizer it started with: this one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def build_adamw(
    parameters: Iterable[torch.nn.Parameter], *, learning_rate: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.AdamW:
    """AdamW over ``parameters`` (plain tensors or FSDP2's DTensor shards, on the CPU or a CUDA device). Shards on
    different meshes (expert parallelism's experts beside the rest) go in separate parameter groups: a fused step
    runs per group, and one kernel call cannot take DTensors of two meshes."""
    groups = mesh_groups(list(parameters))
    return torch.optim.AdamW(
        [{"params": group} for group in groups] if len(groups) > 1 else groups[0] if groups else [],
        lr=learning_rate,
        betas=betas,
        weight_decay=weight_decay,
        fused=True,
    )


def mesh_groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by their DTensor mesh (plain tensors together), each group in the given order. A DTensor is
    known by its ``device_mesh``: DTensor itself is imported only under trainer/backends (an import fence)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(getattr(tensor, "device_mesh", None), []).append(tensor)
    return list(groups.values())
