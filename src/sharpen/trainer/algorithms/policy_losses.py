# pyright: strict
"""Per-token policy-gradient losses: PPO-clip (with dual-clip), GSPO, CISPO, SAPO, GMPO and plain REINFORCE.

Each function returns the loss of every token, [batch, seq], exactly 0 at masked tokens, and a
`PolicyLossMetrics` of masked sums. ``compute_policy_loss`` is the registry: it maps the config's
``trainer.algorithm.policy_loss`` section to its function with the section's knobs, so adding a loss means its
section in ``config/policy_losses.py``, a function and a ``case`` here (pyright fails on a section of the
``PolicyLossConfig`` union without one), and a test.
Reducing the tokens to a scalar is `aggregation.aggregate_loss`'s job, so any loss combines with any aggregation
mode and with gradient accumulation over micro-batches.

Shared conventions: ``logprobs`` [batch, seq] are the trainer's, with gradient; ``old_logprobs`` [batch, seq]
are the behaviour policy's (the engine's; never differentiated); ``advantages`` are [batch, 1] (one per
sequence, broadcast) or [batch, seq]; ``mask`` [batch, seq] marks loss tokens. The log-ratio is set to 0 at
masked tokens before any exponential, so garbage in padding cannot overflow into inf or NaN gradients, and
every exponential of a log-ratio goes through `_exp_ratio`, which clamps it from above at the largest x of its dtype
whose exp is finite (float32: 88.7228, bfloat16: 88.5, float64: 709.78): a value whose exp does not overflow is
never changed (nor its gradient); one that would give inf gives the dtype's largest finite ratio, with gradient 0.
r_t = exp(logprobs_t - old_logprobs_t) is the token importance ratio; sg() is stop-gradient.

The loss functions know nothing of models, batches or configs (they take plain arguments); only the registry reads
the config's sections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import assert_never

import torch

from sharpen.config.policy_losses import (
    CISPOLoss,
    ClipCovLoss,
    GMPOLoss,
    GSPOLoss,
    KLCovLoss,
    PGLoss,
    PolicyLossConfig,
    PPOClipLoss,
    SAPOLoss,
)
from sharpen.trainer.algorithms.covariance import select_clip_cov_tokens, select_kl_cov_tokens


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


@cache
def exp_overflow_bound(dtype: torch.dtype) -> float:
    """The largest x representable in ``dtype`` whose exp is finite in ``dtype``; the next one up overflows."""
    up = torch.tensor(math.inf, dtype=dtype)
    x = torch.tensor(math.log(torch.finfo(dtype).max), dtype=dtype)
    while not torch.isfinite(torch.exp(x)):
        x = torch.nextafter(x, -up)
    while torch.isfinite(torch.exp(torch.nextafter(x, up))):
        x = torch.nextafter(x, up)
    return float(x)


def _exp_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio), guarded against overflow: only values whose exp would be inf are clamped (module docstring)."""
    return torch.exp(log_ratio.clamp(max=exp_overflow_bound(log_ratio.dtype)))


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
    ratio = _exp_ratio(_masked_log_ratio(logprobs, old_logprobs, valid))  # [batch, seq]
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
    ratio = _exp_ratio(seq_log_ratio + own)  # [batch, seq]: s_{i,t}, equal to s_i in value
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
    ratio = _exp_ratio(_masked_log_ratio(logprobs, old_logprobs, valid)).detach()  # [batch, seq]
    weight = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)  # [batch, seq]
    per_token = -weight * advantages * logprobs  # [batch, seq]
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    return per_token, PolicyLossMetrics(
        num_clipped_low=_masked_sum(ratio < 1.0 - clip_eps_low, valid),
        num_clipped_high=_masked_sum(ratio > 1.0 + clip_eps_high, valid),
        num_dual_clipped=_metric_zero(ratio),
        ratio_sum=_masked_sum(ratio, valid),
    )


