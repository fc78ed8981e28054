"""Turn-level estimators on a hand-computed 3-turn group: turn-level GRPO (discounted turn returns normalised over
the group's turns) and GiGPO (episode-level plus step-level advantages over identical states); abstained samples,
edge cases, and split invariance (a group's advantages do not depend on the other groups of the step)."""

from __future__ import annotations

import math

import pytest
import torch

from sharpen.config.advantages import GiGPOAdvantage, GRPOAdvantage, TurnGRPOAdvantage
from sharpen.trainer.algorithms import compute_advantages, compute_grpo_advantages
from sharpen.trainer.algorithms.turn_estimators import (
    compute_gigpo_advantages,
    compute_turn_advantages,
    compute_turn_grpo_advantages,
    compute_turn_returns,
)

EPS = 1e-6

# One group of three guess-number games, gamma 0.5, reward 1 on the turn that finds the number:
#   e0 finds it on its 3rd turn:  rewards [0, 0, 1]  returns [0.25, 0.5, 1]
#   e1 finds it on its 2nd turn:  rewards [0, 1]     returns [0.5, 1]
#   e2 never finds it (3 turns):  rewards [0, 0, 0]  returns [0, 0, 0]
# States (the observation each turn started from): every turn 0 from the prompt (state 0); e0 and e1 then both hear
# "higher than 8" (state 1), which e2 hears on its 3rd turn; e0's 3rd turn (state 2) and e2's 2nd (state 3) are
# states no other turn started from.
REWARDS = torch.tensor([[[0.0, 0.0, 1.0], [0.0, 1.0, 9.0], [0.0, 0.0, 0.0]]], dtype=torch.float64)  # 9: not a turn
MASK = torch.tensor([[[True, True, True], [True, True, False], [True, True, True]]])
STATES = torch.tensor([[[0, 1, 2], [0, 1, -1], [0, 3, 1]]])


def test_turn_returns_are_discounted_per_turn():
    expected = torch.tensor([[[0.25, 0.5, 1.0], [0.5, 1.0, 0.0], [0.0, 0.0, 0.0]]], dtype=torch.float64)
    torch.testing.assert_close(compute_turn_returns(REWARDS, MASK, gamma=0.5), expected, rtol=0, atol=0)


def test_turn_grpo_normalises_the_returns_over_every_turn_of_the_group():
    # the group's 8 turn returns [0.25, 0.5, 1, 0.5, 1, 0, 0, 0] sum to 3.25: mean 0.40625
    # deviations [-0.15625, 0.09375, 0.59375, 0.09375, 0.59375, -0.40625, -0.40625, -0.40625]
    # squares 0.0244140625 + 2 * 0.0087890625 + 2 * 0.3525390625 + 3 * 0.1650390625 = 1.2421875; unbiased: / 7
    advantages = compute_turn_grpo_advantages(REWARDS, MASK, gamma=0.5, std="unbiased")
    std = math.sqrt(1.2421875 / 7)
    expected = torch.tensor(
        [[[-0.15625, 0.09375, 0.59375], [0.09375, 0.59375, 0.0], [-0.40625, -0.40625, -0.40625]]], dtype=torch.float64
    )
    expected = torch.where(MASK, expected / (std + EPS), expected)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)
    # the population convention divides the squares by 8
    population = compute_turn_grpo_advantages(REWARDS, MASK, gamma=0.5, std="population")
    torch.testing.assert_close(population[0, 0, 2], torch.tensor(0.59375 / (math.sqrt(1.2421875 / 8) + EPS)).double())


def test_gigpo_adds_the_step_level_advantage_of_identical_states_to_the_episodes():
    # episode returns [1, 1, 0]: mean 2/3, A^E = [1/3, 1/3, -2/3] (F_norm = 1, the paper's)
    # step groups (returns):  state 0: e0t0 0.25, e1t0 0.5, e2t0 0    mean 0.25 -> [0, 0.25, -0.25]
    #                         state 1: e0t1 0.5,  e1t1 1,   e2t2 0    mean 0.5  -> [0, 0.5, -0.5]
    #                         state 2: e0t2 alone, state 3: e2t1 alone          -> 0
    # A = A^E + A^S:  e0 [1/3 + 0, 1/3 + 0, 1/3 + 0]; e1 [1/3 + 0.25, 1/3 + 0.5]; e2 [-2/3 - 0.25, -2/3, -2/3 - 0.5]
    advantages = compute_gigpo_advantages(REWARDS, MASK, STATES, gamma=0.5, omega=1.0)
    expected = torch.tensor(
        [[[1 / 3, 1 / 3, 1 / 3], [7 / 12, 5 / 6, 0.0], [-11 / 12, -2 / 3, -7 / 6]]], dtype=torch.float64
    )
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)
    # omega weighs the step level: 0 leaves the episode's advantage on every turn (GRPO without the std)
    episode_only = compute_gigpo_advantages(REWARDS, MASK, STATES, gamma=0.5, omega=0.0)
    expected = torch.tensor([[[1 / 3] * 3, [1 / 3, 1 / 3, 0.0], [-2 / 3] * 3]], dtype=torch.float64)
    torch.testing.assert_close(episode_only, expected, rtol=0, atol=1e-12)


