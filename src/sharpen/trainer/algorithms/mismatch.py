"""How far the trainer's logprobs are from the engine's (behaviour) logprobs on the same tokens."""

from __future__ import annotations

import torch


def compute_mismatch_metrics(
    logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Sums over masked tokens (divide by the token count for means): k1 and k3 estimates of KL(engine || trainer)
    with samples drawn from the engine, and the absolute logprob difference.

    k1 = log p_engine - log p_trainer; k3 = (r - 1) - log r with r = p_trainer / p_engine (unbiased, non-negative).
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs.detach() - engine_logprobs).float()  # log r
    k1 = -log_ratio
    k3 = torch.expm1(log_ratio) - log_ratio
    return {
        "k1_sum": (k1 * mask).sum(),
        "k3_sum": (k3 * mask).sum(),
        "abs_diff_sum": (log_ratio.abs() * mask).sum(),
        "abs_diff_max": (log_ratio.abs() * mask).max() if mask.any() else torch.zeros(()),
    }
