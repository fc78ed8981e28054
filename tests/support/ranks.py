"""Running a function on several CPU ranks (gloo) from a test: forked processes that join one process group."""

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


def join_gloo(rank: int, num_ranks: int, port: int) -> None:
    """Set the launcher's variables for ``rank`` and join the gloo process group (one intra-op thread a rank)."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(num_ranks)})
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    from sharpen.trainer.backends.fsdp2 import init_distributed

    init_distributed("gloo")


def launch_cpu_ranks(worker: Callable[..., None], num_ranks: int, *args: Any) -> None:
    """Run ``worker(rank, num_ranks, port, *args)`` on ``num_ranks`` forked processes and wait for them. Forked from
    this process, which has imported torch and transformers already (~10 s a process otherwise). Launch the ranks
    before this process trains with several threads where possible: ranks forked right after a single-device run
    once hung in their first matmul here (cause not pinned down)."""
    mp.start_processes(worker, args=(num_ranks, free_port(), *args), nprocs=num_ranks, join=True, start_method="fork")
