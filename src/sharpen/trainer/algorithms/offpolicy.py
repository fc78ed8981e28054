"""Off-policy corrections: per-token weights and masks for the policy loss, against the engine's logprobs.

The tokens of a batch were sampled by the inference engine (the behaviour policy, ``engine_logprobs``), but the
policy gradient is taken for the trainer's policy at the start of the step (``trainer_logprobs``, the "old"
logprobs). The two are never exactly equal, even in synchronous mode with bit-identical weights: the engine runs
other kernels (paged/fused attention, bf16 matmuls with another accumulation order, tensor-parallel reductions,
its own sampler's logprob computation) than the trainer (SDPA or flash attention, autocast, FSDP). Asynchronous
generation adds staleness: a token may come from weights several versions old. Treating the engine's samples as
the trainer's biases the gradient, and Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training", show the mismatch alone can make RL training collapse, and that weighting each token by
the truncated ratio restores stable training at almost no cost. A correction is therefore on by default: with no
mismatch every weight is 1 and every token is kept, so it only acts where the engine and the trainer disagree.

With r_t = p_trainer(y_t) / p_engine(y_t) (``trainer_logprobs - engine_logprobs`` in log space):

- ``none``: weight 1 on every valid token (the metrics are still computed).
- ``token_tis``: truncated importance sampling (Yao et al. 2025), weight min(r_t, cap). Truncation trades a
  little bias for bounded variance; tokens far below 1 are down-weighted, none is dropped.
- ``sequence_tis``: weight min(prod_t r_t, cap), the same for every token of a sequence: the unbiased
  correction for a sequence-level objective, with far larger variance (hence the cap), computed as a sum of log
  ratios so it never overflows.
- ``token_mask``: token-level rejection (masked importance sampling): keep a token only when its ratio lies in
  [low, high], with weight 1; tokens outside the band (where the two policies disagree most, e.g. MoE routing
  flips) are masked out of the loss instead of reweighted. It is *not* IcePop: the kept tokens are not reweighted.
- ``icepop``: IcePop (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
  Thinking Model", arXiv 2510.18855, introduced for training Ring-1T): the weight is M(r_t) = r_t inside
  [low, high] and 0 outside, so kept tokens are importance-weighted and the rest are dropped.
- ``sequence_mask``: keep a whole sequence only when its geometric-mean ratio exp(mean_t log r_t) lies in
  [low, high]; length-normalised, so long sequences are not rejected for accumulating small mismatches.

Weights are 0 and the mask is False wherever a token is not kept (outside the input mask or rejected), so
``(per_token_loss * weights).sum() / normalizer`` is the corrected loss on its own; the normaliser stays the
caller's (counting rejected tokens keeps the micro-batch split from changing the update). The weights are
detached: they scale the gradient, they are not differentiated. The PPO ratio then runs between the current
logprobs and ``trainer_logprobs`` (decoupled PPO: the clip bounds the trainer's own update, the weight the
engine-to-trainer mismatch).

On top of a mode, ``reject`` chains rejection criteria (``trainer.algorithm.off_policy_correction.reject``):
each tests a
per-token divergence, k1 = log r_t, k2 = 0.5 (log r_t)^2 or k3 = (r_t - 1) - log r_t, per token or through a
sequence's sum, mean or max of it (k1 as a ratio band [low, high] on exp of the statistic, k2 / k3 against an
upper threshold), and a token stays in the loss only if the mode and every criterion keep it. The mode's weight is
computed as without them; rejected tokens get weight 0 and leave the mask. ``normalizer`` divides the kept weights
by a constant: their mean over the whole mini-batch (`normalizer_terms`, summed by the trainer before the first
micro-batch), so they average 1 whatever the micro-batch split. With either, the correction also carries additive
``sums`` (counts, weight sums) and ``maxima``, which the trainer adds over micro-batches and ranks and turns into
per-criterion rejected fractions and the weights' mean, max and ESS (`correction_metrics`).

Log ratios are clamped to +-``LOG_RATIO_LIMIT`` (e^80 ~ 5.5e34, finite in float32) before anything else, so an
infinite trainer logprob or an extreme mismatch gives finite weights and metrics; the clamp changes no weight that
matters (past e^+-80 a TIS weight is the cap or ~0, and a band of any sensible width rejects the token). NaN
inputs on valid tokens are not sanitised. This module does not compute the loss, choose a mode, or know about
models or batches: the trainer does, from its config (``compute_correction`` reads the section's knobs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import assert_never

import torch

from sharpen.config.corrections import (
    CorrectionConfig,
    IcePopCorrection,
    NoCorrection,
    OffPolicyRejectConfig,
    SequenceMaskCorrection,
    SequenceTISCorrection,
    TokenMaskCorrection,
    TokenTISCorrection,
)

LOG_RATIO_LIMIT = 80.0
"""Log ratios are clamped to [-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT] so that every exp stays finite in float32."""

_QUANTILES = (0.01, 0.5, 0.99)
_METRIC_NAMES = tuple(
    f"offpolicy/{name}"
    for name in ("kl_k1", "kl_k3", "ratio_p01", "ratio_p50", "ratio_p99", "masked_fraction", "capped_fraction", "ess")
)


@dataclass(kw_only=True, slots=True)
class OffPolicyCorrection:
    weights: torch.Tensor
    """[batch, seq] detached float: multiply the per-token policy loss; 0 wherever ``mask`` is False."""
    mask: torch.Tensor
    """[batch, seq] bool: the tokens kept in the loss (a subset of the input mask)."""
    metrics: dict[str, float]
    """Mismatch and correction statistics over the input mask's tokens, as ``offpolicy/*`` metrics."""
    sums: dict[str, float] = field(default_factory=dict[str, float])
    """With rejection criteria or a normaliser: counts and weight sums to add over micro-batches and ranks (the
    input of `correction_metrics`); empty otherwise."""
    maxima: dict[str, float] = field(default_factory=dict[str, float])
    """Like ``sums``, statistics to take the maximum of over micro-batches and ranks (the largest weight)."""


