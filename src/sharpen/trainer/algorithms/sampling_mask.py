"""The engine's top-k / top-p truncation, applied to the trainer's logits so its logprobs are the behaviour policy's.

When the engine samples with ``rollout.top_k`` or ``rollout.top_p``, the token it returns was drawn from the
truncated, renormalised distribution, and its logprob (vLLM's ``processed_logprobs``, the ``hf`` engine's) is that
distribution's. The trainer scores the same distribution: ``logits / temperature`` (the caller's), then
`truncate_logits`, then the log-softmax. The kept set follows vLLM 0.32's `apply_top_k_top_p_pytorch` (and
transformers' `TopKLogitsWarper` / `TopPLogitsWarper`, the same rule), ties included:

- top-k: the threshold is the k-th largest logit; every logit ``>=`` it is kept, so a tie at the threshold keeps
  all the tied tokens (more than k);
- top-p, on what top-k kept: sort ascending, take the softmax's running sum; a token whose running sum is
  ``<= 1 - top_p`` is dropped; the largest token is always kept. Among exactly equal logits that straddle the
  boundary the sort's order decides: the same `torch.sort` call as vLLM's, on the same sorted array, so equal
  inputs give vLLM's set exactly (`tests/unit/trainer/algorithms/test_sampling_mask.py` checks it against vLLM's
  function on logits full of ties).

The set is chosen without gradient; the kept logits carry theirs, the dropped ones become ``-inf`` (no gradient).
A token outside the set has logprob ``-inf``: `drop_outside` takes such tokens out of the loss (the Objective counts
them as ``offpolicy/outside_truncation``). This module owns only those two functions and the settings; it does not
know where the logits come from (`backends/chunked_logits.py` calls it) and leaves vocabulary-sharded logits to the
caller (tensor parallelism refuses a truncation at build time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingMask:
    """The engine's truncation: ``top_k`` (0: off) and ``top_p`` (1: off), ``rollout.top_k`` / ``rollout.top_p``."""

    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"a sampling mask needs top_k >= 0 and 0 < top_p <= 1, got {self.top_k}, {self.top_p}")

    @property
    def is_off(self) -> bool:
        """Whether nothing is cut (the full distribution)."""
        return self.top_k == 0 and self.top_p >= 1.0


def truncate_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` [..., vocab] (already divided by the temperature) -> the same with every token outside the top-k /
    top-p set at ``-inf`` (a new tensor; float32 or wider). The set is vLLM's (module docstring), chosen under no
    gradient; ``top_k`` 0 and ``top_p`` 1 cut nothing (the logits are returned as they are)."""
    if top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"truncate_logits needs top_k >= 0 and 0 < top_p <= 1, got {top_k}, {top_p}")
    vocab = logits.shape[-1]
    cuts_k = 0 < top_k < vocab
    if not cuts_k and top_p >= 1.0:
        return logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    with torch.no_grad():
        values = logits.detach()
        if top_p >= 1.0:  # top-k alone: every logit below the k-th largest goes (vLLM's `apply_top_k_only`)
            outside = values < values.topk(top_k, dim=-1).values[..., -1:]
        else:  # vLLM's `apply_top_k_top_p_pytorch` step by step, so equal logits fall in the same sorted order
            ascending, order = values.sort(dim=-1)  # [..., vocab]
            if cuts_k:
                threshold = ascending[..., vocab - top_k : vocab - top_k + 1]  # [..., 1]: the k-th largest
                ascending = ascending.masked_fill(ascending < threshold, float("-inf"))
            running = ascending.softmax(dim=-1).cumsum(dim=-1)
            limit = 1.0 - torch.tensor(top_p, dtype=torch.float32)  # vLLM holds top_p as float32
            dropped = (running <= limit) | ascending.isneginf()
            dropped[..., -1] = False  # the largest token is always kept
            outside = torch.zeros_like(dropped).scatter(-1, order, dropped)
    return logits.masked_fill(outside, float("-inf"))


def drop_outside(
    logprobs: torch.Tensor, old: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Take the tokens whose current or old logprob is ``-inf`` (sampled outside the trainer's truncated set: the
    policy moved, or the engine's rounding put a boundary token on the other side) out of the loss: ``logprobs``
    (with gradient) and ``old`` [batch, seq] become 0 there, so no ``-inf`` reaches any arithmetic, and ``mask``
    loses them. Returns ``(logprobs, old, mask, number dropped within mask)``. A dropped token adds nothing to the
    loss and no gradient, as a token the off-policy correction rejects; without any, the inputs come back
    unchanged."""
    outside = logprobs.detach().isneginf() | old.isneginf()  # [batch, seq]
    if not bool(outside.any()):
        return logprobs, old, mask, 0
    num_outside = int((outside & mask).sum())
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    return (
        torch.where(outside, zero, logprobs),
        torch.where(outside, zero.to(old.dtype), old),
        mask & ~outside,
        num_outside,
    )
