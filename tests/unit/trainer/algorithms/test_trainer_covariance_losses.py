"""Clip-Cov and KL-Cov (Cui et al. 2025) on hand-computed covariances, selections, values and gradients (float64),
and the split invariance that holds when the selection is computed once over the whole mini-batch."""

from __future__ import annotations

import math

import pytest
import torch

from sharpen.trainer.algorithms.aggregation import aggregate_loss, aggregation_normalizer
from sharpen.trainer.algorithms.covariance import select_clip_cov_tokens, select_kl_cov_tokens, token_covariance
from sharpen.trainer.algorithms.policy_losses import clip_cov_per_token, kl_cov_per_token, ppo_clip_per_token

F64 = torch.float64

# logprobs [-1, -2, -3, (pad)], [-2, -4, (pad), (pad)]: mean over the 5 valid tokens -2.4
# advantages per sequence +2 and -3: mean over valid tokens (3 * 2 - 2 * 3) / 5 = 0
# Cov = A_t (lp_t + 2.4): [2 * 1.4, 2 * 0.4, 2 * -0.6] = [2.8, 0.8, -1.2]; [-3 * 0.4, -3 * -1.6] = [-1.2, 4.8]
_LOGPROBS = [[-1.0, -2.0, -3.0, 0.0], [-2.0, -4.0, 0.0, 0.0]]
_ADVANTAGES = [[2.0], [-3.0]]
_MASK = [[True, True, True, False], [True, True, False, False]]
_COV = [[2.8, 0.8, -1.2, 0.0], [-1.2, 4.8, 0.0, 0.0]]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.tensor(_LOGPROBS, dtype=F64), torch.tensor(_ADVANTAGES, dtype=F64), torch.tensor(_MASK)


def test_token_covariance_hand_computed():
    torch.testing.assert_close(token_covariance(*_inputs()), torch.tensor(_COV, dtype=F64), rtol=0, atol=1e-12)


def test_clip_cov_draws_among_tokens_with_covariance_inside_the_bounds():
    # candidates with 1 < Cov < 5: (0, 0) 2.8 and (1, 1) 4.8; fraction 0.5 of 5 tokens -> 2, both drawn
    selected = select_clip_cov_tokens(*_inputs(), fraction=0.5, cov_low=1.0, cov_high=5.0)
    assert selected.tolist() == [[True, False, False, False], [False, True, False, False]]
    # fraction 0.1 -> max(1, 0) = 1 token, one of the two candidates, reproducible with the same generator seed
    draws = [
        select_clip_cov_tokens(
            *_inputs(), fraction=0.1, cov_low=1.0, cov_high=5.0, generator=torch.Generator().manual_seed(s)
        )
        for s in range(8)
    ]
    assert all(
        int(d.sum()) == 1 and bool((d & ~torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0]]).bool()).sum() == 0) for d in draws
    )
    assert len({tuple(d.flatten().tolist()) for d in draws}) == 2  # both candidates do get drawn
    again = select_clip_cov_tokens(
        *_inputs(), fraction=0.1, cov_low=1.0, cov_high=5.0, generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(again, draws[3])
    with pytest.raises(ValueError, match="Clip-Cov"):
        select_clip_cov_tokens(*_inputs(), fraction=0.0, cov_low=1.0, cov_high=5.0)


def test_kl_cov_selects_the_largest_covariances():
    # top max(1, floor(0.4 * 5)) = 2 covariances: 4.8 at (1, 1) and 2.8 at (0, 0)
    selected = select_kl_cov_tokens(*_inputs(), fraction=0.4)
    assert selected.tolist() == [[True, False, False, False], [False, True, False, False]]
    assert select_kl_cov_tokens(*_inputs(), fraction=1e-4).tolist() == [[False] * 4, [False, True, False, False]]


def test_clip_cov_detaches_the_selected_tokens_gradient_and_keeps_the_value():
    logprobs = torch.tensor([[math.log(1.1), math.log(0.9)]], dtype=F64, requires_grad=True)
    args = (logprobs, torch.zeros(1, 2, dtype=F64), torch.tensor([[1.0]], dtype=F64), torch.ones(1, 2).bool())
    selected = torch.tensor([[True, False]])
    per_token, _ = clip_cov_per_token(*args, selected=selected, clip_eps_low=0.2, clip_eps_high=0.2)
    ppo, _ = ppo_clip_per_token(*args, clip_eps_low=0.2, clip_eps_high=0.2)
    torch.testing.assert_close(per_token, ppo)  # values: -1.1, -0.9
    (grad,) = torch.autograd.grad(per_token.sum(), logprobs)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.9]], dtype=F64))


