# pyright: strict
"""The critic's per-token loss for PPO with a value model: squared error to the GAE returns, optionally clipped.

Like the policy losses, it returns the loss of every token, [batch, seq], exactly 0 at masked tokens, plus masked
sums for metrics; reducing the tokens to a scalar is `aggregation.aggregate_loss`'s job. It knows nothing of
models, batches or configs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class ValueLossMetrics:
    """Sums over masked tokens, detached; divide by the step's number of loss tokens for fractions."""

    num_clipped: torch.Tensor
    """Scalar: tokens where the clipped term was strictly the larger, i.e. the clip removed the gradient."""


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    value_clip: float | None,
) -> tuple[torch.Tensor, ValueLossMetrics]:
    """Per-token value loss [batch, seq] with PPO value clipping.

    ``values`` [batch, seq]: the critic's current predictions, with gradient; ``old_values``: its predictions at
    the start of the step (the ones GAE used); ``returns``: the regression targets (GAE advantages + old values);
    ``mask``: loss tokens. With V_clip = V_old + clip(V - V_old, -c, c),

        l_t = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2),

    the pessimistic choice of the PPO implementations (Schulman et al. 2017, openai/baselines ppo2; see Huang et
    al. 2022, "The 37 Implementation Details of Proximal Policy Optimization"): once a value has moved more than
    c from its old value towards the return, the clipped term dominates and that token stops pulling it further.
    ``value_clip=None`` gives plain 0.5 * (V - R)^2. ``old_values`` and ``returns`` are never differentiated.
    Masked tokens are selected out with ``torch.where`` first, so padding garbage cannot reach the loss or gradient.
    """
    if not values.shape == old_values.shape == returns.shape == mask.shape:
        raise ValueError(
            "values, old_values, returns and mask must have the same shape; got "
            f"{list(values.shape)}, {list(old_values.shape)}, {list(returns.shape)}, {list(mask.shape)}"
        )
    if value_clip is not None and not value_clip > 0:
        raise ValueError(f"value_clip must be positive or None, got {value_clip}")
    valid = mask.to(torch.bool)  # [batch, seq]
    # Zero the masked entries before any arithmetic: a NaN there would otherwise turn the (zero) gradient of the
    # final ``torch.where`` into NaN on its way back through the square.
    values = torch.where(valid, values, torch.zeros_like(values))
    old_values = torch.where(valid, old_values.detach(), torch.zeros_like(values))
    returns = torch.where(valid, returns.detach(), torch.zeros_like(values))
    unclipped = (values - returns).pow(2)  # [batch, seq]
    if value_clip is None:
        per_token = 0.5 * unclipped
        num_clipped = torch.zeros((), dtype=torch.float32, device=values.device)
    else:
        moved = old_values + (values - old_values).clamp(-value_clip, value_clip)  # [batch, seq]
        clipped = (moved - returns).pow(2)  # [batch, seq]
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        took_clip = (clipped > unclipped) & valid  # [batch, seq]
        num_clipped = took_clip.detach().sum().to(torch.float32)
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    return per_token, ValueLossMetrics(num_clipped=num_clipped)
