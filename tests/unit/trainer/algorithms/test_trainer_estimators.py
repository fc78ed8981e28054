"""Advantage estimators on hand-computed cases: RLOO, REINFORCE++, ReMax, Dr.GRPO, GAE and masked whitening; and
the registry `compute_advantages`, which must have a case for every section of the config's `AdvantageConfig`."""

from __future__ import annotations

import math
import typing
from collections.abc import Callable

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sharpen.config.advantages import AdvantageConfig, GAEAdvantage, GRPOAdvantage, PassKAdvantage, ReMaxAdvantage
from sharpen.trainer.algorithms.advantages import compute_grpo_advantages
from sharpen.trainer.algorithms.estimators import (
    compute_advantages,
    compute_drgrpo_advantages,
    compute_gae,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    whiten,
)

NAN = float("nan")
EPS = 1e-6


def _t(rows: list[list[float]] | list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _assert_nan_exactly_where_abstained(scores: torch.Tensor, advantages: torch.Tensor) -> None:
    assert advantages.shape == scores.shape
    valid = ~torch.isnan(scores)
    assert torch.equal(torch.isnan(advantages), ~valid)
    assert torch.isfinite(advantages[valid]).all()


_score = st.one_of(st.none(), st.floats(min_value=-10, max_value=10, allow_nan=False))
_groups = st.lists(st.lists(_score, min_size=4, max_size=4), min_size=1, max_size=5)


def _from_groups(groups: list[list[float | None]]) -> torch.Tensor:
    return _t([[NAN if s is None else s for s in group] for group in groups])


# --- RLOO --------------------------------------------------------------------------------------------------------


def test_rloo_two_right_two_wrong():
    # baseline of a 1 is mean(0, 0, 1) = 1/3 -> 2/3; baseline of a 0 is mean(1, 0, 1) = 2/3 -> -2/3
    advantages = compute_rloo_advantages(_t([[1, 0, 0, 1]]))
    torch.testing.assert_close(advantages, _t([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]), rtol=0, atol=1e-12)


def test_rloo_groups_use_their_own_baselines():
    # row 0: 3 - mean(1, 2) = 1.5, 1 - mean(3, 2) = -1.5, 2 - mean(3, 1) = 0
    # row 1: 5 - 1 = 4, 1 - 5 = -4 (a group of two: each sample's baseline is the other one)
    advantages = compute_rloo_advantages(_t([[3, 1, 2], [5, 1, NAN]]))
    assert advantages[0].tolist() == [1.5, -1.5, 0.0]
    assert advantages[1, :2].tolist() == [4.0, -4.0] and math.isnan(advantages[1, 2])


def test_rloo_abstained_entries_stay_nan_and_are_left_out_of_the_baseline():
    # valid [4, 2, 0]: 4 - mean(2, 0) = 3, 2 - mean(4, 0) = 0, 0 - mean(4, 2) = -3 (NaN must not count as 0)
    advantages = compute_rloo_advantages(_t([[4, NAN, 2, 0]]))
    assert math.isnan(advantages[0, 1])
    assert [advantages[0, i].item() for i in (0, 2, 3)] == [3.0, 0.0, -3.0]


@settings(max_examples=60, deadline=None)
@given(groups=_groups)
def test_rloo_property_valid_advantages_are_finite_and_sum_to_zero_per_group(groups):
    scores = _from_groups(groups)
    advantages = compute_rloo_advantages(scores)
    _assert_nan_exactly_where_abstained(scores, advantages)
    valid = ~torch.isnan(scores)
    for row in range(len(groups)):
        values = advantages[row][valid[row]]
        assert abs(values.sum().item()) < 1e-9 * max(1.0, values.abs().sum().item())


@settings(max_examples=60, deadline=None)
@given(groups=_groups, new_score=st.floats(min_value=-10, max_value=10, allow_nan=False))
def test_rloo_property_a_samples_baseline_does_not_depend_on_its_own_score(groups, new_score):
    scores = _from_groups(groups)
    valid = ~torch.isnan(scores)
    assume(bool(valid[0, 0]) and valid[0].sum() >= 2)  # the changed sample and at least one other are valid
    changed = scores.clone()
    changed[0, 0] = new_score
    baseline = scores[0, 0] - compute_rloo_advantages(scores)[0, 0]
    baseline_changed = changed[0, 0] - compute_rloo_advantages(changed)[0, 0]
    assert baseline_changed.item() == pytest.approx(baseline.item(), abs=1e-9)


# --- REINFORCE++ -------------------------------------------------------------------------------------------------


def test_reinforce_pp_normalises_over_the_batch_without_a_group_baseline():
    # valid [1, 0, 0, 0]: batch mean 0.25, centred [0.75, -0.25, -0.25, -0.25], population var 0.75 / 4 = 0.1875.
    # The all-zero group gets -0.25 / std, not 0 as under GRPO: there is no group baseline.
    std = math.sqrt(0.1875)
    advantages = compute_reinforce_pp_advantages(_t([[1, 0], [0, 0]]), eps=EPS, std="population")
    expected = _t([[0.75, -0.25], [-0.25, -0.25]]) / (std + EPS)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)