def token_tis(
    trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, *, cap: float
) -> OffPolicyCorrection:
    """Truncated importance sampling per token: weight min(r_t, cap)."""
    log_cap = _log_cap(cap)
    log_ratio = _log_ratio(trainer_logprobs, engine_logprobs, mask)  # [batch, seq]
    weights = torch.where(mask, log_ratio.clamp(max=log_cap).exp(), 0.0)
    return _correction(log_ratio, mask, kept=mask, weights=weights, capped=mask & (log_ratio > log_cap))


def sequence_tis(
    trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, *, cap: float
) -> OffPolicyCorrection:
    """Truncated importance sampling per sequence: every token of a row gets min(prod_t r_t, cap)."""
    log_cap = _log_cap(cap)
    log_ratio = _log_ratio(trainer_logprobs, engine_logprobs, mask)  # [batch, seq]
    sequence_log_ratio = log_ratio.sum(dim=-1, keepdim=True)  # [batch, 1]; invalid tokens are 0
    weights = torch.where(mask, sequence_log_ratio.clamp(max=log_cap).exp(), 0.0)
    return _correction(log_ratio, mask, kept=mask, weights=weights, capped=mask & (sequence_log_ratio > log_cap))


def token_mask_is(
    trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, *, low: float, high: float
) -> OffPolicyCorrection:
    """Token-level rejection: keep a token (weight 1) only when its ratio r_t lies in [low, high]."""
    log_low, log_high = _log_band(low, high)
    log_ratio = _log_ratio(trainer_logprobs, engine_logprobs, mask)  # [batch, seq]
    kept = mask & (log_ratio >= log_low) & (log_ratio <= log_high)
    return _correction(log_ratio, mask, kept=kept, weights=kept.to(log_ratio.dtype), capped=torch.zeros_like(mask))


def icepop(
    trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, *, low: float, high: float
) -> OffPolicyCorrection:
    """IcePop: weight r_t where the ratio lies in [low, high], 0 (and masked out) elsewhere."""
    log_low, log_high = _log_band(low, high)
    log_ratio = _log_ratio(trainer_logprobs, engine_logprobs, mask)  # [batch, seq]
    kept = mask & (log_ratio >= log_low) & (log_ratio <= log_high)
    weights = torch.where(kept, log_ratio.exp(), 0.0)
    return _correction(log_ratio, mask, kept=kept, weights=weights, capped=torch.zeros_like(mask))


