"""Algorithm functions on hand-computed cases: GRPO advantages, the PPO-clip loss, engine/trainer mismatch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sharpen.trainer.algorithms import compute_grpo_advantages
from sharpen.trainer.algorithms.aggregation import aggregate_loss
from sharpen.trainer.algorithms.policy_losses import ppo_clip_per_token

NAN = float("nan")
EPS = 1e-6


def _scores(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# --- GRPO advantages ---------------------------------------------------------------------------------------------


def test_grpo_two_right_two_wrong_is_plus_minus_one_over_std():
    # mean 0.5, centred +-0.5, population std 0.5
    advantages = compute_grpo_advantages(_scores([[1, 0, 0, 1]]), eps=EPS, std="population")
    expected = torch.tensor([[1, -1, -1, 1]], dtype=torch.float64) * 0.5 / (0.5 + EPS)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)


def test_grpo_groups_are_normalised_independently():
    # row 0: mean 2, centred [1, -1, 0], std sqrt(2/3); row 1: mean 1, centred [-1, 2, -1], std sqrt(2)
    advantages = compute_grpo_advantages(_scores([[3, 1, 2], [0, 3, 0]]), eps=EPS, std="population")
    expected = torch.tensor(
        [
            [1 / (math.sqrt(2 / 3) + EPS), -1 / (math.sqrt(2 / 3) + EPS), 0.0],
            [-1 / (math.sqrt(2) + EPS), 2 / (math.sqrt(2) + EPS), -1 / (math.sqrt(2) + EPS)],
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)


def test_grpo_without_std_normalisation_only_centres():
    advantages = compute_grpo_advantages(_scores([[3, 1, 2, 6]]), normalize_std=False, std="population")
    assert advantages.tolist() == [[0.0, -2.0, -1.0, 3.0]]


def test_grpo_abstained_entries_stay_nan_and_are_left_out_of_mean_and_std():
    # valid scores [1, 0] (the NaNs must not count as zeros): mean 0.5, std 0.5
    advantages = compute_grpo_advantages(_scores([[1, NAN, 0, NAN]]), eps=EPS, std="population")
    assert math.isnan(advantages[0, 1]) and math.isnan(advantages[0, 3])
    assert advantages[0, 0].item() == pytest.approx(0.5 / (0.5 + EPS), abs=1e-12)
    assert advantages[0, 2].item() == pytest.approx(-0.5 / (0.5 + EPS), abs=1e-12)
    centred = compute_grpo_advantages(_scores([[4, NAN, 2]]), normalize_std=False, std="population")
    assert centred[0, 0].item() == 1.0 and centred[0, 2].item() == -1.0


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize(
    "row",
    [
        [1.0, NAN, NAN, NAN],  # a group of one valid score
        [0.7, 0.7, 0.7, NAN],  # all equal (0.7 * 3 has a rounding error in its mean)
        [0.1, 0.1, 0.1, 0.1],
        [5.0, 5.0, 5.0, 5.0],
    ],
)
def test_grpo_groups_without_signal_get_exactly_zero(row, normalize_std):
    advantages = compute_grpo_advantages(_scores([row]), normalize_std=normalize_std)[0]
    for score, advantage in zip(row, advantages.tolist(), strict=True):
        if math.isnan(score):
            assert math.isnan(advantage)
        else:
            assert advantage == 0.0


def test_grpo_all_abstained_group_is_all_nan_and_does_not_disturb_others():
    advantages = compute_grpo_advantages(_scores([[NAN, NAN], [1, 0]]), normalize_std=False, std="population")
    assert torch.isnan(advantages[0]).all()
    assert advantages[1].tolist() == [0.5, -0.5]


_score = st.one_of(st.none(), st.floats(min_value=-10, max_value=10, allow_nan=False))


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.lists(_score, min_size=4, max_size=4), min_size=1, max_size=5),
    normalize_std=st.booleans(),
)
def test_grpo_property_valid_advantages_are_finite_and_sum_to_zero_per_group(groups, normalize_std):
    scores = _scores([[NAN if s is None else s for s in group] for group in groups])
    advantages = compute_grpo_advantages(scores, normalize_std=normalize_std, std="population")
    valid = ~torch.isnan(scores)
    assert torch.equal(torch.isnan(advantages), ~valid)  # NaN exactly where the reward abstained
    for row in range(len(groups)):
        values = advantages[row][valid[row]]
        assert torch.isfinite(values).all()
        assert abs(values.sum().item()) < 1e-6 * max(1.0, values.abs().sum().item())
        if normalize_std and len(values) > 0:
            # population std of the advantages is std / (std + eps): 1 up to eps, or 0 for a flat group
            valid_scores = scores[row][valid[row]]
            std = valid_scores.std(correction=0).item()
            expected = 0.0 if values.max() == values.min() else std / (std + EPS)
            # each centred score x - mean carries a rounding error of a few ulps of the scores' magnitude, which the
            # division by std + eps scales up: with near-equal scores (std ~1e-15) that, not rel, is the bound
            rounding = 8 * torch.finfo(scores.dtype).eps * max(1.0, valid_scores.abs().max().item()) / (std + EPS)
            assert values.std(correction=0).item() == pytest.approx(expected, rel=1e-6, abs=rounding)


# --- PPO-clip loss -----------------------------------------------------------------------------------------------


def compute_ppo_clip_loss(logprobs, old_logprobs, advantages, mask, *, clip_eps_low, clip_eps_high, normalizer):
    """PPO-clip per token, aggregated as the trainer does for token_mean: the sum over the mask / normalizer."""
    per_token, metrics = ppo_clip_per_token(
        logprobs, old_logprobs, advantages, mask, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high
    )
    return SimpleNamespace(
        loss=aggregate_loss(per_token, mask, "token_mean", normalizer=normalizer),
        num_clipped=metrics.num_clipped_low + metrics.num_clipped_high,
        ratio_sum=metrics.ratio_sum,
    )


def _leaf(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float64, requires_grad=True)


def test_ppo_clip_hand_computed_loss_clip_count_and_gradient():
    # ratios r = [1.5, 0.5, 1.1] (old logprobs 0), advantages [+2, -1, +1], eps 0.2:
    #   token 0: min(3.0, 1.2 * 2 = 2.4) -> 2.4, clipped (no gradient)
    #   token 1: min(-0.5, 0.8 * -1 = -0.8) -> -0.8, clipped (no gradient)
    #   token 2: min(1.1, 1.1) -> 1.1, unclipped: d(-r A)/d logprob = -r A = -1.1
    logprobs = _leaf([math.log(1.5), math.log(0.5), math.log(1.1)])
    out = compute_ppo_clip_loss(
        logprobs,
        torch.zeros(1, 3, dtype=torch.float64),
        torch.tensor([[2.0, -1.0, 1.0]], dtype=torch.float64),
        torch.ones(1, 3, dtype=torch.bool),
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        normalizer=3.0,
    )
    assert out.loss.item() == pytest.approx((-2.4 + 0.8 - 1.1) / 3, abs=1e-12)
    assert out.num_clipped.item() == 2
    assert out.ratio_sum.item() == pytest.approx(1.5 + 0.5 + 1.1, abs=1e-12)
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -1.1 / 3]], dtype=torch.float64))


def test_ppo_clip_pessimistic_side_keeps_the_gradient():
    # A > 0 with r below 1 - eps and A < 0 with r above 1 + eps: the unclipped term is the smaller one, so the
    # gradient flows (PPO only removes the incentive to move further, never the penalty).
    logprobs = _leaf([math.log(0.5), math.log(1.5), 0.0])
    out = compute_ppo_clip_loss(
        logprobs,
        torch.zeros(1, 3, dtype=torch.float64),
        torch.tensor([[1.0, -1.0, 0.0]], dtype=torch.float64),
        torch.ones(1, 3, dtype=torch.bool),
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        normalizer=2.0,
    )
    # loss terms: -min(0.5, 0.8) = -0.5; -min(-1.5, -1.2) = 1.5; advantage 0 -> 0
    assert out.loss.item() == pytest.approx((-0.5 + 1.5) / 2, abs=1e-12)
    assert out.num_clipped.item() == 0
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5 / 2, 1.5 / 2, 0.0]], dtype=torch.float64))


def test_ppo_clip_mask_zeroes_tokens_in_loss_count_ratio_and_gradient():
    logprobs = _leaf([math.log(1.5), math.log(0.5), math.log(1.1)])
    out = compute_ppo_clip_loss(
        logprobs,
        torch.zeros(1, 3, dtype=torch.float64),
        torch.tensor([[2.0]], dtype=torch.float64),  # [batch, 1]: one advantage broadcast over the tokens
        torch.tensor([[False, True, True]]),
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        normalizer=2.0,
    )
    # A = 2 everywhere: token 1 r=0.5 -> min(1.0, 1.6) = 1.0 unclipped; token 2 r=1.1 -> 2.2 unclipped
    assert out.loss.item() == pytest.approx((-1.0 - 2.2) / 2, abs=1e-12)
    assert out.num_clipped.item() == 0  # token 0 would be clipped but is masked out
    assert out.ratio_sum.item() == pytest.approx(0.5 + 1.1, abs=1e-12)
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5 * 2 / 2, -1.1 * 2 / 2]], dtype=torch.float64))


def test_ppo_clip_higher_moves_only_the_upper_bound():
    # r = [1.25, 0.75], A = [+1, -1]. Symmetric eps 0.2 clips both; eps_high 0.28 (DAPO) frees token 0 only.
    def run(eps_high: float) -> tuple[float, torch.Tensor]:
        logprobs = _leaf([math.log(1.25), math.log(0.75)])
        out = compute_ppo_clip_loss(
            logprobs,
            torch.zeros(1, 2, dtype=torch.float64),
            torch.tensor([[1.0, -1.0]], dtype=torch.float64),
            torch.ones(1, 2, dtype=torch.bool),
            clip_eps_low=0.2,
            clip_eps_high=eps_high,
            normalizer=1.0,
        )
        out.loss.backward()
        assert logprobs.grad is not None
        return out.num_clipped.item(), logprobs.grad

    clipped, grad = run(0.2)
    assert clipped == 2
    assert grad.tolist() == [[0.0, 0.0]]
    clipped, grad = run(0.28)
    assert clipped == 1
    torch.testing.assert_close(grad, torch.tensor([[-1.25, 0.0]], dtype=torch.float64))


def test_ppo_clip_ratio_uses_old_logprobs_without_gradient():
    logprobs = _leaf([-1.0, -2.0])
    old = torch.tensor([[-1.0, -2.5]], dtype=torch.float64, requires_grad=True)
    out = compute_ppo_clip_loss(
        logprobs,
        old,
        torch.ones(1, 1, dtype=torch.float64),
        torch.ones(1, 2, dtype=torch.bool),
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        normalizer=2.0,
    )
    assert out.ratio_sum.item() == pytest.approx(1.0 + math.exp(0.5), abs=1e-12)
    out.loss.backward()
    assert old.grad is None
