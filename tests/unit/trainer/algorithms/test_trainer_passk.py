"""Pass@k advantages (Chen et al. 2025, analytic form) on hand-computed cases, their reduction to GRPO at k = 1,
and the config's bounds on k."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from sharpen.config.advantages import PassKAdvantage
from sharpen.config.schema import SharpenConfig
from sharpen.trainer.algorithms.advantages import compute_grpo_advantages
from sharpen.trainer.algorithms.estimators import compute_advantages, compute_passk_advantages

NAN = float("nan")


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _assert_exact(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(actual, _t(expected), rtol=0, atol=1e-12, equal_nan=True)


def test_hand_computed_groups():
    # n = 4, c = 1, k = 2: rho = 1 - C(3,2)/C(4,2) = 1/2, sigma = 1/2; correct (1/2)/(1/2) = 1;
    #   incorrect: C(2,1)/C(3,1) = 2/3, (1/2 - 2/3)/(1/2) = -1/3
    # n = 4, c = 2, k = 2: rho = 1 - 1/6 = 5/6, sigma = sqrt(5)/6; correct (1/6)/(sqrt(5)/6) = 1/sqrt(5);
    #   incorrect: C(1,1)/C(3,1) = 1/3, (1/6 - 1/3)/(sqrt(5)/6) = -1/sqrt(5)
    scores = _t([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    _assert_exact(
        compute_passk_advantages(scores, k=2),
        [[-1 / 3, 1.0, -1 / 3, -1 / 3], [1 / math.sqrt(5), -1 / math.sqrt(5), 1 / math.sqrt(5), -1 / math.sqrt(5)]],
    )


def test_k_three_of_five():
    # n = 5, c = 2, k = 3: rho = 1 - C(3,3)/C(5,3) = 9/10, sigma = 3/10; correct (1/10)/(3/10) = 1/3;
    #   incorrect: C(2,2)/C(4,2) = 1/6, (1/10 - 1/6)/(3/10) = -2/9. The group's advantages sum to 0.
    advantages = compute_passk_advantages(_t([[1.0, 0.0, 0.0, 1.0, 0.0]]), k=3)
    _assert_exact(advantages, [[1 / 3, -2 / 9, -2 / 9, 1 / 3, -2 / 9]])
    assert abs(float(advantages.sum())) < 1e-12


def test_degenerate_groups_get_exactly_zero():
    # all wrong (rho 0), all correct (rho 1), and n - c = 2 < k = 3: every 3-subset holds a correct sample (rho 1)
    scores = _t([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    advantages = compute_passk_advantages(scores, k=3)
    assert torch.equal(advantages, torch.zeros_like(scores))


def test_abstentions_are_left_out_and_a_group_shorter_than_k_gets_zero():
    # group 0: valid [0, 1, 0, 0] -> n = 4, c = 1, k = 2 as above
    # group 1: valid [1, 0, 0] -> n = 3, c = 1, k = 2: rho = 1 - C(2,2)/C(3,2) = 2/3, sigma = sqrt(2)/3;
    #   correct (1/3)/(sqrt(2)/3) = 1/sqrt(2); incorrect: C(1,1)/C(2,1) = 1/2, (1/3 - 1/2)/(sqrt(2)/3) = -1/(2 sqrt(2))
    scores = _t([[0.0, NAN, 1.0, 0.0, 0.0], [1.0, NAN, 0.0, 0.0, NAN]])
    half = 1 / (2 * math.sqrt(2))
    _assert_exact(
        compute_passk_advantages(scores, k=2),
        [[-1 / 3, NAN, 1.0, -1 / 3, -1 / 3], [1 / math.sqrt(2), NAN, -half, -half, NAN]],
    )
    # k = 4: group 0 has n - c = 3 < 4 (estimate 1), group 1 only 3 valid scores (no 4-subset): no signal
    _assert_exact(compute_passk_advantages(scores, k=4), [[0.0, NAN, 0.0, 0.0, 0.0], [0.0, NAN, 0.0, 0.0, NAN]])


def test_a_score_of_at_least_one_is_correct_anything_below_is_not():
    # partial credit 0.5, a format bonus on a right answer (1.1), a hack penalty (-1): counted as [0, 1, 0, 0]
    scores = _t([[0.5, 1.1, -1.0, 0.0]])
    _assert_exact(compute_passk_advantages(scores, k=2), [[-1 / 3, 1.0, -1 / 3, -1 / 3]])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 1.0, NAN]), min_size=2, max_size=8), min_size=1, max_size=6))
def test_k_one_is_grpo_with_the_population_std(rows: list[list[float]]):
    width = max(len(r) for r in rows)
    scores = _t([r + [NAN] * (width - len(r)) for r in rows])
    passk = compute_passk_advantages(scores, k=1)
    grpo = compute_grpo_advantages(scores, std="population", eps=0.0)  # NaN for flat groups: 0 / 0
    valid = ~torch.isnan(scores)
    values = torch.where(valid, scores, torch.zeros_like(scores))
    has_spread = ((values * valid).sum(dim=1) > 0) & ((values * valid).sum(dim=1) < valid.sum(dim=1))  # 0 < c < n
    for row in range(scores.shape[0]):
        if bool(has_spread[row]):
            torch.testing.assert_close(passk[row], grpo[row], rtol=0, atol=1e-12, equal_nan=True)
        else:
            assert torch.equal(torch.isnan(passk[row]), ~valid[row])
            assert bool((passk[row][valid[row]] == 0).all())


def test_the_registry_passes_k():
    scores = _t([[0.0, 1.0, 0.0, 0.0]])
    _assert_exact(compute_advantages(PassKAdvantage(k=2), scores), [[-1 / 3, 1.0, -1 / 3, -1 / 3]])
    with pytest.raises(ValueError, match="k >= 1"):
        compute_passk_advantages(scores, k=0)


def _config(k: int, num_samples: int) -> SharpenConfig:
    return SharpenConfig.model_validate(
        {
            "rollout": {"num_samples_per_prompt": num_samples, "prompts_per_step": 2},
            "trainer": {"micro_batch_size": 2, "algorithm": {"advantage": {"type": "passk", "k": k}}},
        }
    )


@pytest.mark.parametrize("k", [1, 4, 7])
def test_config_accepts_k_below_the_group_size(k: int):
    advantage = _config(k, 8).trainer.algorithm.advantage
    assert isinstance(advantage, PassKAdvantage) and advantage.k == k


@pytest.mark.parametrize("k", [8, 9])
def test_config_refuses_k_of_the_group_size_or_more(k: int):
    with pytest.raises(
        ValueError, match=r"advantage.k = \d+ must be between 1 and 7 \(below rollout.num_samples_per_prompt"
    ):
        _config(k, 8)


def test_config_refuses_k_zero():
    with pytest.raises(ValidationError, match=r"(?s)passk\.k.*Input should be greater than or equal to 1"):
        _config(0, 8)


def test_config_needs_k_for_passk():
    with pytest.raises(ValidationError, match=r"(?s)passk\.k.*Field required"):
        SharpenConfig.model_validate({"trainer": {"algorithm": {"advantage": "passk"}}})


def test_k_belongs_to_passk_alone():
    # the typed sections: another estimator has no k to ignore, so giving it one is an error, not a no-op
    with pytest.raises(ValidationError, match=r"(?s)grpo\.k.*Extra inputs are not permitted"):
        SharpenConfig.model_validate({"trainer": {"algorithm": {"advantage": {"type": "grpo", "k": 50}}}})