def test_reinforce_pp_abstained_entries_are_left_out_of_the_batch_statistics():
    # valid [2, 0, 4]: mean 2, centred [0, -2, 2], population std sqrt(8/3)
    std = math.sqrt(8 / 3)
    advantages = compute_reinforce_pp_advantages(_t([[2, NAN], [0, 4]]), eps=EPS, std="population")
    assert math.isnan(advantages[0, 1])
    assert advantages[0, 0].item() == 0.0
    assert advantages[1].tolist() == pytest.approx([-2 / (std + EPS), 2 / (std + EPS)], abs=1e-12)


def test_reinforce_pp_baseline_centres_per_group_then_scales_by_the_batch_std():
    # group-centred [[0.5, -0.5], [2, -2]], batch mean 0, population std sqrt((0.25 * 2 + 4 * 2) / 4) = sqrt(2.125).
    # GRPO would give +-1 to both groups; one batch std keeps the second group's larger spread.
    std = math.sqrt(2.125)
    advantages = compute_reinforce_pp_baseline_advantages(_t([[1, 0], [4, 0]]), eps=EPS, std="population")
    expected = _t([[0.5, -0.5], [2, -2]]) / (std + EPS)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)


def test_reinforce_pp_baseline_flat_groups_give_zeros_but_count_in_the_batch_std():
    # group-centred [[0.5, -0.5], [0, 0]]: population std sqrt(0.5 / 4)
    std = math.sqrt(0.125)
    advantages = compute_reinforce_pp_baseline_advantages(_t([[1, 0], [3, 3]]), eps=EPS, std="population")
    torch.testing.assert_close(advantages, _t([[0.5, -0.5], [0, 0]]) / (std + EPS), rtol=0, atol=1e-12)


@pytest.mark.parametrize("estimator", [compute_reinforce_pp_advantages, compute_reinforce_pp_baseline_advantages])
@pytest.mark.parametrize("rows", [[[0.7, 0.7], [0.7, NAN]], [[5.0]], [[1.0, NAN], [NAN, NAN]]])
def test_reinforce_pp_batch_without_spread_gives_exactly_zero(estimator, rows):
    scores = _t(rows)
    advantages = estimator(scores)
    _assert_nan_exactly_where_abstained(scores, advantages)
    assert (advantages[~torch.isnan(scores)] == 0).all()


def test_reinforce_pp_flat_groups_differ_only_with_a_baseline():
    # plain: batch mean 2, centred [[1, 1], [-1, -1]], std 1; baseline: every group is flat, so all exactly 0
    scores = _t([[3, 3], [1, 1]])
    expected = _t([[1, 1], [-1, -1]]) / (1 + EPS)
    torch.testing.assert_close(
        compute_reinforce_pp_advantages(scores, eps=EPS, std="population"), expected, rtol=0, atol=1e-12
    )
    assert compute_reinforce_pp_baseline_advantages(scores).tolist() == [[0.0, 0.0], [0.0, 0.0]]


