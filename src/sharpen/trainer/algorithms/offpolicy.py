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
- ``token_mask``: IcePop (Ling team 2025, introduced for training the Ring-1T MoE models): keep a token only when
  its ratio lies in [low, high], weight 1; tokens outside the band (where the two policies disagree most, e.g.
  MoE routing flips) are masked out of the loss instead of reweighted.
- ``sequence_mask``: keep a whole sequence only when its geometric-mean ratio exp(mean_t log r_t) lies in
  [low, high]; length-normalised, so long sequences are not rejected for accumulating small mismatches.

Weights are 0 and the mask is False wherever a token is not kept (outside the input mask or rejected), so
``(per_token_loss * weights).sum() / normalizer`` is the corrected loss on its own; the normaliser stays the
caller's (counting rejected tokens keeps the micro-batch split from changing the update). The weights are
detached: they scale the gradient, they are not differentiated. The PPO ratio then runs between the current
logprobs and ``trainer_logprobs`` (decoupled PPO: the clip bounds the trainer's own update, the weight the
engine-to-trainer mismatch).

Log ratios are clamped to +-``LOG_RATIO_LIMIT`` (e^80 ~ 5.5e34, finite in float32) before anything else, so an
infinite trainer logprob or an extreme mismatch gives finite weights and metrics; the clamp changes no weight that
matters (past e^+-80 a TIS weight is the cap or ~0, and a band of any sensible width rejects the token). NaN
inputs on valid tokens are not sanitised. This module does not compute the loss, choose a mode, or know about
models or batches: the trainer does, from its config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

CorrectionMode = Literal["none", "token_tis", "sequence_tis", "token_mask", "sequence_mask"]

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
    """IcePop: keep a token (weight 1) only when its ratio r_t lies in [low, high]."""
    log_low, log_high = _log_band(low, high)
    log_ratio = _log_ratio(trainer_logprobs, engine_logprobs, mask)  # [batch, seq]
    kept = mask & (log_ratio >= log_low) & (log_ratio <= log_high)
    return _correction(log_ratio, mask, kept=kept, weights=kept.to(log_ratio.dtype), capped=torch.zeros_like(mask))


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
    mode: CorrectionMode,
    trainer_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float,
    low: float,
    high: float,
) -> OffPolicyCorrection:
    """The correction named by ``mode``; ``cap`` is used by the TIS modes, ``low``/``high`` by the mask modes."""
    if mode == "none":
        log_ratio = _log_ratio(trainer_logprobs, engine_logprobs, mask)
        weights = mask.to(log_ratio.dtype)
        return _correction(log_ratio, mask, kept=mask, weights=weights, capped=torch.zeros_like(mask))
    if mode == "token_tis":
        return token_tis(trainer_logprobs, engine_logprobs, mask, cap=cap)
    if mode == "sequence_tis":
        return sequence_tis(trainer_logprobs, engine_logprobs, mask, cap=cap)
    if mode == "token_mask":
        return token_mask_is(trainer_logprobs, engine_logprobs, mask, low=low, high=high)
    if mode == "sequence_mask":
        return sequence_mask_is(trainer_logprobs, engine_logprobs, mask, low=low, high=high)
    raise ValueError(
        f"unknown off-policy correction {mode!r}: expected none, token_tis, sequence_tis, token_mask or sequence_mask"
    )


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