def test_gigpo_with_the_std_divides_both_levels_by_their_groups_std():
    # episode: deviations [1/3, 1/3, -2/3], squares 6/9, unbiased var 1/3        -> / (sqrt(1/3) + eps)
    # state 0: deviations [0, 0.25, -0.25], squares 0.125, var 0.0625, std 0.25  -> [0, 1, -1] (up to eps)
    # state 1: deviations [0, 0.5, -0.5], squares 0.5, var 0.25, std 0.5         -> [0, 1, -1] (up to eps)
    advantages = compute_gigpo_advantages(REWARDS, MASK, STATES, gamma=0.5, normalize_std=True)
    e = 1 / (math.sqrt(1 / 3) + EPS)
    s0, s1 = 0.25 / (0.25 + EPS), 0.5 / (0.5 + EPS)
    expected = torch.tensor(
        [[[e / 3, e / 3, e / 3], [e / 3 + s0, e / 3 + s1, 0.0], [-2 * e / 3 - s0, -2 * e / 3, -2 * e / 3 - s1]]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("estimator", [TurnGRPOAdvantage(gamma=0.5), GiGPOAdvantage(gamma=0.5)])
def test_a_sample_without_turns_abstains_and_is_left_out(estimator):
    # a fourth sample whose reward abstained (no turns): NaN on every turn, the others as without it
    rewards = torch.cat([REWARDS, torch.full((1, 1, 3), float("nan"), dtype=torch.float64)], dim=1)
    mask = torch.cat([MASK, torch.zeros((1, 1, 3), dtype=torch.bool)], dim=1)
    states = torch.cat([STATES, torch.full((1, 1, 3), -1)], dim=1)
    advantages = compute_turn_advantages(estimator, rewards, mask, states)
    assert torch.isnan(advantages[0, 3]).all()
    torch.testing.assert_close(advantages[:, :3], compute_turn_advantages(estimator, REWARDS, MASK, STATES))


@pytest.mark.parametrize("estimator", [TurnGRPOAdvantage(gamma=0.5), GiGPOAdvantage(gamma=0.5, normalize_std=True)])
def test_each_group_is_computed_on_its_own(estimator):
    # split invariance: a step's groups computed together equal each group computed alone, whatever the padding
    other = torch.tensor([[[2.0, 0.0, 0.0], [0.5, 0.0, 0.0], [1.0, 3.0, 0.0]]], dtype=torch.float64)
    other_mask = torch.tensor([[[True, False, False], [True, False, False], [True, True, False]]])
    other_states = torch.tensor([[[0, -1, -1], [0, -1, -1], [0, 1, -1]]])
    together = compute_turn_advantages(
        estimator, torch.cat([REWARDS, other]), torch.cat([MASK, other_mask]), torch.cat([STATES, other_states])
    )
    torch.testing.assert_close(together[:1], compute_turn_advantages(estimator, REWARDS, MASK, STATES))
    alone = compute_turn_advantages(estimator, other[:, :, :2], other_mask[:, :, :2], other_states[:, :, :2])
    torch.testing.assert_close(together[1:, :, :2], alone)
    assert (together[1:, :, 2] == 0).all()


def test_one_turn_episodes_with_gamma_1_are_grpo():
    # each sample one turn: turn-level GRPO is GRPO on the scores, GiGPO (one shared state) twice Dr.GRPO's centring
    scores = torch.tensor([[1.0, 0.0, 0.5, 0.0]], dtype=torch.float64)
    rewards, mask, states = scores.unsqueeze(-1), torch.ones((1, 4, 1), dtype=torch.bool), torch.zeros((1, 4, 1))
    turn_grpo = compute_turn_grpo_advantages(rewards, mask, gamma=1.0)
    torch.testing.assert_close(turn_grpo[..., 0], compute_advantages(GRPOAdvantage(), scores), rtol=0, atol=0)
    gigpo = compute_gigpo_advantages(rewards, mask, states.long(), gamma=1.0)
    centred = compute_grpo_advantages(scores, normalize_std=False)
    torch.testing.assert_close(gigpo[..., 0], 2 * centred, rtol=0, atol=1e-15)


def test_a_flat_group_is_exactly_zero_and_empty_inputs_work():
    rewards = torch.zeros((1, 2, 2), dtype=torch.float64)
    mask = torch.ones((1, 2, 2), dtype=torch.bool)
    states = torch.tensor([[[0, 1], [0, 1]]])
    # gamma 1: both samples' returns [0, 0]
    assert (compute_turn_grpo_advantages(rewards, mask, gamma=1.0) == 0).all()
    assert (compute_gigpo_advantages(rewards, mask, states, gamma=1.0, normalize_std=True) == 0).all()
    empty = torch.zeros((0, 0, 0), dtype=torch.float64)
    assert compute_turn_grpo_advantages(empty, empty.bool(), gamma=0.9).shape == (0, 0, 0)
    assert compute_gigpo_advantages(empty, empty.bool(), empty.long(), gamma=0.9).shape == (0, 0, 0)


def test_sequence_registry_refuses_a_turn_estimator_and_gamma_is_checked():
    with pytest.raises(ValueError, match="turn-level estimator"):
        compute_advantages(GiGPOAdvantage(), torch.zeros((1, 2), dtype=torch.float64))
    with pytest.raises(ValueError, match="gamma must be in"):
        compute_turn_returns(REWARDS, MASK, gamma=1.5)