def sequence_mask_is(
    trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, *, low: float, high: float
) -> OffPolicyCorrection:
    """Keep a whole sequence (weight 1) only when its geometric-mean ratio exp(mean_t log r_t) lies in [low, high]."""
    log_low, log_high = _log_band(low, high)
    log_ratio = _log_ratio(trainer_logprobs, engine_logprobs, mask)  # [batch, seq]
    num_valid = mask.sum(dim=-1, keepdim=True).clamp(min=1)  # [batch, 1]
    mean_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / num_valid  # [batch, 1]
    kept = mask & (mean_log_ratio >= log_low) & (mean_log_ratio <= log_high)
    return _correction(log_ratio, mask, kept=kept, weights=kept.to(log_ratio.dtype), capped=torch.zeros_like(mask))


def compute_correction(
    correction: CorrectionConfig,
    trainer_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    normalizer: float | None = None,
) -> OffPolicyCorrection:
    """The correction ``correction`` (``trainer.algorithm.off_policy_correction``) with its section's knobs. Tokens
    that a criterion of its ``reject`` drops leave the mask; the kept weights are divided by ``normalizer``."""
    result = _section_correction(correction, trainer_logprobs, engine_logprobs, mask)
    if not correction.reject and normalizer is None:
        return result
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"importance-weight normalizer must be positive, got {normalizer}")
    log_ratio = _log_ratio(trainer_logprobs, engine_logprobs, mask)
    return _reject_and_normalize(result, log_ratio, mask, correction.reject, normalizer)


def keep_by_criterion(log_ratio: torch.Tensor, mask: torch.Tensor, criterion: OffPolicyRejectConfig) -> torch.Tensor:
    """[batch, seq] bool: the tokens of ``mask`` that ``criterion`` keeps, given ``log_ratio`` (0 outside ``mask``).

    k1 criteria keep log(low) <= statistic <= log(high): per token the ratio r_t, per sequence with ``sum`` the
    product ratio, with ``mean`` the geometric-mean ratio. k2 / k3 criteria keep statistic <= high. An overflowing
    k3 sum is inf and rejected, as it should be."""
    log_ratio = torch.where(mask, log_ratio, 0.0)
    if criterion.divergence == "k1":
        divergence = log_ratio
    elif criterion.divergence == "k2":
        divergence = 0.5 * log_ratio.square()
    else:
        divergence = torch.expm1(log_ratio) - log_ratio  # (r - 1) - log r, exact near r = 1; 0 where masked
    if criterion.level == "token" or log_ratio.shape[-1] == 0:
        value = divergence  # [batch, seq]
    elif criterion.statistic == "max":
        value = divergence.amax(dim=-1, keepdim=True)  # [batch, 1]; k2 / k3 are >= 0, and 0 where masked
    else:
        value = divergence.sum(dim=-1, keepdim=True)  # [batch, 1]
        if criterion.statistic == "mean":
            value = value / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    if criterion.divergence == "k1":
        assert criterion.low is not None  # the config requires it for k1
        log_low, log_high = _log_band(criterion.low, criterion.high)
        return mask & (value >= log_low) & (value <= log_high)
    return mask & (value <= criterion.high)


def normalizer_terms(correction: OffPolicyCorrection, *, per_sequence: bool) -> dict[str, float]:
    """``weight_sum`` and ``count`` of the kept weights, per kept token or per kept sequence (a sequence weight is
    the same on all its kept tokens): summed over a mini-batch's parts, weight_sum / count is its normaliser."""
    if per_sequence:
        rows = correction.mask.any(dim=-1)  # [batch]
        row_weights = correction.weights.amax(dim=-1) if correction.weights.shape[-1] else rows.double()
        total, count = row_weights[rows].double().sum(), rows.sum()
    else:
        total, count = correction.weights[correction.mask].double().sum(), correction.mask.sum()
    return {"weight_sum": float(total), "count": float(count)}


