"""Per-token returns on hand-computed float64 cases: REINFORCE++'s token-level advantages (the KL penalty to go on
each token, discounted, then normalised over the batch's tokens) and GAE's bootstrap of truncated completions."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from sharpen.trainer.algorithms.estimators import (
    compute_discounted_returns,
    compute_gae,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_token_advantages,
)

NAN = float("nan")
EPS = 1e-6


def _t(rows: list) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _mask(rows: list) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# --- REINFORCE++ token-level advantages ---------------------------------------------------------------------------


def test_reinforce_pp_kl_to_go_is_discounted_per_token_and_whitened_over_tokens():
    # one group [1, 0]; KL penalties -kl_coef * KL_k: [-0.1, -0.2, -0.3] and [-0.4, 0.0]; gamma 0.5.
    # rew = [-0.1, -0.2, -0.3 + 1] and [-0.4, 0 + 0]
    #   G row 0: G2 = 0.7, G1 = -0.2 + 0.5 * 0.7 = 0.15, G0 = -0.1 + 0.5 * 0.15 = -0.025
    #   G row 1: G1 = 0.0, G0 = -0.4
    # tokens [-0.025, 0.15, 0.7, -0.4, 0.0]: mean 0.085, squared deviations sum to 0.637, unbiased std sqrt(0.637/4)
    advantages = compute_reinforce_pp_token_advantages(
        _t([[1.0, 0.0]]),
        _t([[[-0.1, -0.2, -0.3], [-0.4, 0.0, 9.0]]]),  # 9.0 is padding: masked, ignored
        _mask([[[1, 1, 1], [1, 1, 0]]]),
        gamma=0.5,
        std="unbiased",
    )
    std = math.sqrt(0.637 / 4)
    expected = _t([[[-0.11, 0.065, 0.615], [-0.485, -0.085, 0.0]]])
    expected[0, :, :] /= std + EPS
    expected[0, 1, 2] = 0.0
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)


def test_reinforce_pp_baseline_centres_the_score_in_its_group_and_keeps_the_kl_per_token():
    # groups [1, 0] (centred [0.5, -0.5]) and [2, 2] (flat: centred [0, 0]); gamma 1, population std.
    #   g0 r0: rew [-0.1, -0.1 + 0.5]  -> G [0.3, 0.4]        g0 r1: rew [-0.2 - 0.5] -> G [-0.7]
    #   g1 r0: rew [0.0, -0.3 + 0]     -> G [-0.3, -0.3]      g1 r1: rew [-0.1 + 0]   -> G [-0.1]
    # the flat group still gets its KL's signal (a sequence-level baseline form would give it exactly 0)
    advantages = compute_reinforce_pp_token_advantages(
        _t([[1.0, 0.0], [2.0, 2.0]]),
        _t([[[-0.1, -0.1], [-0.2, 0.0]], [[0.0, -0.3], [-0.1, 0.0]]]),
        _mask([[[1, 1], [1, 0]], [[1, 1], [1, 0]]]),
        baseline=True,
        std="population",
    )
    returns = [0.3, 0.4, -0.7, -0.3, -0.3, -0.1]
    mean, std = statistics.fmean(returns), statistics.pstdev(returns)
    a = [(g - mean) / (std + EPS) for g in returns]
    expected = _t([[[a[0], a[1]], [a[2], 0.0]], [[a[3], a[4]], [a[5], 0.0]]])
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)


def test_reinforce_pp_without_kl_puts_the_score_on_every_token_weighted_by_length():
    # scores [1, 0], lengths 3 and 1, no KL, gamma 1: G = [1, 1, 1] and [0]; over the 4 tokens: mean 0.75,
    # population std sqrt((3 * 0.25^2 + 0.75^2) / 4) = sqrt(0.1875). Over sequences it would be +-1.
    advantages = compute_reinforce_pp_token_advantages(
        _t([[1.0, 0.0]]), torch.zeros(1, 2, 3, dtype=torch.float64), _mask([[[1, 1, 1], [1, 0, 0]]]), std="population"
    )
    std = math.sqrt(0.1875)
    up, down = 0.25 / (std + EPS), -0.75 / (std + EPS)
    torch.testing.assert_close(advantages, _t([[[up, up, up], [down, 0.0, 0.0]]]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_without_kl_and_equal_lengths_equals_the_sequence_form(baseline):
    # every token holds its sequence's value and every sequence weighs the same: the population statistics over
    # tokens are those over sequences
    scores = _t([[1.0, 0.0, 0.5], [3.0, NAN, 1.0]])
    advantages = compute_reinforce_pp_token_advantages(
        scores,
        torch.zeros(2, 3, 4, dtype=torch.float64),
        torch.ones(2, 3, 4, dtype=torch.bool),
        baseline=baseline,
        std="population",
    )
    centred = scores - torch.nanmean(scores, dim=1, keepdim=True) if baseline else scores
    sequence = compute_reinforce_pp_advantages(centred, std="population")  # [groups, n]
    torch.testing.assert_close(advantages, sequence.unsqueeze(-1).expand(2, 3, 4), rtol=0, atol=1e-12, equal_nan=True)


def test_reinforce_pp_abstained_samples_are_nan_and_left_out_of_the_statistics():
    rewards = _t([[[-0.1, -0.2, -0.3], [100.0, 100.0, 100.0], [-0.4, 0.0, 0.0]]])
    mask = _mask([[[1, 1, 1], [1, 1, 1], [1, 1, 0]]])
    advantages = compute_reinforce_pp_token_advantages(_t([[1.0, NAN, 0.0]]), rewards, mask, gamma=0.5)
    without = compute_reinforce_pp_token_advantages(_t([[1.0, 0.0]]), rewards[:, [0, 2]], mask[:, [0, 2]], gamma=0.5)
    assert torch.isnan(advantages[0, 1]).all()
    torch.testing.assert_close(advantages[:, [0, 2]], without, rtol=0, atol=1e-15)


def test_reinforce_pp_batch_without_spread_is_exactly_zero_and_empty_inputs_work():
    flat = compute_reinforce_pp_token_advantages(
        _t([[0.7, 0.7]]), torch.zeros(1, 2, 2, dtype=torch.float64), torch.ones(1, 2, 2, dtype=torch.bool)
    )
    assert flat.tolist() == [[[0.0, 0.0], [0.0, 0.0]]]
    empty = compute_reinforce_pp_token_advantages(
        _t([[1.0, NAN]]), torch.zeros(1, 2, 0, dtype=torch.float64), torch.zeros(1, 2, 0, dtype=torch.bool)
    )
    assert empty.shape == (1, 2, 0)
    with pytest.raises(ValueError, match="gamma"):
        compute_reinforce_pp_token_advantages(_t([[1.0]]), torch.zeros(1, 1, 1), torch.ones(1, 1, 1), gamma=1.5)


def test_discounted_returns_count_trained_tokens_only():
    # the masked middle token is neither a step nor a reward: G0 = 1 + 0.5 * 2 (one discount, not two)
    returns = compute_discounted_returns(_t([[1.0, 5.0, 2.0]]), _mask([[1, 0, 1]]), gamma=0.5)
    assert returns.tolist() == [[2.0, 0.0, 2.0]]


# --- GAE: bootstrap of truncated completions -----------------------------------------------------------------------

_REWARDS = [0.2, 0.0, 1.0]
_VALUES = [0.5, 0.6, 0.7]


def test_gae_bootstraps_a_truncated_row_and_leaves_a_finished_one_terminal():
    # gamma 0.9, lam 0.95 (gamma * lam = 0.855); row 0 truncated with V(s_T) = 0.8, row 1 finished (bootstrap 0):
    #   row 0, t=2: delta = 1 + 0.9 * 0.8 - 0.7 = 1.02                A = 1.02
    #          t=1: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03                A = 0.03 + 0.855 * 1.02 = 0.9021
    #          t=0: delta = 0.2 + 0.9 * 0.6 - 0.5 = 0.24              A = 0.24 + 0.855 * 0.9021 = 1.0112955
    #   row 1: the terminal case, [0.4849575, 0.2865, 0.3]
    advantages, returns = compute_gae(
        _t([_REWARDS, _REWARDS]),
        _t([_VALUES, _VALUES]),
        torch.ones(2, 3, dtype=torch.bool),
        gamma=0.9,
        lam=0.95,
        bootstrap_values=_t([0.8, 0.0]),
    )
    torch.testing.assert_close(
        advantages, _t([[1.0112955, 0.9021, 1.02], [0.4849575, 0.2865, 0.3]]), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(returns, _t([[1.5112955, 1.5021, 1.72], [0.9849575, 0.8865, 1.0]]), rtol=0, atol=1e-12)


def test_gae_bootstrap_enters_after_the_last_valid_token_of_a_padded_row():
    # gamma = lam = 1: A_t = (rewards to go) + V(s_T) - V_t = [1.5 + 0.8 - 0.5, 1 + 0.8 - 0.6, 1 + 0.8 - 0.7]
    advantages, returns = compute_gae(
        _t([[0.5, 0.0, 1.0, 7.0]]),
        _t([[*_VALUES, NAN]]),
        _mask([[1, 1, 1, 0]]),
        gamma=1.0,
        lam=1.0,
        bootstrap_values=_t([0.8]),
    )
    torch.testing.assert_close(advantages, _t([[1.8, 1.2, 1.1, 0.0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(returns, _t([[2.3, 1.8, 1.8, 0.0]]), rtol=0, atol=1e-12)


def test_gae_rejects_a_bootstrap_of_the_wrong_shape():
    with pytest.raises(ValueError, match="bootstrap_values"):
        compute_gae(
            torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), gamma=1.0, lam=1.0, bootstrap_values=torch.zeros(3)
        )
