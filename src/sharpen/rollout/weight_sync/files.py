"""The sending half for engines in another process on the same host: one safetensors file in /dev/shm.

Writing to shared memory costs one memory copy; the receiver maps the file and copies into its parameters. The
file carries a checksum of every tensor's bytes so the receiver can prove it read what was sent.
"""

from __future__ import annotations

import os
import tempfile
import zlib
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
    """CRC-32 chained over names and raw bytes, in the given order.

    It guards against truncated, corrupted or mixed-up transfers, not against an adversary, so a CRC (about
    2.5 GB/s here, read in place without a copy) beats a cryptographic hash (blake2b with a copy: ~0.35 GB/s,
    which cost ~1.5 s per side for a 0.5 GB sync).
    """
    crc = 0
    for name, tensor in named:
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data, crc)
    return f"{crc:08x}"


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