def correction_metrics(sums: dict[str, float], maxima: dict[str, float]) -> dict[str, float]:
    """The ``offpolicy/*`` metrics of a step from its corrections' ``sums`` and ``maxima`` (added / maxed over
    micro-batches and ranks): per criterion the rejected fraction of valid tokens (``reject/NAME/token_fraction``;
    criteria overlap, ``masked_fraction`` counts the union) and, for sequence criteria, of sequences with a valid
    token (``sequence_fraction``); the applied weights' mean, max and ESS (sum w)^2 / (n sum w^2) over kept
    tokens (1 with none kept); ``weight_normalizer``, the token-weighted mean normaliser, when normalising."""
    num_tokens, num_sequences = max(sums["num_tokens"], 1.0), max(sums["num_sequences"], 1.0)
    num_kept, weight_sum, weight_sq_sum = sums["num_kept"], sums["weight_sum"], sums["weight_sq_sum"]
    metrics: dict[str, float] = {}
    for name, value in sums.items():
        if name.startswith("reject/"):
            criterion, _, unit = name.rpartition("/")
            denominator = num_tokens if unit == "tokens" else num_sequences
            metrics[f"offpolicy/{criterion}/{unit.removesuffix('s')}_fraction"] = value / denominator
    metrics["offpolicy/weight_mean"] = weight_sum / num_kept if num_kept else 0.0
    metrics["offpolicy/weight_max"] = maxima.get("weight_max", 0.0)
    metrics["offpolicy/weight_ess"] = weight_sum**2 / (num_kept * weight_sq_sum) if weight_sq_sum > 0 else 1.0
    if "normalizer_tokens" in sums:
        metrics["offpolicy/weight_normalizer"] = sums["normalizer_tokens"] / num_tokens
    return metrics


def _section_correction(
    correction: CorrectionConfig, trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor
) -> OffPolicyCorrection:
    match correction:
        case NoCorrection():
            log_ratio = _log_ratio(trainer_logprobs, engine_logprobs, mask)
            weights = mask.to(log_ratio.dtype)
            return _correction(log_ratio, mask, kept=mask, weights=weights, capped=torch.zeros_like(mask))
        case TokenTISCorrection():
            return token_tis(trainer_logprobs, engine_logprobs, mask, cap=correction.cap)
        case SequenceTISCorrection():
            return sequence_tis(trainer_logprobs, engine_logprobs, mask, cap=correction.cap)
        case TokenMaskCorrection():
            return token_mask_is(trainer_logprobs, engine_logprobs, mask, low=correction.low, high=correction.high)
        case IcePopCorrection():
            return icepop(trainer_logprobs, engine_logprobs, mask, low=correction.low, high=correction.high)
        case SequenceMaskCorrection():
            return sequence_mask_is(trainer_logprobs, engine_logprobs, mask, low=correction.low, high=correction.high)
        case _:
            assert_never(correction)


def _reject_and_normalize(
    correction: OffPolicyCorrection,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    criteria: Sequence[OffPolicyRejectConfig],
    normalizer: float | None,
) -> OffPolicyCorrection:
    """``correction`` with ``criteria``'s rejections and the kept weights divided by ``normalizer``, plus the
    additive statistics of `correction_metrics`."""
    kept = correction.mask
    rows = mask.any(dim=-1)  # [batch]: sequences with a valid token
    counts = {"num_tokens": mask.sum(), "num_sequences": rows.sum()}
    for criterion in criteria:
        kept_by = keep_by_criterion(log_ratio, mask, criterion)
        kept = kept & kept_by
        counts[f"reject/{criterion.name}/tokens"] = (mask & ~kept_by).sum()
        if criterion.level == "sequence":
            counts[f"reject/{criterion.name}/sequences"] = (rows & ~kept_by.any(dim=-1)).sum()
    scale = 1.0 if normalizer is None else normalizer
    weights = torch.where(kept, correction.weights / scale, 0.0)
    kept_weights = weights[kept].double()  # [num_kept]
    counts |= {
        "num_kept": kept.sum(),
        "weight_sum": kept_weights.sum(),
        "weight_sq_sum": kept_weights.square().sum(),
        "weight_max": kept_weights.max() if kept_weights.numel() else kept_weights.new_zeros(()),
    }
    summary = torch.stack([v.double() for v in counts.values()]).cpu()  # one device-to-host copy
    values = {name: float(v) for name, v in zip(counts, summary, strict=True)}
    maxima = {"weight_max": values.pop("weight_max")}
    if normalizer is not None:
        values["normalizer_tokens"] = normalizer * values["num_tokens"]
    metrics = dict(correction.metrics)
    if values["num_tokens"]:
        metrics["offpolicy/masked_fraction"] = (values["num_tokens"] - values["num_kept"]) / values["num_tokens"]
    return OffPolicyCorrection(weights=weights.detach(), mask=kept, metrics=metrics, sums=values, maxima=maxima)


