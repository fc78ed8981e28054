"""KL estimators by hand and in expectation (which is an unbiased value, which an unbiased gradient), the KL
coefficient controllers, and the entropy of logits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sharpen.trainer.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    KLEstimator,
    entropy_from_logits,
    kl_per_token,
)

F64 = torch.float64
ESTIMATORS: tuple[KLEstimator, ...] = ("k1", "k2", "k3")

# --- values ------------------------------------------------------------------------------------------------------


def test_estimators_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    ref = torch.tensor([[-1.5, -2.0, 0.0]], dtype=F64)
    x = [0.5, 0.0, -0.5]  # log pi - log pi_ref
    expected: dict[KLEstimator, list[float]] = {
        "k1": x,
        "k2": [0.5 * v * v for v in x],
        "k3": [math.exp(-v) - 1 + v for v in x],  # (r - 1) - log r with r = exp(-x)
    }
    for estimator, values in expected.items():
        torch.testing.assert_close(kl_per_token(logprobs, ref, estimator), torch.tensor([values], dtype=F64))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-30, 0), st.floats(-30, 0)), min_size=1, max_size=16))
def test_k2_and_k3_are_non_negative(pairs):
    logprobs = torch.tensor([[p[0] for p in pairs]])
    ref = torch.tensor([[p[1] for p in pairs]])
    for estimator in ("k2", "k3"):
        for clamp in (10.0, None):
            kl = kl_per_token(logprobs, ref, estimator, clamp=clamp)
            assert torch.isfinite(kl).all() and (kl >= 0).all()


def test_an_explicit_clamp_bounds_the_value_and_removes_the_gradient_without_nan():
    # x = +30 and -30: with clamp = 10 (opt-in) every estimate is within [-10, 10] and the clamped tokens lose their
    # gradient (documented); the default (no clamp) keeps both
    logprobs = torch.tensor([[-31.0, -1.0, -1.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.0, -31.0, -1.2]], dtype=F64)
    for estimator in ESTIMATORS:
        kl = kl_per_token(logprobs, ref, estimator, clamp=10.0)
        assert kl[0, :2].abs().tolist() == [10.0, 10.0]
        (grad,) = torch.autograd.grad(kl.sum(), logprobs)
        assert grad[0, :2].tolist() == [0.0, 0.0] and grad[0, 2] != 0  # the in-range token keeps its gradient
    assert kl_per_token(logprobs, ref, "k1")[0, :2].tolist() == [-30.0, 30.0]
    # unclamped k3 at x = -30 (log r = 30, below the overflow guard at 80) is the exact (r - 1) - log r
    k3 = kl_per_token(logprobs, ref, "k3")
    assert k3[0, 0].item() == pytest.approx(math.exp(30) - 1 - 30)
    (grad,) = torch.autograd.grad(k3.sum(), logprobs)
    # d k3 / d log pi = 1 - r = 1 - exp(30) at the first token, 1 - exp(-30) at the second
    assert grad[0, 0].item() == pytest.approx(1 - math.exp(30))
    assert grad[0, 1].item() == pytest.approx(1 - math.exp(-30))


def test_k2_keeps_value_and_gradient_far_from_the_reference():
    # |x| = 10 (the old default clamp zeroed k2 from |x| > sqrt(20) ~ 4.5): k2 = x^2 / 2 = 50, d k2 / d log pi = x
    logprobs = torch.tensor([[-11.0, -1.0, -3.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.0, -11.0, -3.5]], dtype=F64)
    kl = kl_per_token(logprobs, ref, "k2")
    assert kl.tolist() == [[50.0, 50.0, 0.125]]
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    assert grad.tolist() == [[-10.0, 10.0, 0.5]]


def test_k3_guards_only_float32_overflow_and_keeps_its_gradient():
    # log r = -x = 100 > 80: exp(100) ~ 2.7e43 overflows float32; k3 follows its tangent at 80 instead:
    # k3 = (e^80 - 1 - 80) + (e^80 - 1) (100 - 80), gradient d/d log pi = -(e^80 - 1) (finite, still pushing up)
    logprobs = torch.tensor([[-101.0, -2.0]], dtype=torch.float32, requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0]], dtype=torch.float32)
    kl = kl_per_token(logprobs, ref, "k3")
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    assert torch.isfinite(kl).all() and torch.isfinite(grad).all()
    e80 = math.exp(80)
    assert kl[0, 0].item() == pytest.approx((e80 - 1 - 80) + (e80 - 1) * 20, rel=1e-5)
    assert grad[0, 0].item() == pytest.approx(-(e80 - 1), rel=1e-5)
    # below the limit nothing changes: log r = 1 -> k3 = e - 1 - 1, gradient 1 - e
    assert kl[0, 1].item() == pytest.approx(math.e - 2, rel=1e-6)
    assert grad[0, 1].item() == pytest.approx(1 - math.e, rel=1e-6)
    # float64 agrees with the exact formula where exp is finite in float32 too
    x = torch.tensor([-79.0], dtype=F64)
    assert kl_per_token(x, torch.zeros_like(x), "k3").item() == pytest.approx(math.exp(79) - 1 - 79)


def test_invalid_estimator_and_clamp_raise():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_per_token(x, x, "k4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clamp"):
        kl_per_token(x, x, "k1", clamp=0.0)


# --- expectations over a small categorical policy ------------------------------------------------------------------


def _categorical() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, generator=generator, dtype=F64).requires_grad_(True)
    ref_logits = torch.randn(6, generator=generator, dtype=F64)
    return logits, ref_logits


def _exact_kl_gradients(logits: torch.Tensor, ref_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    logp, ref_logp = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    reverse = (logp.exp() * (logp - ref_logp)).sum()  # KL(pi || pi_ref)
    forward = (ref_logp.exp() * (ref_logp - logp)).sum()  # KL(pi_ref || pi)
    return {
        "k1": torch.zeros_like(logits),
        "k2": torch.autograd.grad(reverse, logits, retain_graph=True)[0],
        "k3": torch.autograd.grad(forward, logits)[0],
    }


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_expected_gradient_as_a_loss_exactly(estimator: KLEstimator):
    """E_{y~pi}[grad k(y)] summed over the whole vocabulary with weights sg(pi(y)): k2 gives grad KL(pi || pi_ref),
    k3 the gradient of the forward KL(pi_ref || pi), k1 zero (Tang & Munos 2025)."""
    logits, ref_logits = _categorical()
    logp, ref_logp = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    expected_loss = (logp.exp().detach() * kl_per_token(logp, ref_logp, estimator, clamp=None)).sum()
    (grad,) = torch.autograd.grad(expected_loss, logits)
    exact = _exact_kl_gradients(logits, ref_logits)
    torch.testing.assert_close(grad, exact[estimator], rtol=0, atol=1e-12)
    assert exact["k2"].abs().max() > 0.05 and (exact["k2"] - exact["k3"]).abs().max() > 0.05  # not a vacuous test


def test_expected_value_k1_and_k3_are_unbiased_k2_is_not():
    logits, ref_logits = _categorical()
    logp, ref_logp = torch.log_softmax(logits.detach(), -1), torch.log_softmax(ref_logits, -1)
    kl = (logp.exp() * (logp - ref_logp)).sum().item()
    means = {e: (logp.exp() * kl_per_token(logp, ref_logp, e, clamp=None)).sum().item() for e in ESTIMATORS}
    assert means["k1"] == pytest.approx(kl, abs=1e-12)
    assert means["k3"] == pytest.approx(kl, abs=1e-12)
    assert abs(means["k2"] - kl) > 0.01


def test_sampled_k2_loss_gradient_matches_the_reverse_kl_gradient():
    """Monte Carlo, as a trainer would see it: tokens sampled from pi, the mean k2 loss differentiated."""
    logits, ref_logits = _categorical()
    generator = torch.Generator().manual_seed(1)
    samples = torch.multinomial(torch.softmax(logits.detach(), -1), 40_000, replacement=True, generator=generator)
    logp, ref_logp = torch.log_softmax(logits, -1)[samples], torch.log_softmax(ref_logits, -1)[samples]
    exact = _exact_kl_gradients(logits, ref_logits)
    grads = {
        e: torch.autograd.grad(kl_per_token(logp, ref_logp, e, clamp=None).mean(), logits, retain_graph=True)[0]
        for e in ESTIMATORS
    }
    torch.testing.assert_close(grads["k2"], exact["k2"], rtol=0, atol=0.02)
    torch.testing.assert_close(grads["k1"], exact["k1"], rtol=0, atol=0.02)
    assert (grads["k3"] - exact["k2"]).abs().max() > 0.05  # k3's gradient is off, beyond the sampling noise


# --- controllers -------------------------------------------------------------------------------------------------


def test_adaptive_controller_follows_ziegler_update():
    controller = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10_000)
    controller.update(current_kl=7.5, num_steps=100)  # error 7.5 / 6 - 1 = 0.25, clipped to 0.2
    assert controller.coef == pytest.approx(0.1 * (1 + 0.2 * 100 / 10_000))
    before = controller.coef
    controller.update(current_kl=5.7, num_steps=100)  # error -0.05
    assert controller.coef == pytest.approx(before * (1 - 0.05 * 100 / 10_000))
    before = controller.coef
    controller.update(current_kl=6.0, num_steps=100)
    assert controller.coef == before


def test_adaptive_controller_moves_up_above_target_and_down_below():
    controller = AdaptiveKLController(init_coef=0.05, target=0.02, horizon=100)
    coefs = [controller.coef]
    for kl in (0.1, 0.1, 0.001, 0.001, 0.001):
        controller.update(kl, num_steps=10)
        coefs.append(controller.coef)
    assert coefs[0] < coefs[1] < coefs[2]
    assert coefs[2] > coefs[3] > coefs[4] > coefs[5] > 0


def test_fixed_controller_never_moves_and_both_satisfy_the_protocol():
    controllers: list[KLController] = [FixedKLController(0.04), AdaptiveKLController(0.04, 0.1, 100)]
    controllers[0].update(100.0, 1000)
    assert controllers[0].coef == 0.04
    controllers[1].update(100.0, 1)
    assert controllers[1].coef > 0.04


def test_controllers_reject_bad_settings():
    with pytest.raises(ValueError):
        FixedKLController(-0.1)
    for args in ((0.0, 1.0, 1.0), (0.1, 0.0, 1.0), (0.1, 1.0, 0.0)):
        with pytest.raises(ValueError):
            AdaptiveKLController(*args)


# --- entropy -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, 1000.0, -1e4])
def test_entropy_of_uniform_logits_is_log_vocab(value: float):
    entropy = entropy_from_logits(torch.full((2, 3, 7), value))
    assert entropy.shape == (2, 3)
    torch.testing.assert_close(entropy, torch.full((2, 3), math.log(7)))


def test_entropy_matches_torch_categorical_and_chunking_changes_nothing():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0), dtype=F64) * 4
    reference = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), reference)
    for chunk_size in (1, 4, 15, 100):
        torch.testing.assert_close(entropy_from_logits(logits, chunk_size=chunk_size), reference, rtol=0, atol=1e-14)


def test_entropy_with_masked_vocabulary_and_its_gradient_are_finite():
    logits = torch.tensor(
        [[0.0, 0.0, float("-inf"), float("-inf")], [3.0, float("-inf"), 1.0, 0.0]], requires_grad=True
    )
    entropy = entropy_from_logits(logits)
    assert entropy[0].item() == pytest.approx(math.log(2))
    p = torch.softmax(torch.tensor([3.0, 1.0, 0.0], dtype=F64), -1)
    assert entropy[1].item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-6)
    (grad,) = torch.autograd.grad(entropy.sum(), logits)
    assert torch.isfinite(grad).all()
    assert grad[0, 2:].tolist() == [0.0, 0.0] and grad[1, 1].item() == 0.0  # masked-out tokens get no gradient
    assert grad[1, 0].item() != 0.0


def test_entropy_of_bfloat16_logits_is_computed_in_float32():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    entropy = entropy_from_logits(logits.to(torch.bfloat16), chunk_size=3)
    assert entropy.dtype == torch.float32
    reference = torch.distributions.Categorical(logits=logits.to(torch.bfloat16).to(F64)).entropy()
    torch.testing.assert_close(entropy.to(F64), reference, rtol=1e-6, atol=1e-6)


def test_entropy_rejects_a_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(torch.zeros(2, 3), chunk_size=0)