@settings(max_examples=60, deadline=None)
@given(groups=_groups, baseline=st.booleans())
def test_reinforce_pp_property_batch_mean_zero_and_std_one_over_valid_entries(groups, baseline):
    scores = _from_groups(groups)
    estimator = compute_reinforce_pp_baseline_advantages if baseline else compute_reinforce_pp_advantages
    advantages = estimator(scores, eps=EPS)  # the default, unbiased std: checked with correction=1 below
    _assert_nan_exactly_where_abstained(scores, advantages)
    values = advantages[~torch.isnan(scores)]
    if len(values) == 0:
        return
    assert abs(values.mean().item()) < 1e-9
    if values.max() == values.min():
        assert (values == 0).all()  # no spread: exactly 0, not NaN
    else:
        # std / (std + eps) of the normalised input: 1 up to eps (exactly 1 for the batch's own spread)
        normalised_input = compute_grpo_advantages(scores, normalize_std=False) if baseline else scores
        std = normalised_input[~torch.isnan(scores)].std(correction=1).item()
        assert values.std(correction=1).item() == pytest.approx(std / (std + EPS), rel=1e-6)


# --- ReMax -------------------------------------------------------------------------------------------------------


def test_remax_subtracts_each_groups_greedy_score():
    scores = _t([[1, 0, 0.5], [0.25, NAN, 1]])
    advantages = compute_remax_advantages(scores, _t([0.5, 1.0]))
    assert advantages[0].tolist() == [0.5, -0.5, 0.0]
    assert advantages[1, 0].item() == -0.75 and math.isnan(advantages[1, 1]) and advantages[1, 2].item() == 0.0


def test_remax_abstained_greedy_score_makes_the_whole_group_abstain():
    advantages = compute_remax_advantages(_t([[1, 0], [1, 0]]), _t([NAN, 0.0]))
    assert torch.isnan(advantages[0]).all()
    assert advantages[1].tolist() == [1.0, 0.0]


def test_remax_rejects_greedy_scores_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"greedy_scores must have shape \[num_groups\] = \[2\]"):
        compute_remax_advantages(_t([[1, 0], [1, 0]]), _t([[0.5], [0.5]]))


# --- Dr.GRPO -----------------------------------------------------------------------------------------------------


def test_drgrpo_centres_on_the_group_mean_without_std_scaling():
    # row 0: mean 3 -> [0, -2, -1, 3]; row 1: valid [4, 2], mean 3 -> [1, -1]
    advantages = compute_drgrpo_advantages(_t([[3, 1, 2, 6], [4, NAN, 2, NAN]]))
    assert advantages[0].tolist() == [0.0, -2.0, -1.0, 3.0]
    assert advantages[1, 0].item() == 1.0 and advantages[1, 2].item() == -1.0
    assert torch.isnan(advantages[1, 1]) and torch.isnan(advantages[1, 3])


# --- edge cases shared by the outcome estimators -----------------------------------------------------------------


def _remax_with_zero_greedy(scores: torch.Tensor) -> torch.Tensor:
    return compute_remax_advantages(scores, torch.zeros(scores.shape[0], dtype=scores.dtype))


_OUTCOME_ESTIMATORS: list[Callable[[torch.Tensor], torch.Tensor]] = [
    compute_rloo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    _remax_with_zero_greedy,
    compute_drgrpo_advantages,
]


