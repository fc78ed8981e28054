"""Running a function on several ranks from a test: processes (forked on the CPU, spawned for CUDA) that join one
process group (gloo or NCCL)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_process_group(rank: int, num_ranks: int, port: int, *, backend: str = "gloo") -> None:
    """Set the launcher's variables for ``rank`` and join the process group (``backend`` gloo or nccl; one intra-op
    thread a rank)."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(num_ranks)})
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    from sharpen.trainer.backends.mesh import init_distributed

    init_distributed(backend)


def launch_ranks(worker: Callable[..., None], num_ranks: int, *args: Any, device_type: str = "cpu") -> None:
    """Run ``worker(rank, num_ranks, port, *args)`` on ``num_ranks`` processes and wait for them. On the CPU they are
    forked from this process, which has imported torch and transformers already (~10 s a process otherwise); CUDA
    cannot be used in a child forked after it was initialised, so CUDA ranks are spawned. Launch CPU ranks before
    this process trains with several threads where possible: ranks forked right after a single-device run once hung
    in their first matmul here (cause not pinned down)."""
    start_method = "fork" if device_type == "cpu" else "spawn"
    args = (num_ranks, free_port(), *args)
    mp.start_processes(worker, args=args, nprocs=num_ranks, join=True, start_method=start_method)
