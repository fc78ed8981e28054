"""The sending half for engines in another process on the same host: one safetensors file in /dev/shm.

Writing to shared memory costs one memory copy; the receiver maps the file and copies into its parameters. The
file carries a checksum of every tensor's bytes so the receiver can prove it read what was sent.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(kw_only=True, slots=True, frozen=True)
class WeightsFile:
    path: Path
    checksum: str
    num_tensors: int
    num_bytes: int


def tensor_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """blake2b over names and raw bytes, in the given order."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in named:
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def shared_memory_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def write_weights_file(weights: Iterable[tuple[str, torch.Tensor]], *, prefix: str = "sharpen-weights") -> WeightsFile:
    from safetensors.torch import save_file

    state = {name: tensor.detach().contiguous().cpu() for name, tensor in weights}
    checksum = tensor_checksum(sorted(state.items()))
    handle, name = tempfile.mkstemp(prefix=prefix + "-", suffix=".safetensors", dir=shared_memory_dir())
    os.close(handle)
    save_file(state, name, metadata={"checksum": checksum})
    return WeightsFile(
        path=Path(name),
        checksum=checksum,
        num_tensors=len(state),
        num_bytes=sum(t.numel() * t.element_size() for t in state.values()),
    )