@pytest.mark.parametrize("estimator", _OUTCOME_ESTIMATORS)
@pytest.mark.parametrize(
    "rows",
    [
        [[1.0, NAN, NAN, NAN]],  # a group of one valid score
        [[0.7, 0.7, 0.7, NAN]],  # all equal (0.7 * 3 has a rounding error in its mean)
        [[5.0, 5.0, 5.0, 5.0], [0.1, 0.1, 0.1, 0.1]],
        [[NAN, NAN, NAN, NAN]],  # all abstained
        [[NAN, NAN], [1.0, 0.0]],  # an all-abstained group next to a normal one
        [[2.0]],
    ],
)
def test_outcome_estimators_never_produce_nan_for_valid_scores(estimator, rows):
    scores = _t(rows)
    _assert_nan_exactly_where_abstained(scores, estimator(scores))


@pytest.mark.parametrize("estimator", [compute_rloo_advantages, compute_drgrpo_advantages])
@pytest.mark.parametrize("row", [[1.0, NAN, NAN, NAN], [0.7, 0.7, 0.7, NAN], [0.1, 0.1, 0.1, 0.1]])
def test_group_estimators_give_exactly_zero_to_groups_without_signal(estimator, row):
    advantages = estimator(_t([row]))[0]
    assert [a for a in advantages.tolist() if not math.isnan(a)] == [0.0] * sum(not math.isnan(s) for s in row)


@pytest.mark.parametrize("estimator", _OUTCOME_ESTIMATORS)
@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (0, 0)])
def test_outcome_estimators_accept_empty_inputs(estimator, shape):
    scores = torch.zeros(shape, dtype=torch.float64)
    assert estimator(scores).shape == shape


# --- the registry ------------------------------------------------------------------------------------------------

_SECTIONS: tuple[type[AdvantageConfig], ...] = typing.get_args(typing.get_args(AdvantageConfig)[0])
# gae needs a critic; the turn-level estimators turns (tests/unit/trainer/algorithms/test_trainer_turn_estimators.py)
_GROUP_SECTIONS = [section for section in _SECTIONS if section is not GAEAdvantage and not section.needs_turns]


def _type(section: type[AdvantageConfig]) -> str:
    return typing.get_args(section.model_fields["type"].annotation)[0]


def _section(section: type[AdvantageConfig], **knobs: object) -> AdvantageConfig:
    """The section with those of ``knobs`` it carries (PassKAdvantage needs k; the default is k = 1)."""
    defaults = {"k": 1} if section is PassKAdvantage else {}
    return section.model_validate(
        {**defaults, **{key: value for key, value in knobs.items() if key in section.model_fields}}
    )


@pytest.mark.parametrize("section", _SECTIONS, ids=_type)
def test_every_section_of_the_union_has_a_case(section: type[AdvantageConfig]):
    """The registry knows every member of `AdvantageConfig` (pyright's assert_never checks it statically; this
    checks it at run time): a group estimator gives finite advantages on the valid scores, GAE and the turn-level
    estimators their own refusal."""
    scores = _t([[1.0, 0.0, NAN, 1.0], [3.0, NAN, 1.0, 0.0]])
    baselines = _t([0.5, 1.0]) if section is ReMaxAdvantage else None
    if section is GAEAdvantage:
        with pytest.raises(ValueError, match="critic"):
            compute_advantages(_section(section), scores, baselines=baselines)
        return
    if section.needs_turns:  # per turn: compute_turn_advantages
        with pytest.raises(ValueError, match="turn-level estimator"):
            compute_advantages(_section(section), scores, baselines=baselines)
        return
    advantages = compute_advantages(_section(section), scores, baselines=baselines)
    assert torch.isfinite(advantages[~torch.isnan(scores)]).all()
    assert _type(section) in _HAND_COMPUTED, f"add hand-computed advantages for the new estimator {section.__name__}"


