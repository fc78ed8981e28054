# pyright: strict
"""Per-token policy-gradient losses: PPO-clip (with dual-clip), GSPO, CISPO and plain REINFORCE.

Each function returns the loss of every token, [batch, seq], exactly 0 at masked tokens, and a
`PolicyLossMetrics` of masked sums. ``compute_policy_loss`` is the registry: it maps the config's
``trainer.algorithm.policy_loss`` name to its function, so adding a loss means a function here, a ``case`` there
(pyright fails on a name of ``PolicyLoss`` without one), the name in the config's Literal, and a test.
Reducing the tokens to a scalar is `aggregation.aggregate_loss`'s job, so any loss combines with any aggregation
mode and with gradient accumulation over micro-batches.

Shared conventions: ``logprobs`` [batch, seq] are the trainer's, with gradient; ``old_logprobs`` [batch, seq]
are the behaviour policy's (the engine's; never differentiated); ``advantages`` are [batch, 1] (one per
sequence, broadcast) or [batch, seq]; ``mask`` [batch, seq] marks loss tokens. The log-ratio is set to 0 at
masked tokens before any exponential, so garbage in padding cannot overflow into inf or NaN gradients.
r_t = exp(logprobs_t - old_logprobs_t) is the token importance ratio; sg() is stop-gradient.

This module knows nothing of models, batches or configs (the registry takes the config's values as plain
arguments); it calls nothing of sharpen's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, assert_never

import torch

PolicyLoss = Literal["ppo_clip", "gspo", "cispo", "pg"]
"""The names of ``AlgorithmConfig.policy_loss`` (a test keeps the two equal: this package imports no config)."""


@dataclass(kw_only=True, slots=True)
class PolicyLossMetrics:
    """Sums over masked tokens, detached; divide by the step's number of loss tokens for fractions and means."""

    num_clipped_low: torch.Tensor
    """Scalar: tokens where the lower bound 1 - eps_low of the ratio took effect (A < 0, r < 1 - eps_low)."""
    num_clipped_high: torch.Tensor
    """Scalar: tokens where the upper bound 1 + eps_high of the ratio took effect (A > 0, r > 1 + eps_high)."""
    num_dual_clipped: torch.Tensor
    """Scalar: tokens whose loss was capped at c * |A| by dual-clip (PPO only)."""
    ratio_sum: torch.Tensor
    """Scalar: sum of the importance ratios (GSPO: each token carries its sequence's ratio)."""


def _masked_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    log_ratio = logprobs - old_logprobs.detach()  # [batch, seq]
    return torch.where(valid, log_ratio, torch.zeros_like(log_ratio))


def _masked_sum(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # At least float32: a bfloat16 sum of counts stops being exact at 256.
    values = values.detach().to(torch.promote_types(values.dtype, torch.float32))
    return torch.where(valid, values, torch.zeros_like(values)).sum()


def _metric_zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.promote_types(like.dtype, torch.float32), device=like.device)


def _check_clip(clip_eps_low: float, clip_eps_high: float) -> None:
    if not 0 <= clip_eps_low <= 1 or not clip_eps_high >= 0:
        raise ValueError(f"need 0 <= clip_eps_low <= 1 and clip_eps_high >= 0, got {clip_eps_low}, {clip_eps_high}")


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, clip_eps_low: float, clip_eps_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-min(r A, clip(r) A) per token, and where the clipped term won (strictly) at each bound."""
    unclipped = ratio * advantages  # [batch, seq]
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages  # [batch, seq]
    per_token = -torch.minimum(unclipped, clipped)  # [batch, seq]
    took_clip = clipped < unclipped  # [batch, seq]
    clipped_low = took_clip & (ratio < 1.0 - clip_eps_low) & valid
    clipped_high = took_clip & (ratio > 1.0 + clip_eps_high) & valid
    return per_token, clipped_low, clipped_high


def ppo_clip_per_token(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """PPO clipped surrogate per token (Schulman et al. 2017), clip-higher when eps_high > eps_low (DAPO).

    loss_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t). Where the clipped term is the smaller one
    the token has no gradient: PPO removes the incentive to move further, never the penalty.

    Dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning"): for
    A_t < 0 the loss above grows without bound in r_t (a token the policy now likes far more than the behaviour
    policy did), so it is capped: loss_t = min(loss_t, -c A_t) = min(loss_t, c |A_t|), c > 1. Capped tokens
    have no gradient. ``dual_clip_c=None`` turns it off.
    """
    _check_clip(clip_eps_low, clip_eps_high)
    if dual_clip_c is not None and not dual_clip_c > 1:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    valid = mask.to(torch.bool)  # [batch, seq]
    ratio = torch.exp(_masked_log_ratio(logprobs, old_logprobs, valid))  # [batch, seq]
    per_token, clipped_low, clipped_high = _clipped_surrogate(ratio, advantages, valid, clip_eps_low, clip_eps_high)
    dual_clipped = torch.zeros_like(valid)
    if dual_clip_c is not None:
        cap = -dual_clip_c * advantages  # [batch, 1 | seq]: c |A| where A < 0
        dual_clipped = (advantages < 0) & (per_token > cap) & valid  # [batch, seq]
        per_token = torch.where(advantages < 0, torch.minimum(per_token, cap), per_token)
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    return per_token, PolicyLossMetrics(
        num_clipped_low=_masked_sum(clipped_low, valid),
        num_clipped_high=_masked_sum(clipped_high, valid),
        num_dual_clipped=_masked_sum(dual_clipped, valid),
        ratio_sum=_masked_sum(ratio, valid),
    )


def gspo_per_token(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), in its token-level form GSPO-token.

    The ratio is per sequence, the geometric mean of its token ratios over the L_i loss tokens:
    s_i = exp((1 / L_i) sum_t m_{i,t} (logprobs_{i,t} - old_logprobs_{i,t})), and it is clipped per sequence
    (the paper's eps are ~1e-3 to 1e-4, far smaller than PPO's). The gradient reaches every token through
    s_{i,t} = sg(s_i) * exp(logprobs_{i,t} - sg(logprobs_{i,t})), equal to s_i in value, with
    d s_{i,t} / d logprobs_{i,t} = s_i; loss_{i,t} = -min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1 - eps_low,
    1 + eps_high) A_{i,t}).

    With one advantage per sequence and ``seq_mean_token_mean`` aggregation this is GSPO exactly: its gradient
    equals that of -min(s_i A_i, clip(s_i) A_i) averaged over sequences, differentiating through s_i. A row
    without loss tokens has s_i = 1 and contributes 0.
    """
    _check_clip(clip_eps_low, clip_eps_high)
    valid = mask.to(torch.bool)  # [batch, seq]
    # The sequence mean in at least float32: a bfloat16 sum over thousands of tokens, or a length above 256, rounds.
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, valid).detach()  # [batch, seq]
    log_ratio = log_ratio.to(torch.promote_types(log_ratio.dtype, torch.float32))
    lengths = valid.sum(dim=-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)  # [batch, 1]
    seq_log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / lengths).to(logprobs.dtype)  # [batch, 1]: log s_i
    own = logprobs - logprobs.detach()  # [batch, seq]: value 0, gradient 1
    own = torch.where(valid, own, torch.zeros_like(own))
    ratio = torch.exp(seq_log_ratio + own)  # [batch, seq]: s_{i,t}, equal to s_i in value
    per_token, clipped_low, clipped_high = _clipped_surrogate(ratio, advantages, valid, clip_eps_low, clip_eps_high)
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    return per_token, PolicyLossMetrics(
        num_clipped_low=_masked_sum(clipped_low, valid),
        num_clipped_high=_masked_sum(clipped_high, valid),
        num_dual_clipped=_metric_zero(ratio),
        ratio_sum=_masked_sum(ratio, valid),
    )


