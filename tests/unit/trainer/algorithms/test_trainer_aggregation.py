"""Loss aggregation: each mode by hand, the step normaliser, and the property the split exists for: summed over
any micro-batch split (unequal lengths, per-micro-batch padding), the loss and its gradient equal one big batch's."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sharpen.trainer.algorithms.aggregation import (
    AGGREGATION_MODES,
    AggregationMode,
    aggregate_loss,
    aggregation_normalizer,
)

MAX_LEN = 16.0  # C of seq_mean_token_sum_norm: the generation limit


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: AggregationMode, normalizer: float) -> torch.Tensor:
    return aggregate_loss(per_token, mask, mode, normalizer=normalizer, constant_length=MAX_LEN)


# --- by hand -----------------------------------------------------------------------------------------------------

# rows: losses [1, 2, 3] (L=3), [4] (L=1), an empty completion (L=0); padding holds 100 and must never count
_LOSSES = torch.tensor([[1.0, 2.0, 3.0, 100.0], [100.0, 4.0, 100.0, 100.0], [100.0] * 4], dtype=torch.float64)
_MASK = torch.tensor([[1, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    ("mode", "normalizer", "loss"),
    [
        ("token_mean", 4.0, (1 + 2 + 3 + 4) / 4),
        ("seq_mean_token_sum", 2.0, (6 + 4) / 2),  # the empty row is not a sequence
        ("seq_mean_token_mean", 2.0, (6 / 3 + 4 / 1) / 2),
        ("seq_mean_token_sum_norm", 2.0, (6 / MAX_LEN + 4 / MAX_LEN) / 2),
    ],
)
def test_each_mode_by_hand(mode: AggregationMode, normalizer: float, loss: float):
    assert aggregation_normalizer(mode, _MASK) == normalizer
    assert _aggregate(_LOSSES, _MASK, mode, normalizer).item() == pytest.approx(loss, abs=1e-12)


@pytest.mark.parametrize(
    ("mode", "token_weights"),
    [
        ("token_mean", [1 / 4, 1 / 4]),  # a token of row 0 and the token of row 1 weigh the same
        ("seq_mean_token_sum", [1 / 2, 1 / 2]),
        ("seq_mean_token_mean", [1 / (3 * 2), 1 / (1 * 2)]),  # 1 / (L_i N_seq): the short row's token weighs more
        ("seq_mean_token_sum_norm", [1 / (MAX_LEN * 2), 1 / (MAX_LEN * 2)]),
    ],
)
def test_each_mode_gradient_by_hand(mode: AggregationMode, token_weights: list[float]):
    losses = _LOSSES.clone().requires_grad_(True)
    _aggregate(losses, _MASK, mode, aggregation_normalizer(mode, _MASK)).backward()
    row0, row1 = token_weights
    expected = torch.tensor([[row0, row0, row0, 0], [0, row1, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(losses.grad, expected, rtol=0, atol=1e-15)


def test_normalizer_counts_the_whole_batch_and_never_returns_zero():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])  # 0/1 ints work as well as bools
    assert aggregation_normalizer("token_mean", mask) == 5.0
    for mode in ("seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        assert aggregation_normalizer(mode, mask) == 2.0
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert all(aggregation_normalizer(mode, empty) == 1.0 for mode in AGGREGATION_MODES)
    assert aggregation_normalizer("token_mean", mask, constant=64) == 64.0


def test_rows_without_tokens_and_nan_padding_give_finite_loss_and_gradient():
    losses = torch.full((2, 3), float("nan"), dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for mode in AGGREGATION_MODES:
        loss = _aggregate(losses, mask, mode, aggregation_normalizer(mode, mask))
        assert loss.item() == 0.0
        loss.backward()
    assert losses.grad is not None and torch.equal(losses.grad, torch.zeros(2, 3, dtype=torch.float64))


def test_bfloat16_losses_are_reduced_in_float32():
    # 301 losses of 1: exactly 301 in float32; bfloat16 cannot hold 301 (spacing 2 above 256) and would give 300
    losses = torch.ones(1, 301, dtype=torch.bfloat16, requires_grad=True)
    loss = aggregate_loss(losses, torch.ones(1, 301, dtype=torch.bool), "seq_mean_token_sum", normalizer=1.0)
    assert loss.dtype == torch.float32 and loss.item() == 301.0
    loss.backward()
    assert losses.grad is not None and losses.grad.dtype == torch.bfloat16


def test_invalid_arguments_raise():
    mask = torch.ones(1, 2, dtype=torch.bool)
    losses = torch.ones(1, 2)
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        aggregation_normalizer("mean", mask)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        aggregate_loss(losses, mask, "sum", normalizer=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        aggregation_normalizer("token_mean", mask, constant=0.0)
    with pytest.raises(ValueError, match="normalizer must be positive"):
        aggregate_loss(losses, mask, "token_mean", normalizer=0.0)
    with pytest.raises(ValueError, match="constant_length"):
        aggregate_loss(losses, mask, "seq_mean_token_sum_norm", normalizer=1.0)


# --- micro-batch invariance ----------------------------------------------------------------------------------------


def _step_mask(spans: list[tuple[int, int]], width: int) -> torch.Tensor:
    """Right-padded loss mask: row i has loss tokens at [start, start + length) (the prompt comes first)."""
    mask = torch.zeros(len(spans), width, dtype=torch.bool)
    for row, (start, length) in enumerate(spans):
        mask[row, start : start + length] = True
    return mask


def _per_token_loss(logprobs: torch.Tensor) -> torch.Tensor:
    return torch.exp(logprobs) * 0.7 - logprobs.square()  # any non-linear function of the leaf


def _micro_batch_sum(
    logprobs: torch.Tensor, mask: torch.Tensor, bounds: list[int], mode: AggregationMode, normalizer: float
) -> torch.Tensor:
    """Sum of aggregate_loss over row ranges [bounds[j], bounds[j + 1]), each padded to its own width: cut to its
    last loss token, then one extra NaN column (padding the loss must never see)."""
    total = torch.zeros((), dtype=logprobs.dtype)
    for begin, end in itertools.pairwise(bounds):
        rows = mask[begin:end]
        width = int(rows.nonzero()[:, 1].max().item()) + 1 if rows.any() else 1
        nan_pad = torch.full((end - begin, 1), float("nan"), dtype=logprobs.dtype)
        per_token = torch.cat([_per_token_loss(logprobs[begin:end, :width]), nan_pad], dim=1)
        micro_mask = torch.cat([rows[:, :width], torch.zeros(end - begin, 1, dtype=torch.bool)], dim=1)
        total = total + aggregate_loss(per_token, micro_mask, mode, normalizer=normalizer, constant_length=MAX_LEN)
    return total


def _assert_split_invariant(spans: list[tuple[int, int]], splits: list[list[int]], mode: AggregationMode, seed: int):
    width = max(start + length for start, length in spans) + 2
    mask = _step_mask(spans, width)
    normalizer = aggregation_normalizer(mode, mask)  # once, over the whole step
    generator = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(len(spans), width, generator=generator, dtype=torch.float64) * 3).requires_grad_(True)

    whole = _micro_batch_sum(logprobs, mask, [0, len(spans)], mode, normalizer)
    (whole_grad,) = torch.autograd.grad(whole, logprobs)
    assert torch.isfinite(whole) and torch.isfinite(whole_grad).all()
    for bounds in splits:
        split = _micro_batch_sum(logprobs, mask, bounds, mode, normalizer)
        (split_grad,) = torch.autograd.grad(split, logprobs)
        torch.testing.assert_close(split, whole, rtol=0, atol=1e-12)
        torch.testing.assert_close(split_grad, whole_grad, rtol=0, atol=1e-12)


# unequal lengths, varying prompt offsets, one empty completion; 1, 2 and 3 micro-batches of unequal sizes
_SPANS = [(2, 5), (1, 1), (4, 9), (3, 0), (0, 2), (5, 7), (1, 3)]
_SPLITS = [[0, 7], [0, 3, 7], [0, 5, 7], [0, 1, 4, 7], [0, 2, 3, 7]]


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batch_split_gives_the_single_batch_loss_and_gradient(mode: AggregationMode):
    _assert_split_invariant(_SPANS, _SPLITS, mode, seed=0)


def test_a_micro_batch_local_normalizer_would_break_the_invariance():
    """The control for the test above: normalising each micro-batch by its own token count (what a per-micro-batch
    masked mean does) changes the gradient, so the invariance really comes from the global normaliser."""
    mask = _step_mask(_SPANS, 16)
    logprobs = torch.zeros(len(_SPANS), 16, dtype=torch.float64, requires_grad=True)
    (whole,) = torch.autograd.grad(_micro_batch_sum(logprobs, mask, [0, 7], "token_mean", 27.0), logprobs)
    local = sum(
        aggregate_loss(_per_token_loss(logprobs[a:b]), mask[a:b], "token_mean", normalizer=float(mask[a:b].sum()) * 2)
        for a, b in [(0, 3), (3, 7)]
    )
    assert isinstance(local, torch.Tensor)
    (local_grad,) = torch.autograd.grad(local, logprobs)
    assert not torch.allclose(local_grad, whole)


@settings(max_examples=25, deadline=None)
@given(
    spans=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 8)), min_size=1, max_size=8),
    cuts=st.lists(st.integers(1, 7), max_size=3),
    mode=st.sampled_from(AGGREGATION_MODES),
    seed=st.integers(0, 2**16),
)
def test_property_any_split_is_invariant(spans, cuts, mode, seed):
    bounds = sorted({0, len(spans), *(c for c in cuts if c < len(spans))})
    _assert_split_invariant(spans, [bounds], mode, seed)