# Two groups of four with abstentions: group 0 has valid [1, 0, 1], group 1 has valid [3, 1].
_REGISTRY_SCORES = [[1.0, 0.0, NAN, 1.0], [3.0, NAN, 1.0, NAN]]
_GRPO_STD_0 = math.sqrt(2) / 3  # group 0: mean 2/3, deviations [1/3, -2/3, 1/3], population std sqrt(2/9)
_PP_STD = math.sqrt(0.96)  # batch [1, 0, 1, 3, 1]: mean 1.2, squared deviations sum to 4.8, over 5
_PP_BASELINE_STD = math.sqrt(8 / 15)  # group-centred [1/3, -2/3, 1/3, 1, -1]: batch mean 0, squares sum to 8/3
_HAND_COMPUTED: dict[str, list[list[float]]] = {
    # (r - group mean) / (group std + eps); group 1: mean 2, std 1
    "grpo": [
        [(1 / 3) / (_GRPO_STD_0 + EPS), (-2 / 3) / (_GRPO_STD_0 + EPS), NAN, (1 / 3) / (_GRPO_STD_0 + EPS)],
        [1 / (1 + EPS), NAN, -1 / (1 + EPS), NAN],
    ],
    "drgrpo": [[1 / 3, -2 / 3, NAN, 1 / 3], [1.0, NAN, -1.0, NAN]],
    # r_i - mean of the others: 1 - mean(0, 1), 0 - mean(1, 1); 3 - 1, 1 - 3
    "rloo": [[0.5, -1.0, NAN, 0.5], [2.0, NAN, -2.0, NAN]],
    "reinforce_pp": [
        [-0.2 / (_PP_STD + EPS), -1.2 / (_PP_STD + EPS), NAN, -0.2 / (_PP_STD + EPS)],
        [1.8 / (_PP_STD + EPS), NAN, -0.2 / (_PP_STD + EPS), NAN],
    ],
    "reinforce_pp_baseline": [
        [
            (1 / 3) / (_PP_BASELINE_STD + EPS),
            (-2 / 3) / (_PP_BASELINE_STD + EPS),
            NAN,
            (1 / 3) / (_PP_BASELINE_STD + EPS),
        ],
        [1 / (_PP_BASELINE_STD + EPS), NAN, -1 / (_PP_BASELINE_STD + EPS), NAN],
    ],
    # greedy baselines [0.5, NaN]: group 1 has no baseline, so it abstains as a whole
    "remax": [[0.5, -0.5, NAN, 0.5], [NAN, NAN, NAN, NAN]],
    # k = 1 (the default): GRPO with the population std and no eps on 0/1 outcomes; group 1's 3 and 1 are both >= 1,
    # both correct: no signal
    "passk": [[1 / math.sqrt(2), -math.sqrt(2), NAN, 1 / math.sqrt(2)], [0.0, NAN, 0.0, NAN]],
}


@pytest.mark.parametrize("section", _GROUP_SECTIONS, ids=_type)
def test_every_group_estimator_of_the_config_gives_its_hand_computed_advantages(section: type[AdvantageConfig]):
    name = _type(section)
    assert name in _HAND_COMPUTED, f"add hand-computed advantages for the new estimator {name!r}"
    baselines = _t([0.5, NAN]) if section is ReMaxAdvantage else None
    estimator = _section(section, std="population")  # the std goes to the sections that carry one
    advantages = compute_advantages(estimator, _t(_REGISTRY_SCORES), baselines=baselines)
    torch.testing.assert_close(advantages, _t(_HAND_COMPUTED[name]), rtol=0, atol=1e-12, equal_nan=True)


def test_gae_is_refused_as_a_group_estimator():
    with pytest.raises(ValueError, match="critic"):
        compute_advantages(GAEAdvantage(), _t(_REGISTRY_SCORES))


def test_remax_without_baselines_is_refused():
    with pytest.raises(ValueError, match="baselines"):
        compute_advantages(ReMaxAdvantage(), _t(_REGISTRY_SCORES))


# --- GAE ---------------------------------------------------------------------------------------------------------

_REWARDS = [0.2, 0.0, 1.0]
_VALUES = [0.5, 0.6, 0.7]


def _gae_row(rewards: list[float], values: list[float], mask: list[int], *, gamma: float, lam: float):
    return compute_gae(_t([rewards]), _t([values]), torch.tensor([mask], dtype=torch.bool), gamma=gamma, lam=lam)


