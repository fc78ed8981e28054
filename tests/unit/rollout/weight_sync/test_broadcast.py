"""Weight sync as a gloo broadcast, sender and two receivers as threads of this process: exact round trip in
layer-aligned buckets, and a corrupted bucket or a wrong version refused (after the rest was drained, so the sender
finishes)."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
import torch

from sharpen.rollout.weight_sync.broadcast import open_weight_group, receive_weights, send_weights
from sharpen.rollout.weight_sync.buckets import BucketError


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def weights() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(50, 8)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(16, 8).to(torch.bfloat16)),
        ("model.layers.1.self_attn.q_proj.weight", torch.randn(8, 8)),
        ("model.norm.weight", torch.ones(8)),
        ("model.step", torch.tensor([7], dtype=torch.int64)),
    ]


def run_group(*, expected_version: int, **send_options: Any) -> tuple[dict[str, float], list[Any]]:
    """Rank 0 sends ``weights()`` as version 3; ranks 1 and 2 receive expecting ``expected_version``. Returns the
    sender's metrics and each receiver's result (a dict of tensors, or the exception it raised)."""
    port, world = free_port(), 3
    results: list[Any] = [None, None, None]

    def member(rank: int) -> None:
        group = open_weight_group(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port)
        try:
            if rank == 0:
                results[0] = send_weights(group, weights(), version=3, bucket_bytes=600, **send_options)
            else:
                results[rank] = {n: t.clone() for n, t in receive_weights(group, version=expected_version)}
        except Exception as error:
            results[rank] = error

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    return results[0], results[1:]


def test_every_receiver_gets_the_exact_weights_in_layer_aligned_buckets() -> None:
    metrics, received = run_group(expected_version=3)
    assert metrics["sync/num_buckets"] == 3  # embeddings (1600 B) | layers 0 and 1 (768 B) | norm + step
    for got in received:
        assert list(got) == [name for name, _ in weights()]
        for name, tensor in weights():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)


def test_a_corrupted_bucket_is_refused_and_the_sender_still_finishes() -> None:
    def corrupt(index: int, bucket: torch.Tensor) -> None:
        if index == 1:  # layers 0 and 1
            bucket[5] ^= 0xFF

    metrics, received = run_group(expected_version=3, tamper=corrupt)
    assert metrics["sync/num_buckets"] == 3
    for error in received:
        assert isinstance(error, BucketError) and "bucket 1 is corrupted" in str(error)


def test_a_receiver_expecting_another_version_refuses() -> None:
    _, received = run_group(expected_version=4)
    for error in received:
        assert isinstance(error, BucketError) and "expected version 4, the sender sent 3" in str(error)


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        open_weight_group(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), backend="mpi")
