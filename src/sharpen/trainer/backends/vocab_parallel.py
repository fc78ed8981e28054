"""Per-token logprobs and entropy from logits sharded over the vocabulary, without gathering ``[tokens, vocab]``.

With tensor parallelism the LM head is split column-wise: rank ``r`` of the tensor-parallel group holds the logits
of vocabulary entries ``[vocab_start, vocab_start + local_vocab)``. The log-softmax needs the whole row, but only
through three sums, which are all-reduced as ``[tokens]`` vectors (Megatron's vocabulary-parallel cross entropy):
the row maximum ``m`` (for stability; it cancels, so it carries no gradient), ``s = sum_v exp(z_v - m)`` and, for
the entropy, ``sum_v exp(z_v - m) (z_v - m)``; the target's logit comes from the one rank that owns it. Then
``log p(y) = (z_y - m) - log s`` and ``H = log s - sum_v p_v (z_v - m)``.

The loss computed from these is the same on every rank of the group (replicated), so the sums' backward is the
identity: each rank's shard gets exactly its columns of the single-device gradient. With ``group=None`` the whole
vocabulary is local and nothing is reduced (tests compare the sharded ranks with that). Temperature is the
caller's: divide the logits before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class VocabShard:
    """This rank's slice of the vocabulary: the LM head's output columns ``[start, start + size)``; ``group``: the
    ranks that hold the other slices (the ``tp`` group)."""

    start: int
    size: int
    group: dist.ProcessGroup


class _SumOverShards(torch.autograd.Function):
    """All-reduce (sum) over the group in the forward; identity in the backward (the loss is replicated)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return tensor if group is None else _SumOverShards.apply(tensor, group)


def vocab_parallel_scores(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    with_entropy: bool = False,
    entropy_requires_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits`` [tokens, local_vocab] (this rank's vocabulary slice, from ``vocab_start``), ``targets`` [tokens]
    (ids in the whole vocabulary) -> (logprob of each target [tokens], entropy [tokens] or None), in at least
    float32. ``group``: the ranks that hold the other slices (None: ``logits`` is the whole vocabulary). The entropy
    carries no gradient without ``entropy_requires_grad`` (a metric)."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"need logits [tokens, vocab] and targets [tokens], got {list(logits.shape)}, {list(targets.shape)}"
        )
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [tokens, local_vocab]
    local_vocab = z.shape[-1]
    row_max = z.detach().amax(dim=-1)  # [tokens]
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = z - row_max.unsqueeze(-1)  # [tokens, local_vocab], <= 0
    exp = shifted.exp()
    total = _sum(exp.sum(dim=-1), group)  # [tokens]: s >= 1 (the maximum's own term is 1)
    log_total = total.log()
    owned = (targets >= vocab_start) & (targets < vocab_start + local_vocab)  # [tokens]
    local_index = (targets - vocab_start).clamp(0, local_vocab - 1)
    target_shifted = shifted.gather(-1, local_index.unsqueeze(-1)).squeeze(-1)  # [tokens]
    target_shifted = _sum(torch.where(owned, target_shifted, torch.zeros_like(target_shifted)), group)
    logprobs = target_shifted - log_total
    if not with_entropy:
        return logprobs, None
    if not entropy_requires_grad:
        exp, shifted, total, log_total = exp.detach(), shifted.detach(), total.detach(), log_total.detach()
    weighted = _sum((exp * shifted).sum(dim=-1), group)  # [tokens]: sum_v exp(z_v - m) (z_v - m)
    return logprobs, log_total - weighted / total