def test_kl_cov_adds_coef_abs_log_ratio_on_the_selected_tokens_only():
    # r = [e^0.3, e^-0.2], A = -1, coef 1, token 0 selected:
    # loss = [-r0 A + |0.3|, -r1 A] = [e^0.3 + 0.3, e^-0.2]; grad = [r0 |A| + sign(0.3), r1 |A|]
    logprobs = torch.tensor([[0.3, -0.2]], dtype=F64, requires_grad=True)
    per_token, _ = kl_cov_per_token(
        logprobs,
        torch.zeros(1, 2, dtype=F64),
        torch.tensor([[-1.0]], dtype=F64),
        torch.ones(1, 2).bool(),
        selected=torch.tensor([[True, False]]),
        coef=1.0,
    )
    torch.testing.assert_close(per_token, torch.tensor([[math.exp(0.3) + 0.3, math.exp(-0.2)]], dtype=F64))
    (grad,) = torch.autograd.grad(per_token.sum(), logprobs)
    torch.testing.assert_close(grad, torch.tensor([[math.exp(0.3) + 1.0, math.exp(-0.2)]], dtype=F64))


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_split_invariant_when_selected_over_the_whole_mini_batch(name: str):
    """With the selection (and the covariance means) computed once over the whole mini-batch and sliced per
    micro-batch, the summed micro-batch gradients equal the whole batch's; selecting per micro-batch would not."""
    generator = torch.Generator().manual_seed(5)
    lengths = [6, 3, 8, 2, 5, 7]
    width = max(lengths)
    logprobs = (-torch.rand(6, width, generator=generator, dtype=F64) * 3).requires_grad_(True)
    old = logprobs.detach() + torch.randn(6, width, generator=generator, dtype=F64) * 0.3
    advantages = torch.randn(6, 1, generator=generator, dtype=F64) * 2
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    normalizer = aggregation_normalizer("token_mean", mask)

    def select(rows: slice) -> torch.Tensor:
        if name == "clip_cov":
            return select_clip_cov_tokens(
                old[rows],
                advantages[rows],
                mask[rows],
                fraction=0.3,
                cov_low=0.2,
                cov_high=5.0,
                generator=torch.Generator().manual_seed(0),
            )
        return select_kl_cov_tokens(old[rows], advantages[rows], mask[rows], fraction=0.3)

    def loss_of(rows: slice, selected: torch.Tensor) -> torch.Tensor:
        args = (logprobs[rows], old[rows], advantages[rows], mask[rows])
        if name == "clip_cov":
            per_token, _ = clip_cov_per_token(*args, selected=selected, clip_eps_low=0.2, clip_eps_high=0.2)
        else:
            per_token, _ = kl_cov_per_token(*args, selected=selected, coef=1.0)
        return aggregate_loss(per_token, mask[rows], "token_mean", normalizer=normalizer)

    whole_selected = select(slice(0, 6))
    assert 0 < int(whole_selected.sum()) < int(mask.sum())
    (whole,) = torch.autograd.grad(loss_of(slice(0, 6), whole_selected), logprobs)
    parts = [slice(0, 2), slice(2, 3), slice(3, 6)]
    split = sum(loss_of(rows, whole_selected[rows]) for rows in parts)
    assert isinstance(split, torch.Tensor)
    (split_grad,) = torch.autograd.grad(split, logprobs)
    torch.testing.assert_close(split_grad, whole, rtol=0, atol=1e-12)
    local = sum(loss_of(rows, select(rows)) for rows in parts)
    assert isinstance(local, torch.Tensor)
    (local_grad,) = torch.autograd.grad(local, logprobs)
    assert (local_grad - whole).abs().max() > 1e-6  # per-micro-batch statistics change the gradient