def cispo_per_token(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_high: float,
    clip_eps_low: float,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention").

    loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t logprobs_t: REINFORCE with a truncated,
    stop-gradient importance weight. Unlike PPO, a token whose ratio leaves the trust region keeps its gradient
    (-clip(r_t) A_t with respect to logprobs_t); only its weight is bounded. MiniMax-M1 set no lower bound:
    pass ``clip_eps_low=1.0`` for that. The loss *value* is not a surrogate objective (it is linear in the
    logprob); only its gradient is meaningful.
    """
    _check_clip(clip_eps_low, clip_eps_high)
    valid = mask.to(torch.bool)  # [batch, seq]
    ratio = torch.exp(_masked_log_ratio(logprobs, old_logprobs, valid)).detach()  # [batch, seq]
    weight = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)  # [batch, seq]
    per_token = -weight * advantages * logprobs  # [batch, seq]
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    return per_token, PolicyLossMetrics(
        num_clipped_low=_masked_sum(ratio < 1.0 - clip_eps_low, valid),
        num_clipped_high=_masked_sum(ratio > 1.0 + clip_eps_high, valid),
        num_dual_clipped=_metric_zero(ratio),
        ratio_sum=_masked_sum(ratio, valid),
    )


def pg_per_token(
    logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """Vanilla policy gradient (REINFORCE, Williams 1992): loss_t = -A_t logprobs_t.

    Correct only on-policy (the rollouts came from these weights): there is no importance ratio. The metrics
    count no clipping and a ratio of 1 per loss token.
    """
    valid = mask.to(torch.bool)  # [batch, seq]
    per_token = -advantages * logprobs  # [batch, seq]
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    return per_token, PolicyLossMetrics(
        num_clipped_low=_metric_zero(logprobs),
        num_clipped_high=_metric_zero(logprobs),
        num_dual_clipped=_metric_zero(logprobs),
        ratio_sum=_masked_sum(torch.ones_like(logprobs), valid),
    )


def compute_policy_loss(
    name: PolicyLoss,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """Per-token loss [batch, seq] and metrics of the policy loss ``name`` (``trainer.algorithm.policy_loss``).

    Every loss gets the same arguments and takes what it uses: the clip bounds go to PPO, GSPO and CISPO,
    ``dual_clip_c`` to PPO only, and plain policy gradient ignores ``old_logprobs`` (it has no ratio).
    """
    match name:
        case "ppo_clip":
            return ppo_clip_per_token(
                logprobs,
                old_logprobs,
                advantages,
                mask,
                clip_eps_low=clip_eps_low,
                clip_eps_high=clip_eps_high,
                dual_clip_c=dual_clip_c,
            )
        case "gspo":
            return gspo_per_token(
                logprobs, old_logprobs, advantages, mask, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high
            )
        case "cispo":
            return cispo_per_token(
                logprobs, old_logprobs, advantages, mask, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high
            )
        case "pg":
            return pg_per_token(logprobs, advantages, mask)
        case _:
            assert_never(name)
