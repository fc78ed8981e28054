"""Alpha-beta costs of the collectives a weight sync uses: time = messages * latency + bytes / bandwidth.

It owns the closed forms only (Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
Operations in MPICH", 2005, and NCCL's ring/tree design): `alpha` is seconds per message, `beta` bytes per second of
one link. It does not choose the links (costs.py) and ignores contention, protocol overheads and in-network
reduction.
"""

from __future__ import annotations

import math


def ring_allgather_seconds(num_bytes: float, num_ranks: int, *, alpha: float, beta: float) -> float:
    """Every rank ends with all `num_bytes` (each holds 1/p): p - 1 steps, each moving num_bytes / p."""
    if num_ranks <= 1:
        return 0.0
    return (num_ranks - 1) * (alpha + num_bytes / num_ranks / beta)


def ring_allreduce_seconds(num_bytes: float, num_ranks: int, *, alpha: float, beta: float) -> float:
    """Reduce-scatter then all-gather: 2 (p - 1) steps of num_bytes / p."""
    return 2.0 * ring_allgather_seconds(num_bytes, num_ranks, alpha=alpha, beta=beta)


def ring_broadcast_seconds(
    num_bytes: float, num_ranks: int, *, alpha: float, beta: float, num_chunks: int = 1
) -> float:
    """A pipelined chain: the root sends `num_chunks` chunks; the last rank has the last chunk after
    (p - 1) + (chunks - 1) chunk steps. With many chunks it approaches num_bytes / beta whatever p is."""
    if num_ranks <= 1:
        return 0.0
    chunks = max(1, num_chunks)
    return (num_ranks - 1 + chunks - 1) * (alpha + num_bytes / chunks / beta)


def tree_broadcast_seconds(num_bytes: float, num_ranks: int, *, alpha: float, beta: float) -> float:
    """A binary tree without pipelining: ceil(log2 p) rounds, each sending the whole message."""
    if num_ranks <= 1:
        return 0.0
    return math.ceil(math.log2(num_ranks)) * (alpha + num_bytes / beta)
