"""Chained rejection criteria of the off-policy correction (k1 / k2 / k3, per token or per sequence), their
combination with the importance weights, the weight normaliser, and the additive statistics behind the metrics;
hand-computed in float64."""

from __future__ import annotations

import math

import pytest
import torch

from sharpen.config.algorithm import OffPolicyRejectConfig
from sharpen.config.corrections import IcePopCorrection, NoCorrection, SequenceTISCorrection, TokenTISCorrection
from sharpen.trainer.algorithms.offpolicy import (
    compute_correction,
    correction_metrics,
    keep_by_criterion,
    normalizer_terms,
)


def _pair(log_ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer and engine logprobs whose difference is ``log_ratios`` (engine fixed at -1.5)."""
    engine = torch.full((len(log_ratios), len(log_ratios[0])), -1.5, dtype=torch.float64)
    return engine + torch.tensor(log_ratios, dtype=torch.float64), engine


def _all(shape: tuple[int, int]) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.bool)


def _criterion(**fields) -> OffPolicyRejectConfig:
    return OffPolicyRejectConfig(**fields)


def _kept(log_ratios: list[list[float]], mask: torch.Tensor, **fields) -> list[list[bool]]:
    log_ratio = torch.tensor(log_ratios, dtype=torch.float64)
    return keep_by_criterion(log_ratio, mask, _criterion(**fields)).tolist()


# --- each criterion ------------------------------------------------------------------------------------------------


def test_token_k1_keeps_ratios_inside_the_band_inclusive():
    ratios = [[math.log(0.5), math.log(2.0), -1.0, 1.0, 0.2]]  # 0.5 and 2 sit on the edges; e^-1, e^1 outside
    assert _kept(ratios, _all((1, 5)), level="token", low=0.5, high=2.0) == [[True, True, False, False, True]]
    assert _kept(ratios, _all((1, 5)), level="token", low=0.0, high=2.0) == [[True, True, True, False, True]]


def test_token_k2_and_k3_thresholds():
    # k2 = 0.5 l^2: 0.125, 0.245, 0.18, 0.2048 against 0.2
    log_ratios = [[0.5, -0.7, 0.6, 0.64]]
    assert _kept(log_ratios, _all((1, 4)), level="token", divergence="k2", high=0.2) == [[True, False, True, False]]
    # k3 = e^l - 1 - l: e^0.5 - 1.5 = 0.1487, e^-0.5 - 0.5 = 0.1065, e - 2 = 0.7183 against 0.12
    log_ratios = [[0.5, -0.5, 1.0]]
    assert _kept(log_ratios, _all((1, 3)), level="token", divergence="k3", high=0.12) == [[False, True, False]]


def test_sequence_sum_k1_tests_the_product_ratio_of_the_valid_tokens():
    # row 0: e^0.7 = 2.014 > 2 -> dropped; row 1: e^-0.1 -> kept; row 2: e^0.5 (its padding's 9.0 ignored) -> kept
    log_ratios = [[0.3, 0.4], [0.1, -0.2], [0.5, 9.0]]
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    kept = _kept(log_ratios, mask, level="sequence", statistic="sum", low=0.5, high=2.0)
    assert kept == [[False, False], [True, True], [True, False]]


def test_sequence_mean_k1_tests_the_geometric_mean_ratio():
    # row 0: mean 0.8 > log 2 = 0.693 -> dropped; row 1: mean 0.1 -> kept; row 2: mean 0.8 over its one valid token
    log_ratios = [[1.0, 0.6], [0.2, 0.0], [0.8, -9.0]]
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    kept = _kept(log_ratios, mask, level="sequence", statistic="mean", low=0.5, high=2.0)
    assert kept == [[False, False], [True, True], [False, False]]
    # the product ratio of row 1 (e^0.2) passes too, but 1000 tokens of 0.01 pass only as a mean
    long = [[0.01] * 1000]
    assert all(_kept(long, _all((1, 1000)), level="sequence", statistic="mean", low=0.5, high=2.0)[0])
    assert not any(_kept(long, _all((1, 1000)), level="sequence", statistic="sum", low=0.5, high=2.0)[0])


def test_sequence_max_k2_and_sum_k3():
    # max k2: row 0 has 0.5 * 0.9^2 = 0.405 > 0.1 -> dropped; row 1's largest is 0.5 * 0.3^2 = 0.045 -> kept
    log_ratios = [[0.1, -0.9], [0.3, 0.2]]
    kept = _kept(log_ratios, _all((2, 2)), level="sequence", statistic="max", divergence="k2", high=0.1)
    assert kept == [[False, False], [True, True]]
    # sum k3: row 0: 0.14872 + 0.10653 = 0.25525 > 0.25 -> dropped; row 1: 0.14872 + 0 -> kept
    kept = _kept([[0.5, -0.5], [0.5, 0.0]], _all((2, 2)), level="sequence", statistic="sum", divergence="k3", high=0.25)
    assert kept == [[False, False], [True, True]]
    # mean k3 of row 0 is 0.1276: kept under 0.13; the padding of row 1 (k3 of 5.0 = 142) does not count
    mask = torch.tensor([[True, True], [True, False]])
    kept = _kept([[0.5, -0.5], [0.5, 5.0]], mask, level="sequence", statistic="mean", divergence="k3", high=0.13)
    assert kept == [[True, True], [False, False]]  # row 1: its one token's k3 0.1487 > 0.13


def test_sequence_criteria_on_empty_rows_and_zero_width():
    mask = torch.tensor([[False, False], [True, True]])
    for statistic in ("sum", "mean", "max"):
        kept = _kept([[5.0, 5.0], [0.0, 0.0]], mask, level="sequence", statistic=statistic, divergence="k3", high=0.1)
        assert kept == [[False, False], [True, True]]
    empty = torch.zeros(2, 0)
    criterion = _criterion(level="sequence", statistic="max", divergence="k2", high=0.1)
    assert keep_by_criterion(empty, torch.zeros(2, 0, dtype=torch.bool), criterion).shape == (2, 0)


# --- chaining, and the combination with the mode's weights ---------------------------------------------------------

# row 0: the token band [0.8, 1.25] drops its 0.3; the max-k3 test (k3(0.3) = 0.0499) keeps the row.
# row 1: the band drops its -0.9 and k3(-0.9) = e^-0.9 - 0.1 = 0.30657 > 0.3 drops the whole row.
# row 2: every token inside the band, every k3 small: kept.
_CHAIN = [[0.0, 0.3, 0.1], [0.1, -0.9, 0.0], [0.2, -0.1, 0.05]]
_CRITERIA = [
    OffPolicyRejectConfig(level="token", low=0.8, high=1.25),
    OffPolicyRejectConfig(level="sequence", statistic="max", divergence="k3", high=0.3),
]
_CHAIN_KEPT = [[True, False, True], [False, False, False], [True, True, True]]


def test_chained_criteria_keep_a_token_only_if_every_criterion_keeps_it():
    trainer, engine = _pair(_CHAIN)
    for criteria in (_CRITERIA, _CRITERIA[::-1]):  # the order does not matter
        out = compute_correction(NoCorrection(reject=criteria), trainer, engine, _all((3, 3)))
        assert out.mask.tolist() == _CHAIN_KEPT
        assert out.weights.tolist() == [[float(k) for k in row] for row in _CHAIN_KEPT]
        assert out.metrics["offpolicy/masked_fraction"] == pytest.approx(4 / 9, abs=1e-15)
        assert out.sums == {
            "num_tokens": 9.0,
            "num_sequences": 3.0,
            "reject/token_k1/tokens": 2.0,  # 0.3 and -0.9 (each criterion counts on its own: they overlap)
            "reject/seq_max_k3/tokens": 3.0,
            "reject/seq_max_k3/sequences": 1.0,
            "num_kept": 5.0,
            "weight_sum": 5.0,
            "weight_sq_sum": 5.0,
        }


def test_rejection_combines_with_token_tis_weights():
    trainer, engine = _pair(_CHAIN)
    out = compute_correction(TokenTISCorrection(cap=1.2, reject=_CRITERIA), trainer, engine, _all((3, 3)))
    # the kept tokens keep min(r, 1.2): e^0.2 = 1.2214 is capped
    expected = [[1.0, 0.0, math.exp(0.1)], [0.0, 0.0, 0.0], [1.2, math.exp(-0.1), math.exp(0.05)]]
    torch.testing.assert_close(out.weights, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert out.mask.tolist() == _CHAIN_KEPT
    kept = [1.0, math.exp(0.1), 1.2, math.exp(-0.1), math.exp(0.05)]
    assert out.sums["weight_sum"] == pytest.approx(sum(kept), abs=1e-12)
    assert out.sums["weight_sq_sum"] == pytest.approx(sum(w * w for w in kept), abs=1e-12)
    assert out.maxima == {"weight_max": pytest.approx(1.2, abs=1e-12)}
    # the mode's own metrics are unchanged except masked_fraction, which now counts the rejected tokens
    plain = compute_correction(TokenTISCorrection(cap=1.2), trainer, engine, _all((3, 3)))
    assert out.metrics == {**plain.metrics, "offpolicy/masked_fraction": pytest.approx(4 / 9)}


def test_rejection_keeps_the_sequence_weight_of_the_whole_sequence():
    # sequence_tis weighs by the product over all valid tokens, the rejected one included: e^(0.1 + 0.5) = e^0.6
    trainer, engine = _pair([[0.1, 0.5], [0.05, -0.1]])
    token_band = [OffPolicyRejectConfig(level="token", low=0.8, high=1.25)]
    out = compute_correction(SequenceTISCorrection(cap=3.0, reject=token_band), trainer, engine, _all((2, 2)))
    expected = [[math.exp(0.6), 0.0], [math.exp(-0.05), math.exp(-0.05)]]
    torch.testing.assert_close(out.weights, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_rejection_narrows_icepop():
    # IcePop's band [0.5, 2] keeps 0.5 and -0.6; the sequence-mean k1 band [0.9, 1.1] then drops row 1 (mean 0.25)
    trainer, engine = _pair([[0.05, -0.05], [0.5, 0.0], [-0.6, 1.0]])
    seq_mean = [OffPolicyRejectConfig(level="sequence", statistic="mean", low=0.9, high=1.1)]
    out = compute_correction(IcePopCorrection(low=0.5, high=2.0, reject=seq_mean), trainer, engine, _all((3, 2)))
    # row 2: IcePop drops 1.0 (e > 2); the sequence mean 0.2 is outside [log 0.9, log 1.1] -> dropped as well
    expected = [[math.exp(0.05), math.exp(-0.05)], [0.0, 0.0], [0.0, 0.0]]
    torch.testing.assert_close(out.weights, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert out.sums["reject/seq_mean_k1/sequences"] == 2.0 and out.sums["reject/seq_mean_k1/tokens"] == 4.0
    assert out.metrics["offpolicy/masked_fraction"] == pytest.approx(4 / 6)


def test_without_criteria_or_normalizer_the_correction_is_the_mode_alone():
    trainer, engine = _pair(_CHAIN)
    out = compute_correction(TokenTISCorrection(cap=2.0), trainer, engine, _all((3, 3)))
    assert out.sums == {} and out.maxima == {}


# --- the normaliser ------------------------------------------------------------------------------------------------


def test_normalizer_divides_the_kept_weights():
    trainer, engine = _pair(_CHAIN)
    args = (trainer, engine, _all((3, 3)))
    tis = TokenTISCorrection(cap=1.2, reject=_CRITERIA)
    plain = compute_correction(tis, *args)
    scaled = compute_correction(tis, *args, normalizer=1.6)
    torch.testing.assert_close(scaled.weights, plain.weights / 1.6, rtol=0, atol=1e-15)
    assert scaled.mask.tolist() == plain.mask.tolist()
    assert scaled.sums["normalizer_tokens"] == pytest.approx(1.6 * 9)
    with pytest.raises(ValueError, match="normalizer must be positive"):
        compute_correction(TokenTISCorrection(cap=2.0), *args, normalizer=0.0)


def test_normalizer_terms_per_token_and_per_sequence():
    trainer, engine = _pair(_CHAIN)
    tis = compute_correction(TokenTISCorrection(cap=1.2, reject=_CRITERIA), trainer, engine, _all((3, 3)))
    kept = [1.0, math.exp(0.1), 1.2, math.exp(-0.1), math.exp(0.05)]
    assert normalizer_terms(tis, per_sequence=False) == {"weight_sum": pytest.approx(sum(kept)), "count": 5.0}
    # per sequence: one weight per kept row; row 0's product e^0.4 and row 2's e^0.15 (row 1 rejected)
    seq = compute_correction(SequenceTISCorrection(cap=3.0, reject=_CRITERIA), trainer, engine, _all((3, 3)))
    terms = normalizer_terms(seq, per_sequence=True)
    assert terms == {"weight_sum": pytest.approx(math.exp(0.4) + math.exp(0.15), abs=1e-12), "count": 2.0}


# --- metrics from the summed statistics ----------------------------------------------------------------------------


def test_correction_metrics_from_summed_parts():
    trainer, engine = _pair(_CHAIN)
    tis = TokenTISCorrection(cap=1.2, reject=_CRITERIA)
    # two micro-batches (rows 0-1 and row 2) give the same step metrics as one
    parts = [compute_correction(tis, trainer[s], engine[s], _all((len(s), 3))) for s in ([0, 1], [2])]
    sums = {name: parts[0].sums.get(name, 0.0) + parts[1].sums.get(name, 0.0) for name in parts[0].sums}
    metrics = correction_metrics(sums, {"weight_max": max(p.maxima["weight_max"] for p in parts)})
    whole = compute_correction(tis, trainer, engine, _all((3, 3)))
    assert metrics == pytest.approx(correction_metrics(whole.sums, whole.maxima), abs=1e-14)
    kept = [1.0, math.exp(0.1), 1.2, math.exp(-0.1), math.exp(0.05)]
    assert metrics == pytest.approx(
        {
            "offpolicy/reject/token_k1/token_fraction": 2 / 9,
            "offpolicy/reject/seq_max_k3/token_fraction": 3 / 9,
            "offpolicy/reject/seq_max_k3/sequence_fraction": 1 / 3,
            "offpolicy/weight_mean": sum(kept) / 5,
            "offpolicy/weight_max": 1.2,
            "offpolicy/weight_ess": sum(kept) ** 2 / (5 * sum(w * w for w in kept)),
        },
        abs=1e-12,
    )


def test_correction_metrics_with_nothing_kept_and_with_a_normalizer():
    trainer, engine = _pair([[3.0, -3.0]])
    band = [OffPolicyRejectConfig(level="token", low=0.5, high=2.0)]
    out = compute_correction(TokenTISCorrection(cap=2.0, reject=band), trainer, engine, _all((1, 2)), normalizer=2.0)
    assert not out.mask.any() and out.weights.tolist() == [[0.0, 0.0]]
    metrics = correction_metrics(out.sums, out.maxima)
    assert metrics["offpolicy/weight_mean"] == 0.0 and metrics["offpolicy/weight_max"] == 0.0
    assert metrics["offpolicy/weight_ess"] == 1.0
    assert metrics["offpolicy/weight_normalizer"] == 2.0
    assert metrics["offpolicy/reject/token_k1/token_fraction"] == 1.0
    assert out.metrics["offpolicy/masked_fraction"] == 1.0


def test_extreme_ratios_stay_finite_under_every_divergence():
    big = math.log(1e30)
    trainer = torch.tensor([[big, -big, float("-inf"), 0.0]] * 2, dtype=torch.float32)
    engine = torch.tensor([[0.0, 0.0, -1.0, -1e4]] * 2, dtype=torch.float32)
    criteria = [
        OffPolicyRejectConfig(level="token", divergence="k3", high=10.0),
        OffPolicyRejectConfig(level="sequence", statistic="sum", divergence="k3", high=1e30),
        OffPolicyRejectConfig(level="sequence", statistic="max", divergence="k2", high=1e30),
    ]
    tis = TokenTISCorrection(cap=2.0, reject=criteria)
    out = compute_correction(tis, trainer, engine, _all((2, 4)), normalizer=1.5)
    assert torch.isfinite(out.weights).all()
    assert all(math.isfinite(v) for v in [*out.sums.values(), *out.maxima.values()])
    assert not out.mask.any()  # every token's k3 is above 10 (and each row's k3 sum is ~5.5e34)
