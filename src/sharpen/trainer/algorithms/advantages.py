"""Advantage estimators over groups of rollouts of the same example."""

from __future__ import annotations

import torch

from sharpen.config.advantages import StdConvention

__all__ = ["StdConvention", "compute_grpo_advantages"]


def compute_grpo_advantages(
    scores: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6, std: StdConvention = "unbiased"
) -> torch.Tensor:
    """GRPO group-relative advantages.

    ``scores``: [num_groups, group_size], NaN where the reward abstained. Each valid score is centred on its
    group's mean over valid scores and, with ``normalize_std``, divided by the group's standard deviation + eps,
    over its k valid scores: sqrt(sum (r - mean)^2 / (k - 1)) with ``std = "unbiased"`` (the reference
    implementations' torch.std), / k with ``"population"``. Abstained entries get NaN back (the caller leaves
    them out of the batch). A group with one valid score, or all-equal scores, gets advantages of exactly 0 (no
    signal, and no NaN).
    """
    valid = ~torch.isnan(scores)  # [groups, n]
    num_valid = valid.sum(dim=1, keepdim=True).clamp(min=1)
    filled = torch.where(valid, scores, torch.zeros_like(scores))
    mean = filled.sum(dim=1, keepdim=True) / num_valid
    highest = torch.where(valid, scores, torch.full_like(scores, -torch.inf)).amax(dim=1, keepdim=True)
    lowest = torch.where(valid, scores, torch.full_like(scores, torch.inf)).amin(dim=1, keepdim=True)
    # An all-equal group is left at exactly 0: ``scores - mean`` would keep the mean's rounding error (~1e-17),
    # which the std normalisation would then turn into advantages of ~1e-10 (three scores of 0.7 in float64).
    has_spread = valid & (highest > lowest)
    centred = torch.where(has_spread, scores - mean, torch.zeros_like(scores))
    if normalize_std:
        # A group with spread has k >= 2, so k - 1 >= 1; the clamp only keeps flat groups (centred = 0) finite.
        divisor = num_valid if std == "population" else (num_valid - 1).clamp(min=1)
        deviation = (centred.pow(2).sum(dim=1, keepdim=True) / divisor).sqrt()
        centred = centred / (deviation + eps)
    return torch.where(valid, centred, torch.full_like(scores, float("nan")))
