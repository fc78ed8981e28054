"""SAPO, GMPO and the overflow guard of the log-ratio, on hand-computed values and gradients (float64), plus their
registry calls and the config's refusal of GSPO/GMPO with a non-paper aggregation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from sharpen.config.algorithm import AlgorithmConfig
from sharpen.config.policy_losses import AggregationMode, GMPOLoss, PolicyLossConfig, PPOClipLoss, SAPOLoss
from sharpen.trainer.algorithms.aggregation import aggregate_loss, aggregation_normalizer
from sharpen.trainer.algorithms.policy_losses import (
    compute_policy_loss,
    exp_overflow_bound,
    gmpo_per_token,
    ppo_clip_per_token,
    sapo_per_token,
)

F64 = torch.float64


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _grad(per_token: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(per_token.sum(), leaf)
    return grad


# --- overflow guard ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_overflow_bound_is_the_last_finite_exponent(dtype: torch.dtype):
    bound = torch.tensor(exp_overflow_bound(dtype), dtype=dtype)
    assert torch.isfinite(torch.exp(bound))
    assert not torch.isfinite(torch.exp(torch.nextafter(bound, torch.tensor(math.inf, dtype=dtype))))


def test_guard_changes_no_value_that_does_not_overflow_and_keeps_its_gradient():
    # float32: exp(88) = 1.65e38 is finite and must be exactly torch.exp's, with gradient r A; exp(100) would be inf
    logprobs = torch.tensor([[88.0, 100.0]], dtype=torch.float32, requires_grad=True)
    per_token, _ = ppo_clip_per_token(
        logprobs,
        torch.zeros(1, 2),
        torch.tensor([[-1.0]]),
        torch.ones(1, 2, dtype=torch.bool),
        clip_eps_low=0.2,
        clip_eps_high=0.2,
    )
    assert per_token[0, 0] == torch.exp(torch.tensor(88.0))
    assert torch.isfinite(per_token).all()
    grad = _grad(per_token, logprobs)
    assert grad[0, 0] == torch.exp(torch.tensor(88.0)) and grad[0, 1] == 0.0


# --- SAPO ----------------------------------------------------------------------------------------------------------


def test_sapo_hand_computed_gate_values_and_gradients():
    # r = [1.5, 0.5, 1.0], A = [+2, -1, +1], tau_pos = 1, tau_neg = 1.05
    # loss = -(4 / tau) sigmoid(tau (r - 1)) A; d/dlogprob = -4 s (1 - s) r A with s = sigmoid(tau (r - 1))
    ratios, advantages, taus = [1.5, 0.5, 1.0], [2.0, -1.0, 1.0], [1.0, 1.05, 1.0]
    logprobs = torch.tensor([[math.log(r) for r in ratios]], dtype=F64, requires_grad=True)
    per_token, metrics = sapo_per_token(
        logprobs,
        torch.zeros(1, 3, dtype=F64),
        torch.tensor([advantages], dtype=F64),
        torch.ones(1, 3, dtype=torch.bool),
        tau_pos=1.0,
        tau_neg=1.05,
    )
    s = [_sigmoid(t * (r - 1)) for r, t in zip(ratios, taus, strict=True)]
    expected = [-(4 / t) * si * a for t, si, a in zip(taus, s, advantages, strict=True)]
    expected_grad = [-4 * si * (1 - si) * r * a for si, r, a in zip(s, ratios, advantages, strict=True)]
    torch.testing.assert_close(per_token, torch.tensor([expected], dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(_grad(per_token, logprobs), torch.tensor([expected_grad], dtype=F64), rtol=0, atol=1e-12)
    # token 2 is on-policy: the gradient is exactly REINFORCE's -A; the value is -(4 / tau) * 0.5 * A = -2
    assert expected_grad[2] == pytest.approx(-1.0, abs=1e-15) and expected[2] == pytest.approx(-2.0, abs=1e-15)
    assert metrics.num_clipped_low.item() == metrics.num_clipped_high.item() == 0.0
    assert metrics.ratio_sum.item() == pytest.approx(3.0, abs=1e-12)


def test_sapo_gradient_decays_smoothly_where_ppo_drops_it_to_zero():
    # r = 1.3, A = +1: PPO (eps 0.2) has no gradient; SAPO keeps 4 s (1 - s) r, s = sigmoid(0.3), below r
    logprobs = torch.tensor([[math.log(1.3)]], dtype=F64, requires_grad=True)
    args = (logprobs, torch.zeros(1, 1, dtype=F64), torch.ones(1, 1, dtype=F64), torch.ones(1, 1, dtype=torch.bool))
    sapo, _ = sapo_per_token(*args, tau_pos=1.0, tau_neg=1.05)
    ppo, _ = ppo_clip_per_token(*args, clip_eps_low=0.2, clip_eps_high=0.2)
    s = _sigmoid(0.3)
    assert _grad(sapo, logprobs).item() == pytest.approx(-4 * s * (1 - s) * 1.3, abs=1e-12)
    assert _grad(ppo, logprobs).item() == 0.0
    with pytest.raises(ValueError, match="tau_pos"):
        sapo_per_token(*args, tau_pos=0.0, tau_neg=1.0)


# --- GMPO ----------------------------------------------------------------------------------------------------------


def test_gmpo_hand_computed_geometric_mean_of_log_clipped_ratios():
    # row 0, A = +1: log-ratios [0.6, -0.6, 0.2], bounds [-0.4, 0.4]: A > 0 clips only from above (pessimistic),
    #   c = [0.4, -0.6, 0.2], log R = 0.0, loss per token -1; gradient -A R / L on unclipped tokens (1 and 2)
    # row 1, A = -2: log-ratios [0.6, -0.6]: A < 0 clips only from below, c = [0.6, -0.4], log R = 0.1
    logprobs = torch.tensor([[0.6, -0.6, 0.2], [0.6, -0.6, 0.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    advantages = torch.tensor([[1.0], [-2.0]], dtype=F64)
    per_token, metrics = gmpo_per_token(
        logprobs, torch.zeros(2, 3, dtype=F64), advantages, mask, log_clip_low=0.4, log_clip_high=0.4
    )
    r1 = math.exp(0.1)
    torch.testing.assert_close(per_token, torch.tensor([[-1.0, -1.0, -1.0], [2 * r1, 2 * r1, 0.0]], dtype=F64))
    assert (metrics.num_clipped_high.item(), metrics.num_clipped_low.item()) == (1.0, 1.0)
    loss = aggregate_loss(
        per_token, mask, "seq_mean_token_mean", normalizer=aggregation_normalizer("seq_mean_token_mean", mask)
    )
    (grad,) = torch.autograd.grad(loss, logprobs)
    # d(-mean_i A_i R_i)/d logprob_t = -(1/2) A_i R_i / L_i on unclipped tokens
    expected = [[0.0, -0.5 / 3, -0.5 / 3], [0.5 * 2 * r1 / 2, 0.0, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)


def test_gmpo_token_form_equals_the_sequence_objective_on_random_inputs():
    generator = torch.Generator().manual_seed(3)
    logprobs = (-torch.rand(4, 6, generator=generator, dtype=F64) * 2).requires_grad_(True)
    old = logprobs.detach() + torch.randn(4, 6, generator=generator, dtype=F64) * 0.5
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-2.0]], dtype=F64)
    mask = torch.rand(4, 6, generator=generator) > 0.3
    per_token, _ = gmpo_per_token(logprobs, old, advantages, mask, log_clip_low=0.3, log_clip_high=0.4)
    token_form = aggregate_loss(
        per_token, mask, "seq_mean_token_mean", normalizer=aggregation_normalizer("seq_mean_token_mean", mask)
    )
    m = mask.to(F64)
    delta = (logprobs - old) * m
    sign = torch.sign(advantages)
    c = sign * torch.minimum(sign * delta, sign * delta.clamp(-0.3, 0.4))
    big_r = torch.exp((c * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1))
    nonempty = m.sum(-1) > 0
    sequence_form = (-(big_r * advantages).squeeze(-1))[nonempty].mean()
    torch.testing.assert_close(token_form, sequence_form, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        torch.autograd.grad(token_form, logprobs)[0],
        torch.autograd.grad(sequence_form, logprobs)[0],
        rtol=0,
        atol=1e-12,
    )


# --- registry and config -------------------------------------------------------------------------------------------


def test_registry_passes_the_sapo_and_gmpo_keys():
    logprobs = torch.tensor([[0.6, -0.1]], dtype=F64)
    args = (logprobs, torch.zeros(1, 2, dtype=F64), torch.tensor([[-1.0]], dtype=F64), torch.ones(1, 2).bool())
    got, _ = compute_policy_loss(SAPOLoss(tau_neg=2.0), *args)
    assert torch.equal(got, sapo_per_token(*args, tau_pos=1.0, tau_neg=2.0)[0])
    got, _ = compute_policy_loss(GMPOLoss(log_clip_low=0.05), *args)
    assert torch.equal(got, gmpo_per_token(*args, log_clip_low=0.05, log_clip_high=0.4)[0])


@pytest.mark.parametrize("loss", ["gspo", "gmpo"])
def test_sequence_objectives_refuse_a_non_paper_aggregation(loss: str):
    AlgorithmConfig.model_validate({"policy_loss": loss, "loss_aggregation": "seq_mean_token_mean"})
    with pytest.raises(ValueError, match="seq_mean_token_mean"):
        AlgorithmConfig.model_validate({"policy_loss": loss, "loss_aggregation": "token_mean"})


# --- gradient split invariance -------------------------------------------------------------------------------------

_SPLIT_LOSSES: dict[str, tuple[AggregationMode, PolicyLossConfig]] = {
    "ppo_clip": ("token_mean", PPOClipLoss(clip_eps_low=0.2, clip_eps_high=0.2)),
    "sapo": ("seq_mean_token_mean", SAPOLoss(tau_pos=1.0, tau_neg=1.05)),
    "sapo_token_mean": ("token_mean", SAPOLoss(tau_pos=0.5, tau_neg=2.0)),
    "gmpo": ("seq_mean_token_mean", GMPOLoss(log_clip_low=0.1, log_clip_high=0.2)),
}


@pytest.mark.parametrize("case", list(_SPLIT_LOSSES))
def test_new_objectives_gradient_is_invariant_to_the_micro_batch_split(case: str):
    """Summed over micro-batches (rows split 2+3 and 1+1+3, each padded to its own width), loss and gradient equal
    the whole batch's to 1e-12, with the normaliser of the whole mini-batch (ratios away from 1, some clipped)."""
    mode, loss = _SPLIT_LOSSES[case]
    generator = torch.Generator().manual_seed(7)
    lengths = [5, 2, 7, 1, 4]
    width = max(lengths)
    logprobs = (-torch.rand(5, width, generator=generator, dtype=F64) * 2).requires_grad_(True)
    old = logprobs.detach() + torch.randn(5, width, generator=generator, dtype=F64) * 0.3
    advantages = torch.randn(5, 1, generator=generator, dtype=F64)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    normalizer = aggregation_normalizer(mode, mask)

    def loss_of(rows: slice) -> torch.Tensor:
        own_width = max(lengths[rows])
        per_token, _ = compute_policy_loss(
            loss, logprobs[rows, :own_width], old[rows, :own_width], advantages[rows], mask[rows, :own_width]
        )
        return aggregate_loss(per_token, mask[rows, :own_width], mode, normalizer=normalizer)

    whole = loss_of(slice(0, 5))
    (whole_grad,) = torch.autograd.grad(whole, logprobs)
    for bounds in ([0, 2, 5], [0, 1, 2, 5]):
        split = sum(loss_of(slice(a, b)) for a, b in itertools.pairwise(bounds))
        assert isinstance(split, torch.Tensor)
        (split_grad,) = torch.autograd.grad(split, logprobs)
        torch.testing.assert_close(split, whole, rtol=0, atol=1e-12)
        torch.testing.assert_close(split_grad, whole_grad, rtol=0, atol=1e-12)
    assert whole_grad.abs().sum() > 0
