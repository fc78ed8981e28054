"""Vocabulary-parallel logprobs and entropy: two and four gloo ranks, each with a slice of the vocabulary, give the
single process's values and, for each slice, exactly its columns of the single process's gradient.

Tolerance: float64 throughout; the sharded computation differs from torch's log_softmax only in summation order
(~1e-16 relative per sum over 64 columns), so 1e-12 absolute on values of order 1 and gradients of order 1e-2."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sharpen.trainer.algorithms.kl import entropy_from_log_probs
from sharpen.trainer.backends.vocab_parallel import vocab_parallel_scores

TOKENS, VOCAB = 12, 64


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, VOCAB, generator=generator, dtype=torch.float64) * 4
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    weights = torch.randn(TOKENS, generator=generator, dtype=torch.float64)  # a loss mixing both outputs
    entropy_weights = torch.randn(TOKENS, generator=generator, dtype=torch.float64)
    return logits, targets, weights, entropy_weights


def _reference() -> dict[str, torch.Tensor]:
    logits, targets, weights, entropy_weights = _inputs()
    logits.requires_grad_(True)
    log_probs = torch.log_softmax(logits, dim=-1)
    logprobs = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = entropy_from_log_probs(log_probs)
    ((logprobs * weights).sum() + (entropy * entropy_weights).sum()).backward()
    assert logits.grad is not None
    return {"logprobs": logprobs.detach(), "entropy": entropy.detach(), "grad": logits.grad}


def _worker(rank: int, world_size: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        logits, targets, weights, entropy_weights = _inputs()
        width = VOCAB // world_size
        shard = logits[:, rank * width : (rank + 1) * width].clone().requires_grad_(True)
        logprobs, entropy = vocab_parallel_scores(
            shard, targets, vocab_start=rank * width, group=dist.group.WORLD, with_entropy=True
        )
        assert entropy is not None
        ((logprobs * weights).sum() + (entropy * entropy_weights).sum()).backward()
        torch.save({"logprobs": logprobs.detach(), "entropy": entropy.detach(), "grad": shard.grad}, out / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unsharded_equals_log_softmax():
    logits, targets, *_ = _inputs()
    logprobs, entropy = vocab_parallel_scores(logits, targets, with_entropy=True)
    expected = _reference()
    assert torch.allclose(logprobs, expected["logprobs"], rtol=0, atol=1e-12)
    assert entropy is not None and torch.allclose(entropy, expected["entropy"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_gets_the_values_and_its_columns_of_the_gradient(world_size: int, tmp_path: Path):
    mp.start_processes(_worker, args=(world_size, _free_port(), tmp_path), nprocs=world_size, start_method="fork")
    expected = _reference()
    width = VOCAB // world_size
    for rank in range(world_size):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert torch.allclose(got["logprobs"], expected["logprobs"], rtol=0, atol=1e-12)
        assert torch.allclose(got["entropy"], expected["entropy"], rtol=0, atol=1e-12)
        columns = expected["grad"][:, rank * width : (rank + 1) * width]
        assert torch.allclose(got["grad"], columns, rtol=0, atol=1e-12), (got["grad"] - columns).abs().max()