def _log_ratio(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log r = trainer - engine on valid tokens, 0 elsewhere, clamped; float32 at least (bf16 inputs are upcast)."""
    if trainer_logprobs.shape != engine_logprobs.shape or trainer_logprobs.shape != mask.shape:
        raise ValueError(
            f"off-policy correction needs equal shapes: trainer_logprobs {tuple(trainer_logprobs.shape)}, "
            f"engine_logprobs {tuple(engine_logprobs.shape)}, mask {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"off-policy correction needs a bool mask, got {mask.dtype}")
    dtype = torch.promote_types(torch.promote_types(trainer_logprobs.dtype, engine_logprobs.dtype), torch.float32)
    log_ratio = trainer_logprobs.detach().to(dtype) - engine_logprobs.detach().to(dtype)
    # torch.where, not a multiply: padding may hold anything (inf - inf = NaN), and NaN * 0 is NaN.
    return torch.where(mask, log_ratio, 0.0).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _log_cap(cap: float) -> float:
    if not cap > 0:
        raise ValueError(f"importance-sampling cap must be positive, got {cap}")
    return math.log(cap)


def _log_band(low: float, high: float) -> tuple[float, float]:
    if not 0 <= low <= high:
        raise ValueError(f"importance-ratio band needs 0 <= low <= high, got low={low}, high={high}")
    return (-math.inf if low == 0 else math.log(low)), math.log(high)


def _correction(
    log_ratio: torch.Tensor, mask: torch.Tensor, *, kept: torch.Tensor, weights: torch.Tensor, capped: torch.Tensor
) -> OffPolicyCorrection:
    return OffPolicyCorrection(
        weights=weights.detach(),
        mask=kept,
        metrics=_metrics(log_ratio, mask, kept=kept, weights=weights, capped=capped),
    )


def _metrics(
    log_ratio: torch.Tensor, mask: torch.Tensor, *, kept: torch.Tensor, weights: torch.Tensor, capped: torch.Tensor
) -> dict[str, float]:
    """Means over the input mask's tokens, in float64 (k3 and squared ratios of e^80 overflow float32).

    With samples from the engine: k1 = mean(-log r) and k3 = mean(r - 1 - log r) estimate KL(engine || trainer)
    (k3 unbiased and non-negative). ESS = (sum r)^2 / (n sum r^2) of the raw token ratios, computed with
    logsumexp (scale-free): 1 when the policies agree, towards 1/n when a few tokens dominate. With no valid
    token every metric is 0 except the ESS, which is 1 (nothing needs correcting).
    """
    num_valid = int(mask.sum())
    if num_valid == 0:
        return {"offpolicy/num_tokens": 0.0, **dict.fromkeys(_METRIC_NAMES, 0.0), "offpolicy/ess": 1.0}
    valid = log_ratio[mask].double()  # [num_valid]
    log_ess = 2 * torch.logsumexp(valid, dim=0) - torch.logsumexp(2 * valid, dim=0) - math.log(num_valid)
    summary = torch.stack(
        [
            (-valid).mean(),
            (torch.expm1(valid) - valid).mean(),
            *_quantiles(valid.exp(), _QUANTILES),
            (num_valid - kept.sum()).double() / num_valid,
            capped.sum().double() / num_valid,
            log_ess.exp(),
        ]
    ).cpu()  # one device-to-host copy
    return {
        "offpolicy/num_tokens": float(num_valid),
        **{n: float(v) for n, v in zip(_METRIC_NAMES, summary, strict=True)},
    }


def _quantiles(values: torch.Tensor, quantiles: tuple[float, ...]) -> list[torch.Tensor]:
    """torch.quantile's default (linear) interpolation, by sorting: torch.quantile refuses inputs over 2**24
    elements, fewer than the tokens of a large step."""
    ordered = values.sort().values
    result: list[torch.Tensor] = []
    for q in quantiles:
        position = q * (ordered.numel() - 1)
        below = ordered[math.floor(position)]
        above = ordered[math.ceil(position)]
        result.append(torch.lerp(below, above, position - math.floor(position)))
    return result
