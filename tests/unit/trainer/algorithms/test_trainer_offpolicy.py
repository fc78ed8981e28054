"""Off-policy corrections on hand-computed cases: truncated IS (token, sequence), rejection masks, IcePop, metrics,
edges."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from sharpen.config.corrections import (
    CorrectionConfig,
    IcePopCorrection,
    NoCorrection,
    SequenceMaskCorrection,
    SequenceTISCorrection,
    TokenMaskCorrection,
    TokenTISCorrection,
)
from sharpen.trainer.algorithms.offpolicy import (
    LOG_RATIO_LIMIT,
    compute_correction,
    icepop,
    sequence_mask_is,
    sequence_tis,
    token_mask_is,
    token_tis,
)

SECTIONS: tuple[type[CorrectionConfig], ...] = get_args(get_args(CorrectionConfig)[0])
KNOBS = {"cap": 2.0, "low": 0.5, "high": 2.0}


def _section(section: type[CorrectionConfig], **knobs: float) -> CorrectionConfig:
    """The section with those of ``knobs`` (default: KNOBS) it carries: cap for the TIS corrections, low and high
    for the band ones."""
    knobs = knobs or KNOBS
    return section.model_validate({key: value for key, value in knobs.items() if key in section.model_fields})


def _type(section: type[CorrectionConfig]) -> str:
    return get_args(section.model_fields["type"].annotation)[0]


MODES = [_section(section) for section in SECTIONS]


def _pair(log_ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer and engine logprobs whose difference is ``log_ratios`` (engine fixed at a plausible -1.5)."""
    engine = torch.full((len(log_ratios), len(log_ratios[0])), -1.5, dtype=torch.float64)
    return engine + torch.tensor(log_ratios, dtype=torch.float64), engine


def _all(shape: tuple[int, int]) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.bool)


# --- token TIS -----------------------------------------------------------------------------------------------------


def test_token_tis_weight_is_ratio_truncated_at_cap():
    trainer, engine = _pair([[0.5, -1.0, 0.0, 0.2]])
    out = token_tis(trainer, engine, _all((1, 4)), cap=1.5)
    expected = torch.tensor([[1.5, math.exp(-1.0), 1.0, math.exp(0.2)]], dtype=torch.float64)
    torch.testing.assert_close(out.weights, expected, rtol=0, atol=1e-12)
    assert out.mask.all()
    assert out.metrics["offpolicy/capped_fraction"] == pytest.approx(1 / 4)
    assert out.metrics["offpolicy/masked_fraction"] == 0.0


def test_token_tis_leaves_padding_at_zero_whatever_it_holds():
    trainer = torch.tensor([[-1.0, float("-inf"), float("nan")]], dtype=torch.float64)
    engine = torch.tensor([[-1.0, float("-inf"), 0.0]], dtype=torch.float64)  # inf - inf and NaN in padding
    mask = torch.tensor([[True, False, False]])
    out = token_tis(trainer, engine, mask, cap=2.0)
    assert out.weights.tolist() == [[1.0, 0.0, 0.0]]
    assert out.mask.tolist() == [[True, False, False]]
    assert all(math.isfinite(v) for v in out.metrics.values())


# --- sequence TIS --------------------------------------------------------------------------------------------------


