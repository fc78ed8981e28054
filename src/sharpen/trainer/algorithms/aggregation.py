# pyright: strict
"""Loss aggregation: how a [batch, seq] tensor of per-token losses becomes the scalar that is differentiated.

The aggregation is split in two so that gradient accumulation over micro-batches gives exactly the gradient of
one big batch, whatever the split and however each micro-batch is padded:

* `aggregation_normalizer` runs once per optimizer step on the loss mask of the *whole* step batch (every
  rollout of the step) and returns the global denominator: the number of loss tokens for ``token_mean``, the
  number of non-empty sequences for the ``seq_mean_*`` modes.
* `aggregate_loss` runs on each micro-batch and divides its masked sum by that global denominator. Every
  per-sequence quantity it uses (a sequence's length) lives inside one row, so nothing depends on which other
  rows share the micro-batch. Summing `aggregate_loss` over the micro-batches of a step therefore equals
  `aggregate_loss` on the concatenated batch, in value and in gradient.

The modes, with l_{i,t} the per-token loss, m_{i,t} the loss mask, L_i = sum_t m_{i,t} the completion length of
sequence i, N_tok = sum_i L_i and N_seq the number of sequences with L_i > 0 (both over the whole step):

* ``token_mean``: sum_{i,t} m l / N_tok. Every token weighs the same (DAPO, Yu et al. 2025,
  "DAPO: An Open-Source LLM Reinforcement Learning System at Scale").
* ``seq_mean_token_mean``: sum_i (sum_t m l / L_i) / N_seq. Every sequence weighs the same, so tokens of long
  sequences weigh less (GRPO as written in Shao et al. 2024, "DeepSeekMath"; GSPO, Zheng et al. 2025).
* ``seq_mean_token_sum``: sum_i (sum_t m l) / N_seq. A sequence weighs its length.
* ``seq_mean_token_sum_norm``: sum_i (sum_t m l / C) / N_seq with a constant C, the generation limit
  (max completion length): the length bias of ``1 / L_i`` is removed without letting the loss scale with the
  batch's lengths (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective").

This module owns only the reduction; it does not compute per-token losses (`policy_losses`) or pick the mode
(the config does).
"""

from __future__ import annotations

from typing import get_args

import torch

from sharpen.config.policy_losses import AggregationMode

AGGREGATION_MODES: tuple[AggregationMode, ...] = get_args(AggregationMode)


def _check_mode(mode: str) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {', '.join(AGGREGATION_MODES)}")


def aggregation_normalizer(mode: AggregationMode, loss_mask: torch.Tensor, *, constant: float | None = None) -> float:
    """The global denominator of one optimizer step, computed once from the loss mask of *all* its rollouts.

    ``loss_mask``: [batch, seq] (bool or 0/1) over every rollout of the step, not one micro-batch; only the
    per-row counts matter, so any padding width works. Returns N_tok (``token_mean``) or N_seq, the number of
    rows with at least one loss token (``seq_mean_*``: an empty completion is not a sequence to average over).
    Both are at least 1, so a step without loss tokens gives a loss of 0 rather than NaN.

    ``constant``: when given, it is returned instead of the count, for a denominator that does not depend on
    the step's data at all (e.g. the configured number of rollouts per step, so a step whose rollouts were
    partly filtered out still takes proportionally smaller steps). It must be positive.
    """
    _check_mode(mode)
    if constant is not None:
        if not constant > 0:
            raise ValueError(f"constant normalizer must be positive, got {constant}")
        return float(constant)
    lengths = loss_mask.to(torch.int64).sum(dim=-1)  # [batch]
    count = int(lengths.sum().item()) if mode == "token_mean" else int((lengths > 0).sum().item())
    return float(max(count, 1))


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: AggregationMode,
    *,
    normalizer: float,
    constant_length: float | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the step loss: a scalar (at least float32); summed over micro-batches it is the
    step loss.

    ``per_token_loss`` and ``mask``: [batch, seq]. ``normalizer``: `aggregation_normalizer` of the whole step,
    with the same ``mode``. ``constant_length``: C of ``seq_mean_token_sum_norm`` (required there, ignored
    otherwise), the same value for every micro-batch of the step: the sampling limit on completion tokens.

    Masked tokens are selected out (``torch.where``), not multiplied by 0, so a NaN or inf in padding never
    reaches the loss or the gradient. A row without loss tokens contributes exactly 0 (its length is clamped to
    1 in ``seq_mean_token_mean``).
    """
    _check_mode(mode)
    if not normalizer > 0:
        raise ValueError(f"normalizer must be positive, got {normalizer}")
    valid = mask.to(torch.bool)  # [batch, seq]
    # Reduce in at least float32: bfloat16 sums drift, and its lengths stop being exact at 256.
    per_token_loss = per_token_loss.to(torch.promote_types(per_token_loss.dtype, torch.float32))
    masked = torch.where(valid, per_token_loss, torch.zeros_like(per_token_loss))  # [batch, seq]
    if mode == "token_mean":
        return masked.sum() / normalizer
    seq_sums = masked.sum(dim=-1)  # [batch]
    if mode == "seq_mean_token_mean":
        lengths = valid.sum(dim=-1).clamp(min=1).to(seq_sums.dtype)  # [batch]
        seq_sums = seq_sums / lengths
    elif mode == "seq_mean_token_sum_norm":
        if constant_length is None or not constant_length > 0:
            raise ValueError(
                f"seq_mean_token_sum_norm needs a positive constant_length (the max completion length), "
                f"got {constant_length}"
            )
        seq_sums = seq_sums / constant_length
    return seq_sums.sum() / normalizer