def sapo_per_token(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float,
    tau_neg: float,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """SAPO (Gao et al. 2025, Qwen, "Soft Adaptive Policy Optimization", arXiv 2511.20347).

    The hard clip is replaced by a smooth gate: loss_t = -f(r_t; tau_t) A_t with
    f(r; tau) = (4 / tau) sigmoid(tau (r - 1)), tau_t = tau_pos where A_t > 0 and tau_neg otherwise. Its gradient
    with respect to logprobs_t is -4 sigmoid(x)(1 - sigmoid(x)) r_t A_t, x = tau_t (r_t - 1): exactly -A_t on-policy
    (r = 1), decaying smoothly as r leaves 1 instead of dropping to 0 at a clip bound; a larger tau decays faster.
    The paper's tau_neg > tau_pos (1.05 vs 1.0) damps negative-advantage updates more, which it found stabler.
    Nothing is clipped, so the clip metrics count 0. The paper averages tokens per sequence
    (``seq_mean_token_mean``).
    """
    if not tau_pos > 0 or not tau_neg > 0:
        raise ValueError(f"SAPO needs tau_pos > 0 and tau_neg > 0, got {tau_pos}, {tau_neg}")
    valid = mask.to(torch.bool)  # [batch, seq]
    ratio = _exp_ratio(_masked_log_ratio(logprobs, old_logprobs, valid))  # [batch, seq]
    positive = (advantages > 0).expand_as(ratio)  # [batch, seq]
    tau = torch.where(positive, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # [batch, seq]
    per_token = torch.where(valid, -gate * advantages, torch.zeros_like(ratio))
    return per_token, PolicyLossMetrics(
        num_clipped_low=_metric_zero(ratio),
        num_clipped_high=_metric_zero(ratio),
        num_dual_clipped=_metric_zero(ratio),
        ratio_sum=_masked_sum(ratio, valid),
    )


def gmpo_per_token(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    log_clip_low: float,
    log_clip_high: float,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673), in token form.

    The sequence objective is the geometric mean of the token-level clipped ratios, clipped in log space:
    with d_t = logprobs_t - old_logprobs_t and sgn = sign(A_i), c_t = sgn min(sgn d_t, sgn clip(d_t, -log_clip_low,
    log_clip_high)) (the pessimistic bound, as PPO's min, per token), R_i = exp((1 / L_i) sum_t m_t c_t) and
    J_i = R_i A_i. The paper clips wider than PPO, (e^-0.4, e^0.4). As in `gspo_per_token`, each token carries
    loss_{i,t} = -A_{i,t} sg(R_i) exp(c_t - sg(c_t)): equal to -R_i A_i in value, with the gradient
    -A_i R_i dc_t/dlogprobs_t, so with one advantage per sequence and ``seq_mean_token_mean`` aggregation it is the
    gradient of -mean_i R_i A_i exactly (a clipped token has dc_t = 0). Clipped tokens are counted as low when
    A < 0 and high when A > 0.
    """
    if not log_clip_low >= 0 or not log_clip_high >= 0:
        raise ValueError(f"GMPO needs log_clip_low >= 0 and log_clip_high >= 0, got {log_clip_low}, {log_clip_high}")
    valid = mask.to(torch.bool)  # [batch, seq]
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, valid)  # [batch, seq]
    sign = torch.sign(advantages)  # [batch, 1 | seq]
    bounded = log_ratio.clamp(-log_clip_low, log_clip_high)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * bounded)  # [batch, seq]: c_t
    clipped_log_ratio = torch.where(valid, clipped_log_ratio, torch.zeros_like(clipped_log_ratio))
    detached = clipped_log_ratio.detach().to(torch.promote_types(log_ratio.dtype, torch.float32))
    lengths = valid.sum(dim=-1, keepdim=True).clamp(min=1).to(detached.dtype)  # [batch, 1]
    seq_log_ratio = (detached.sum(dim=-1, keepdim=True) / lengths).to(logprobs.dtype)  # [batch, 1]: log R_i
    ratio = _exp_ratio(seq_log_ratio + clipped_log_ratio - clipped_log_ratio.detach())  # [batch, seq]
    per_token = torch.where(valid, -ratio * advantages, torch.zeros_like(ratio))
    clipped = (log_ratio != clipped_log_ratio) & valid
    return per_token, PolicyLossMetrics(
        num_clipped_low=_masked_sum(clipped & (advantages < 0), valid),
        num_clipped_high=_masked_sum(clipped & (advantages > 0), valid),
        num_dual_clipped=_metric_zero(ratio),
        ratio_sum=_masked_sum(ratio, valid),
    )


def clip_cov_per_token(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    selected: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """Clip-Cov (Cui et al. 2025): the PPO clipped loss, with the gradient of the ``selected`` tokens
    (`select_clip_cov_tokens`) detached: their loss value stays, they stop pulling the policy toward lower entropy."""
    per_token, metrics = ppo_clip_per_token(
        logprobs, old_logprobs, advantages, mask, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high
    )
    return torch.where(selected & mask.to(torch.bool), per_token.detach(), per_token), metrics


def kl_cov_per_token(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    selected: torch.Tensor,
    coef: float,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """KL-Cov (Cui et al. 2025, as in its official code): loss_t = -r_t A_t, unclipped, plus coef |log r_t| on the
    ``selected`` tokens (`select_kl_cov_tokens`; the paper's coef 1). |log r| is 0 with zero gradient at r = 1, so
    the penalty acts only once the policy has moved within a step (num_epochs or num_mini_batches > 1)."""
    if not coef >= 0:
        raise ValueError(f"KL-Cov needs coef >= 0, got {coef}")
    valid = mask.to(torch.bool)
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, valid)
    ratio = _exp_ratio(log_ratio)
    per_token = -ratio * advantages + torch.where(selected & valid, coef * log_ratio.abs(), 0.0)
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    return per_token, PolicyLossMetrics(
        num_clipped_low=_metric_zero(ratio),
        num_clipped_high=_metric_zero(ratio),
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


def select_tokens(
    loss: PolicyLossConfig,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor | None:
    """The tokens a loss treats apart (``loss.selects_tokens``: Clip-Cov's and KL-Cov's), selected over the whole
    mini-batch given; None for the other losses."""
    match loss:
        case ClipCovLoss():
            return select_clip_cov_tokens(
                logprobs,
                advantages,
                mask,
                fraction=loss.fraction,
                cov_low=loss.cov_min,
                cov_high=loss.cov_max,
                generator=generator,
            )
        case KLCovLoss():
            return select_kl_cov_tokens(logprobs, advantages, mask, fraction=loss.fraction)
        case _:
            return None


def compute_policy_loss(
    loss: PolicyLossConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    selected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """Per-token loss [batch, seq] and metrics of the policy loss ``loss`` (``trainer.algorithm.policy_loss``), with
    its section's knobs. ``selected``: the tokens a Clip-Cov or KL-Cov loss treats apart, selected over the whole
    mini-batch by the caller (`select_tokens`, for split invariance); None selects them from this batch alone, with
    the covariance of ``old_logprobs``. Plain policy gradient ignores ``old_logprobs`` (it has no ratio)."""
    match loss:
        case PPOClipLoss():
            return ppo_clip_per_token(
                logprobs,
                old_logprobs,
                advantages,
                mask,
                clip_eps_low=loss.clip_eps_low,
                clip_eps_high=loss.clip_eps_high,
                dual_clip_c=loss.dual_clip_c,
            )
        case GSPOLoss():
            return gspo_per_token(
                logprobs,
                old_logprobs,
                advantages,
                mask,
                clip_eps_low=loss.clip_eps_low,
                clip_eps_high=loss.clip_eps_high,
            )
        case CISPOLoss():
            return cispo_per_token(
                logprobs,
                old_logprobs,
                advantages,
                mask,
                clip_eps_low=loss.clip_eps_low,
                clip_eps_high=loss.clip_eps_high,
            )
        case SAPOLoss():
            return sapo_per_token(logprobs, old_logprobs, advantages, mask, tau_pos=loss.tau_pos, tau_neg=loss.tau_neg)
        case GMPOLoss():
            return gmpo_per_token(
                logprobs,
                old_logprobs,
                advantages,
                mask,
                log_clip_low=loss.log_clip_low,
                log_clip_high=loss.log_clip_high,
            )
        case ClipCovLoss():
            if selected is None:
                selected = select_tokens(loss, old_logprobs, advantages, mask)
            assert selected is not None
            return clip_cov_per_token(
                logprobs,
                old_logprobs,
                advantages,
                mask,
                selected=selected,
                clip_eps_low=loss.clip_eps_low,
                clip_eps_high=loss.clip_eps_high,
            )
        case KLCovLoss():
            if selected is None:
                selected = select_tokens(loss, old_logprobs, advantages, mask)
            assert selected is not None
            return kl_cov_per_token(logprobs, old_logprobs, advantages, mask, selected=selected, coef=loss.coef)
        case PGLoss():
            return pg_per_token(logprobs, advantages, mask)
        case _:
            assert_never(loss)
