"""Policy losses. Each returns the summed (not averaged) per-token loss divided by a caller-given normaliser, so
gradient accumulation over micro-batches gives the same gradient as one big batch (token-mean over the step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class PolicyLossOutput:
    loss: torch.Tensor
    """Scalar: sum of masked per-token losses / normalizer."""
    num_clipped: torch.Tensor
    """Scalar: number of masked tokens where the clipped term was the one taken (no gradient)."""
    ratio_sum: torch.Tensor
    """Scalar: sum of importance ratios over masked tokens (for the mean ratio metric)."""


def compute_ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    normalizer: float,
) -> PolicyLossOutput:
    """PPO clipped surrogate, token level, with separate low/high clip (DAPO clip-higher when high > low).

    Shapes: ``logprobs``, ``old_logprobs``, ``mask`` are [batch, seq]; ``advantages`` is [batch, seq] or
    [batch, 1]. ``old_logprobs`` are the behaviour policy's (the engine's), so the ratio also carries any
    engine/trainer mismatch. loss_t = -min(r_t A_t, clip(r_t, 1-eps_low, 1+eps_high) A_t).
    """
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs.detach())
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    is_clipped = (clipped < unclipped).to(logprobs.dtype)
    return PolicyLossOutput(
        loss=(per_token * mask).sum() / normalizer,
        num_clipped=(is_clipped * mask).sum().detach(),
        ratio_sum=(ratio.detach() * mask).sum(),
    )