def test_gae_gamma_one_lambda_one_is_returns_to_go_minus_values():
    # rewards [0.5, 0, 1]: returns-to-go [1.5, 1, 1]; minus values [0.5, 0.6, 0.7] -> [1.0, 0.4, 0.3]
    advantages, returns = _gae_row([0.5, 0.0, 1.0], _VALUES, [1, 1, 1], gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages, _t([[1.0, 0.4, 0.3]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(returns, _t([[1.5, 1.0, 1.0]]), rtol=0, atol=1e-12)


def test_gae_hand_computed_discounted_example():
    # gamma 0.9, lam 0.95 (gamma * lam = 0.855), rewards [0.2, 0, 1], values [0.5, 0.6, 0.7], V after the end = 0:
    #   t=2: delta = 1 + 0.9 * 0 - 0.7 = 0.3                         A = 0.3
    #   t=1: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03                      A = 0.03 + 0.855 * 0.3 = 0.2865
    #   t=0: delta = 0.2 + 0.9 * 0.6 - 0.5 = 0.24                    A = 0.24 + 0.855 * 0.2865 = 0.4849575
    #   returns = A + V = [0.9849575, 0.8865, 1.0]
    advantages, returns = _gae_row(_REWARDS, _VALUES, [1, 1, 1], gamma=0.9, lam=0.95)
    torch.testing.assert_close(advantages, _t([[0.4849575, 0.2865, 0.3]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(returns, _t([[0.9849575, 0.8865, 1.0]]), rtol=0, atol=1e-12)


def test_gae_lambda_zero_is_the_one_step_td_residual():
    # the deltas of the example above
    advantages, _ = _gae_row(_REWARDS, _VALUES, [1, 1, 1], gamma=0.9, lam=0.0)
    torch.testing.assert_close(advantages, _t([[0.24, 0.03, 0.3]]), rtol=0, atol=1e-12)


def test_gae_padded_rows_equal_their_unpadded_computation_and_padding_is_zero():
    # row 0 right-padded, row 1 left-padded; padding holds garbage (NaN values, large rewards) that must not leak
    rewards = _t([[*_REWARDS, 7.0, 7.0], [7.0, 7.0, *_REWARDS]])
    values = _t([[*_VALUES, NAN, NAN], [NAN, NAN, *_VALUES]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.95)
    expected_advantages, expected_returns = _gae_row(_REWARDS, _VALUES, [1, 1, 1], gamma=0.9, lam=0.95)
    torch.testing.assert_close(advantages[0, :3], expected_advantages[0], rtol=0, atol=0)
    torch.testing.assert_close(returns[0, :3], expected_returns[0], rtol=0, atol=0)
    torch.testing.assert_close(advantages[1, 2:], expected_advantages[0], rtol=0, atol=0)
    torch.testing.assert_close(returns[1, 2:], expected_returns[0], rtol=0, atol=0)
    assert advantages[0, 3:].tolist() == [0.0, 0.0] and returns[0, 3:].tolist() == [0.0, 0.0]
    assert advantages[1, :2].tolist() == [0.0, 0.0] and returns[1, :2].tolist() == [0.0, 0.0]


def test_gae_interior_masked_tokens_are_skipped_not_treated_as_steps():
    # tool output at t=1 is passed over: t=0 bootstraps from t=2 with a single gamma.
    #   t=2: A = 1 - 0.7 = 0.3;   t=0: delta = 0.2 + 0.9 * 0.7 - 0.5 = 0.33, A = 0.33 + 0.855 * 0.3 = 0.5865
    advantages, returns = _gae_row([0.2, 5.0, 1.0], [0.5, 9.0, 0.7], [1, 0, 1], gamma=0.9, lam=0.95)
    torch.testing.assert_close(advantages, _t([[0.5865, 0.0, 0.3]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(returns, _t([[1.0865, 0.0, 1.0]]), rtol=0, atol=1e-12)


def test_gae_all_masked_row_is_zero_and_does_not_disturb_other_rows():
    rewards = _t([[1.0, 2.0, 3.0], _REWARDS])
    values = _t([[NAN, NAN, NAN], _VALUES])
    mask = torch.tensor([[0, 0, 0], [1, 1, 1]], dtype=torch.float32)  # a float mask works like a bool one
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.95)
    assert advantages[0].tolist() == [0.0, 0.0, 0.0] and returns[0].tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(advantages[1], _t([0.4849575, 0.2865, 0.3]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(0, 4), (2, 0), (0, 0)])
def test_gae_accepts_empty_inputs(shape):
    advantages, returns = compute_gae(
        torch.zeros(shape), torch.zeros(shape), torch.zeros(shape, dtype=torch.bool), gamma=1.0, lam=0.95
    )
    assert advantages.shape == shape and returns.shape == shape


def test_gae_outputs_carry_no_gradient():
    values = _t([_VALUES]).requires_grad_()
    advantages, returns = compute_gae(_t([_REWARDS]), values, torch.ones(1, 3), gamma=0.9, lam=0.95)
    assert not advantages.requires_grad and not returns.requires_grad


def test_gae_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"must all be \[batch, seq\]"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0)


_row = st.lists(st.floats(min_value=-5, max_value=5, allow_nan=False), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(rewards=_row, data=st.data())
def test_gae_property_undiscounted_matches_monte_carlo_and_padding_changes_nothing(rewards, data):
    length = len(rewards)
    values = data.draw(
        st.lists(st.floats(min_value=-5, max_value=5, allow_nan=False), min_size=length, max_size=length)
    )
    num_pad = data.draw(st.integers(min_value=0, max_value=3))
    advantages, returns = _gae_row(rewards, values, [1] * length, gamma=1.0, lam=1.0)
    returns_to_go = [sum(rewards[t:]) for t in range(length)]
    assert returns[0].tolist() == pytest.approx(returns_to_go, abs=1e-9)
    assert advantages[0].tolist() == pytest.approx(
        [g - v for g, v in zip(returns_to_go, values, strict=True)], abs=1e-9
    )
    padded_advantages, padded_returns = _gae_row(
        [*rewards, *[1.0] * num_pad], [*values, *[1.0] * num_pad], [1] * length + [0] * num_pad, gamma=0.9, lam=0.95
    )
    unpadded_advantages, unpadded_returns = _gae_row(rewards, values, [1] * length, gamma=0.9, lam=0.95)
    torch.testing.assert_close(padded_advantages[:, :length], unpadded_advantages, rtol=0, atol=0)
    torch.testing.assert_close(padded_returns[:, :length], unpadded_returns, rtol=0, atol=0)
    assert (padded_advantages[:, length:] == 0).all() and (padded_returns[:, length:] == 0).all()


# --- whiten ------------------------------------------------------------------------------------------------------


def test_whiten_uses_only_masked_entries_and_zeroes_the_rest():
    # masked entries [0, 4]: mean 2, population std 2 (the 100 must not count)
    mask = torch.tensor([[True, True, False]])
    whitened = whiten(_t([[0, 4, 100]]), mask, std="population")
    torch.testing.assert_close(whitened, _t([[-2 / (2 + 1e-8), 2 / (2 + 1e-8), 0]]), rtol=0, atol=1e-15)
    kept_level = whiten(_t([[0, 4, 100]]), mask, shift_mean=False, std="population")
    torch.testing.assert_close(kept_level, _t([[2 - 2 / (2 + 1e-8), 2 + 2 / (2 + 1e-8), 0]]), rtol=0, atol=1e-15)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_edge_cases_never_produce_nan(shift_mean):
    all_masked = whiten(_t([[1, 2], [3, 4]]), torch.zeros(2, 2, dtype=torch.bool), shift_mean=shift_mean)
    assert all_masked.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    flat = whiten(_t([[0.7, 0.7, 0.7, 9]]), torch.tensor([[1, 1, 1, 0]]), shift_mean=shift_mean)
    # all-equal masked entries: exactly 0, or their mean (0.7 up to the mean's rounding) with shift_mean=False
    if shift_mean:
        assert flat[0, :3].tolist() == [0.0, 0.0, 0.0]
    else:
        assert flat[0, :3].tolist() == pytest.approx([0.7] * 3, abs=1e-15)
    assert flat[0, 3].item() == 0.0
    assert whiten(torch.zeros(0, 3), torch.zeros(0, 3), shift_mean=shift_mean).shape == (0, 3)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(_score, min_size=3, max_size=3), min_size=1, max_size=4))
def test_whiten_property_masked_mean_zero_std_one(rows):
    mask = torch.tensor([[s is not None for s in row] for row in rows])
    values = _t([[0.0 if s is None else s for s in row] for row in rows])
    whitened = whiten(values, mask, std="population")
    assert torch.isfinite(whitened).all() and (whitened[~mask] == 0).all()
    selected = whitened[mask]
    if len(selected) == 0 or selected.max() == selected.min():
        assert (selected == 0).all()
        return
    assert abs(selected.mean().item()) < 1e-9
    std = values[mask].std(correction=0).item()
    assert selected.std(correction=0).item() == pytest.approx(std / (std + 1e-8), rel=1e-6)


# --- std convention (trainer.algorithm.advantage_std) --------------------------------------------------------------


def test_unbiased_std_is_the_default_and_divides_by_k_minus_1():
    # group [1, 0, 0, 1]: mean 0.5, squared deviations sum to 1; unbiased std sqrt(1/3), population sqrt(1/4) = 0.5
    scores = _t([[1, 0, 0, 1]])
    unbiased = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    population = 0.5 / (0.5 + 1e-6)
    expected = [[unbiased, -unbiased, -unbiased, unbiased]]
    torch.testing.assert_close(compute_grpo_advantages(scores), _t(expected), rtol=0, atol=1e-12)
    torch.testing.assert_close(compute_advantages(GRPOAdvantage(), scores), _t(expected), rtol=0, atol=1e-12)
    pop = compute_grpo_advantages(scores, std="population")
    torch.testing.assert_close(pop, _t([[population, -population, -population, population]]), rtol=0, atol=1e-12)
    via_section = compute_advantages(GRPOAdvantage(std="population"), scores)  # the section's std reaches it
    torch.testing.assert_close(via_section, pop, rtol=0, atol=0)
    # REINFORCE++ over the batch [[2, NaN], [0, 4]]: mean 2, squared deviations 0 + 4 + 4 = 8 over k = 3 valid
    rpp = compute_reinforce_pp_advantages(_t([[2, NAN], [0, 4]]))
    s = math.sqrt(8 / 2)
    torch.testing.assert_close(
        rpp, _t([[0, NAN], [-2 / (s + 1e-6), 2 / (s + 1e-6)]]), rtol=0, atol=1e-12, equal_nan=True
    )
    # whitening of [0, 4] (the 100 masked): unbiased std sqrt(8 / 1)
    w = whiten(_t([[0, 4, 100]]), torch.tensor([[True, True, False]]))
    s = math.sqrt(8.0)
    torch.testing.assert_close(w, _t([[-2 / (s + 1e-8), 2 / (s + 1e-8), 0]]), rtol=0, atol=1e-15)


def test_advantage_std_config_key_defaults_to_unbiased_and_rejects_other_values():
    from pydantic import ValidationError

    from sharpen.config.algorithm import AlgorithmConfig

    default = AlgorithmConfig().advantage
    assert isinstance(default, GRPOAdvantage) and default.std == "unbiased"
    population = AlgorithmConfig.model_validate({"advantage": {"type": "grpo", "std": "population"}}).advantage
    assert isinstance(population, GRPOAdvantage) and population.std == "population"
    with pytest.raises(ValidationError, match="std"):
        AlgorithmConfig.model_validate({"advantage": {"type": "grpo", "std": "sample"}})