def test_sequence_tis_weight_is_product_of_ratios_truncated_and_equal_across_the_sequence():
    # row 0: sum of log ratios -0.5 -> e^-0.5; row 1: 0.3 + 0.4 = 0.7 -> e^0.7 = 2.01 -> capped at 2;
    # row 2: the third token is padding (its 9.0 must not count) -> e^0.25
    trainer, engine = _pair([[0.5, -1.0, 0.0], [0.3, 0.4, 0.0], [0.1, 0.15, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
    out = sequence_tis(trainer, engine, mask, cap=2.0)
    expected = torch.tensor(
        [[math.exp(-0.5)] * 3, [2.0] * 3, [math.exp(0.25), math.exp(0.25), 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(out.weights, expected, rtol=0, atol=1e-12)
    assert out.mask.tolist() == mask.tolist()
    assert out.metrics["offpolicy/capped_fraction"] == pytest.approx(3 / 8)  # the tokens of the capped row


def test_sequence_tis_long_sequence_does_not_overflow():
    # 4096 tokens each 5 nats more likely under the trainer: prod r = e^20480, far past float32/float64 range.
    trainer, engine = _pair([[5.0] * 4096, [-5.0] * 4096])
    out = sequence_tis(trainer.float(), engine.float(), _all((2, 4096)), cap=3.0)
    assert torch.isfinite(out.weights).all()
    assert torch.allclose(out.weights[0], torch.tensor(3.0))
    assert out.weights[1].max().item() == 0.0  # e^-20480 underflows to an exact 0, not NaN


# --- token rejection mask (weight 1) and IcePop (weight r) ------------------------------------------------------------


def test_token_mask_keeps_tokens_with_ratio_inside_the_band_with_weight_one():
    trainer, engine = _pair([[-1.0, 0.0, 1.0, 0.5, -0.6]])  # ratios 0.37, 1, 2.72, 1.65, 0.55
    out = token_mask_is(trainer, engine, _all((1, 5)), low=0.5, high=2.0)
    assert out.mask.tolist() == [[False, True, False, True, True]]
    assert out.weights.tolist() == [[0.0, 1.0, 0.0, 1.0, 1.0]]
    assert out.metrics["offpolicy/masked_fraction"] == pytest.approx(2 / 5)
    assert out.metrics["offpolicy/capped_fraction"] == 0.0


def test_token_mask_band_is_inclusive_and_low_zero_means_no_lower_bound():
    trainer = torch.tensor([[math.log(0.5), math.log(2.0), -50.0]], dtype=torch.float64)
    engine = torch.zeros_like(trainer)
    out = token_mask_is(trainer, engine, _all((1, 3)), low=0.5, high=2.0)
    assert out.mask.tolist() == [[True, True, False]]
    out = token_mask_is(trainer, engine, _all((1, 3)), low=0.0, high=2.0)
    assert out.mask.tolist() == [[True, True, True]]


def test_icepop_weights_kept_tokens_by_their_ratio_and_zeroes_the_rest():
    # the token_mask case above: same kept tokens, but IcePop's M(r) = r inside [0.5, 2], not 1
    trainer, engine = _pair([[-1.0, 0.0, 1.0, 0.5, -0.6]])  # ratios 0.37, 1, 2.72, 1.65, 0.55
    out = icepop(trainer, engine, _all((1, 5)), low=0.5, high=2.0)
    assert out.mask.tolist() == [[False, True, False, True, True]]
    expected = [[0.0, 1.0, 0.0, math.exp(0.5), math.exp(-0.6)]]
    torch.testing.assert_close(out.weights, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert out.metrics["offpolicy/masked_fraction"] == pytest.approx(2 / 5)
    via_registry = compute_correction(IcePopCorrection(low=0.5, high=2.0), trainer, engine, _all((1, 5)))
    assert torch.equal(via_registry.weights, out.weights)


# --- sequence mask -------------------------------------------------------------------------------------------------


def test_sequence_mask_keeps_whole_sequences_by_geometric_mean_ratio():
    # row 0: mean log ratio 0 -> kept; row 1: mean 0.8 -> e^0.8 = 2.23 > 2 -> dropped;
    # row 2: mean 0.1 over its one valid token (the padding's 5.0 is ignored) -> kept
    trainer, engine = _pair([[1.0, -1.0], [1.0, 0.6], [0.1, 5.0]])
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    out = sequence_mask_is(trainer, engine, mask, low=0.5, high=2.0)
    assert out.mask.tolist() == [[True, True], [False, False], [True, False]]
    assert out.weights.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]
    assert out.metrics["offpolicy/masked_fraction"] == pytest.approx(2 / 5)


def test_sequence_mask_is_length_normalised():
    # 1000 tokens each 0.01 nats off: the product ratio e^10 would be rejected, the geometric mean e^0.01 is not.
    trainer, engine = _pair([[0.01] * 1000])
    assert sequence_mask_is(trainer, engine, _all((1, 1000)), low=0.5, high=2.0).mask.all()


# --- dispatcher, metrics -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.type)
def test_no_mismatch_means_no_correction(mode: CorrectionConfig):
    engine = -torch.rand(3, 5, dtype=torch.float64) * 4
    mask = torch.tensor([[True] * 5, [True, True, True, False, False], [False] * 5])
    out = compute_correction(mode, engine.clone(), engine, mask)
    assert out.mask.tolist() == mask.tolist()
    assert out.weights.tolist() == mask.double().tolist()
    metrics = out.metrics
    assert metrics["offpolicy/num_tokens"] == 8.0
    assert metrics["offpolicy/kl_k1"] == 0.0 and metrics["offpolicy/kl_k3"] == 0.0
    assert metrics["offpolicy/ess"] == pytest.approx(1.0, abs=1e-12)
    assert metrics["offpolicy/ratio_p01"] == metrics["offpolicy/ratio_p50"] == metrics["offpolicy/ratio_p99"] == 1.0
    assert metrics["offpolicy/masked_fraction"] == 0.0 and metrics["offpolicy/capped_fraction"] == 0.0


def test_none_mode_leaves_weights_at_one_but_still_reports_the_mismatch():
    trainer, engine = _pair([[0.5, -1.0]])
    out = compute_correction(NoCorrection(), trainer, engine, _all((1, 2)))
    assert out.weights.tolist() == [[1.0, 1.0]]
    # k1 = mean(-log r) = 0.25; k3 = mean(r - 1 - log r) over r = e^0.5, e^-1
    assert out.metrics["offpolicy/kl_k1"] == pytest.approx(0.25, abs=1e-12)
    expected_k3 = ((math.exp(0.5) - 1 - 0.5) + (math.exp(-1.0) - 1 + 1.0)) / 2
    assert out.metrics["offpolicy/kl_k3"] == pytest.approx(expected_k3, abs=1e-12)


def test_every_mode_reports_the_same_metric_names():
    trainer, engine = _pair([[0.5, -1.0]])
    names = {frozenset(compute_correction(m, trainer, engine, _all((1, 2))).metrics) for m in MODES}
    assert len(names) == 1


@pytest.mark.parametrize("section", SECTIONS, ids=_type)
def test_every_section_of_the_union_has_a_case(section: type[CorrectionConfig]):
    """The registry knows every member of `CorrectionConfig` with its default knobs (pyright's assert_never checks
    it statically; this at run time): finite weights in [0, cap or the ratio], the input mask or less."""
    trainer, engine = _pair([[0.5, -1.0, 0.0], [0.1, 0.2, 0.3]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = compute_correction(section(), trainer, engine, mask)
    assert torch.isfinite(out.weights).all() and (out.weights >= 0).all()
    assert not (out.mask & ~mask).any()


def test_ess_is_one_for_equal_ratios_and_hand_computed_otherwise():
    trainer, engine = _pair([[0.7, 0.7, 0.7]])  # all ratios e^0.7: no spread, ESS 1 (it is scale-free)
    assert token_tis(trainer, engine, _all((1, 3)), cap=2.0).metrics["offpolicy/ess"] == pytest.approx(1.0)
    trainer, engine = _pair([[0.0, math.log(3.0)]])  # ratios 1, 3: (1 + 3)^2 / (2 * (1 + 9)) = 0.8
    assert token_tis(trainer, engine, _all((1, 2)), cap=2.0).metrics["offpolicy/ess"] == pytest.approx(0.8)


def test_ratio_quantiles_on_a_known_set():
    # ratios 1..101 in shuffled order: p01 = 1 + 0.01 * 100 = 2, p50 = 51, p99 = 100
    ratios = torch.randperm(101, generator=torch.Generator().manual_seed(0)).double() + 1
    trainer = ratios.log().unsqueeze(0)
    out = compute_correction(NoCorrection(), trainer, torch.zeros_like(trainer), _all((1, 101)))
    assert out.metrics["offpolicy/ratio_p01"] == pytest.approx(2.0)
    assert out.metrics["offpolicy/ratio_p50"] == pytest.approx(51.0)
    assert out.metrics["offpolicy/ratio_p99"] == pytest.approx(100.0)


def test_ratio_quantiles_match_torch_quantile_on_the_valid_tokens():
    generator = torch.Generator().manual_seed(1)
    trainer = -torch.rand(4, 37, generator=generator, dtype=torch.float64) * 3
    engine = -torch.rand(4, 37, generator=generator, dtype=torch.float64) * 3
    mask = torch.rand(4, 37, generator=generator) > 0.3
    metrics = compute_correction(NoCorrection(), trainer, engine, mask).metrics
    expected = torch.quantile((trainer - engine)[mask].exp(), torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64))
    got = [metrics["offpolicy/ratio_p01"], metrics["offpolicy/ratio_p50"], metrics["offpolicy/ratio_p99"]]
    assert got == pytest.approx(expected.tolist(), rel=1e-12)


def test_weights_are_detached_and_at_least_float32():
    trainer = torch.full((2, 3), -1.0, dtype=torch.bfloat16, requires_grad=True)
    engine = torch.full((2, 3), -1.25, dtype=torch.bfloat16)
    for mode in MODES:
        out = compute_correction(mode, trainer, engine, _all((2, 3)))
        assert not out.weights.requires_grad
        assert out.weights.dtype == torch.float32
        assert out.mask.dtype == torch.bool


# --- edge cases ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.type)
def test_every_token_masked_gives_zero_weights_and_finite_metrics(mode: CorrectionConfig):
    trainer, engine = _pair([[3.0, -3.0], [0.0, 1.0]])
    out = compute_correction(mode, trainer, engine, torch.zeros(2, 2, dtype=torch.bool))
    assert out.weights.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert not out.mask.any()
    assert out.metrics["offpolicy/num_tokens"] == 0.0
    assert out.metrics["offpolicy/ratio_p50"] == 0.0 and out.metrics["offpolicy/kl_k3"] == 0.0
    assert out.metrics["offpolicy/ess"] == 1.0


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.type)
def test_zero_length_rows(mode: CorrectionConfig):
    empty = torch.zeros(3, 0)
    out = compute_correction(mode, empty, empty, torch.zeros(3, 0, dtype=torch.bool))
    assert out.weights.shape == (3, 0) and out.mask.shape == (3, 0)
    assert all(math.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.type)
def test_extreme_ratios_stay_finite(mode: CorrectionConfig):
    # ratio 1e30 (log 69, under the clamp), its inverse, and infinite trainer logprobs on valid tokens
    big = math.log(1e30)
    trainer = torch.tensor([[big, -big, float("-inf"), 0.0], [0.0, -1e4, float("-inf"), 0.0]], dtype=torch.float32)
    engine = torch.tensor([[0.0, 0.0, -1.0, -1e4], [-2e4, 0.0, -1.0, -1.0]], dtype=torch.float32)
    out = compute_correction(mode, trainer, engine, _all((2, 4)))
    assert torch.isfinite(out.weights).all()
    assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics
    if isinstance(mode, NoCorrection):
        assert out.metrics["offpolicy/ratio_p99"] == pytest.approx(math.exp(LOG_RATIO_LIMIT), rel=1e-6)


# --- errors --------------------------------------------------------------------------------------------------------


def test_invalid_arguments_raise_value_error():
    trainer, engine = _pair([[0.0, 0.0]])
    mask = _all((1, 2))
    with pytest.raises(ValueError, match="shapes"):
        token_tis(trainer, engine[:, :1], mask, cap=2.0)
    with pytest.raises(ValueError, match="bool mask"):
        token_tis(trainer, engine, mask.float(), cap=2.0)
    with pytest.raises(ValueError, match="cap must be positive"):
        sequence_tis(trainer, engine, mask, cap=0.0)
    with pytest.raises(ValueError, match="low <= high"):
        token_mask_is(trainer, engine, mask, low=2.0, high=0.5)
    with pytest.raises(ValueError, match="low <= high"):
        sequence_mask_is(trainer, engine, mask, low=-0.1, high=2.0)


def test_an_unknown_correction_type_is_refused_by_the_config():
    # the registry takes only the union's sections; a name outside it never gets that far
    with pytest.raises(ValidationError, match="masked_icepop"):
        TypeAdapter(CorrectionConfig).validate_python({"type": "masked_icepop"})
    assert isinstance(TypeAdapter(CorrectionConfig).validate_python({"type": "icepop"}), IcePopCorrection)


# --- property: random logprobs, including large differences --------------------------------------------------------

_logprob = st.one_of(
    st.floats(min_value=-1e4, max_value=0.0, allow_nan=False),
    st.floats(min_value=-5.0, max_value=0.0, allow_nan=False),
    st.just(float("-inf")),
)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    shape=st.tuples(st.integers(1, 4), st.integers(0, 6)),
    section=st.sampled_from(SECTIONS),
    cap=st.floats(min_value=1.0, max_value=10.0),
    band=st.tuples(st.floats(min_value=0.0, max_value=1.0), st.floats(min_value=1.0, max_value=10.0)),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_property_weights_and_metrics_are_finite_and_consistent(data, shape, section, cap, band, dtype):
    size = shape[0] * shape[1]
    trainer = torch.tensor(data.draw(st.lists(_logprob, min_size=size, max_size=size)), dtype=dtype).view(shape)
    # The engine sampled these tokens, so its logprobs are finite.
    engine_values = st.floats(min_value=-1e4, max_value=0.0, allow_nan=False)
    engine = torch.tensor(data.draw(st.lists(engine_values, min_size=size, max_size=size)), dtype=dtype).view(shape)
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=size, max_size=size)), dtype=torch.bool).view(shape)
    out = compute_correction(_section(section, cap=cap, low=band[0], high=band[1]), trainer, engine, mask)

    assert torch.isfinite(out.weights).all()
    assert (out.weights >= 0).all()
    assert not (out.mask & ~mask).any(), "kept tokens must be a subset of the input mask"
    assert (out.weights[~out.mask] == 0).all()
    if section in (TokenTISCorrection, SequenceTISCorrection):
        assert (out.weights <= cap * (1 + 1e-6)).all()
    if section in (NoCorrection, TokenMaskCorrection, SequenceMaskCorrection):
        assert ((out.weights == 0) | (out.weights == 1)).all()
    metrics = out.metrics
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["offpolicy/num_tokens"] == mask.sum().item()
    assert metrics["offpolicy/kl_k3"] >= 0
    assert 0 < metrics["offpolicy/ess"] <= 1 + 1e-9
    assert 0 <= metrics["offpolicy/masked_fraction"] <= 1 and 0 <= metrics["offpolicy/capped_fraction"] <= 1
    assert metrics["offpolicy/ratio_p01"] <= metrics["offpolicy/ratio_p50"] <= metrics["offpolicy/ratio_p99"]
