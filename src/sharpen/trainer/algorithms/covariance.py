# pyright: strict
"""The token selection of the covariance-based losses (Cui et al. 2025, "The Entropy Mechanism of Reinforcement
Learning for Reasoning Language Models", arXiv 2505.22617): each token's covariance of its logprob and its advantage
over a whole mini-batch, and the tokens Clip-Cov detaches and KL-Cov penalises (`policy_losses.py` applies them).
Computed once over the mini-batch, so the selection does not depend on the micro-batch split.
"""

from __future__ import annotations

import math

import torch


def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token Cov term of Cui et al. 2025 ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models", arXiv 2505.22617): (A_t - mean(A)) (logprobs_t - mean(logprobs)), the means over the valid tokens of
    the whole batch given; [batch, seq] in at least float32, detached, 0 at masked tokens. For a selection that
    does not depend on the micro-batch split, pass the whole mini-batch (see `select_clip_cov_tokens`)."""
    valid = mask.to(torch.bool)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    logp = logprobs.detach().to(dtype)
    adv = advantages.detach().to(dtype).expand_as(logp)
    count = valid.sum().clamp(min=1)
    centred_logp = logp - torch.where(valid, logp, 0.0).sum() / count
    centred_adv = adv - torch.where(valid, adv, 0.0).sum() / count
    return torch.where(valid, centred_adv * centred_logp, 0.0)


def select_clip_cov_tokens(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    fraction: float,
    cov_low: float,
    cov_high: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Clip-Cov's tokens: max(1, floor(fraction N)) drawn uniformly without replacement (``generator``) among the
    valid tokens with cov_low < Cov_t < cov_high (N valid tokens; all candidates if fewer). The paper's defaults:
    fraction 2e-4, bounds (1, 5). Computed once over the whole mini-batch, the draw and the means do not depend on
    the split. Unlike the official code, tokens the PPO clip already silenced are not left out of the draw (that
    needs the ratio, known only in each micro-batch's forward); on a step's first pass (r = 1) none is."""
    if not 0 < fraction <= 1 or not cov_low < cov_high:
        raise ValueError(
            f"Clip-Cov needs 0 < fraction <= 1 and cov_low < cov_high, got {fraction}, {cov_low}, {cov_high}"
        )
    valid = mask.to(torch.bool)
    cov = token_covariance(logprobs, advantages, valid)
    candidates = torch.nonzero((valid & (cov > cov_low) & (cov < cov_high)).flatten()).squeeze(-1)
    num = min(max(1, int(fraction * int(valid.sum()))), candidates.numel())
    order = torch.randperm(candidates.numel(), generator=generator, device="cpu").to(candidates.device)
    selected = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    selected[candidates[order[:num]]] = True
    return selected.view_as(valid)


def select_kl_cov_tokens(
    logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, fraction: float
) -> torch.Tensor:
    """KL-Cov's tokens: the max(1, floor(fraction N)) valid tokens of largest Cov_t (the paper's fraction: 2e-3 for
    Qwen2.5-7B, 2e-4 for 32B). Deterministic; computed over the whole mini-batch for split invariance."""
    if not 0 < fraction <= 1:
        raise ValueError(f"KL-Cov needs 0 < fraction <= 1, got {fraction}")
    valid = mask.to(torch.bool)
    num_valid = int(valid.sum())
    selected = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    if num_valid == 0:
        return selected.view_as(valid)
    cov = torch.where(valid, token_covariance(logprobs, advantages, valid), -math.inf).flatten()
    selected[torch.topk(cov, max(1, int(fraction * num_valid))).indices] = True
    return selected.view_as(valid)
