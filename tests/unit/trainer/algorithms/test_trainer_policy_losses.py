"""Per-token policy losses on hand-computed values and gradients: PPO-clip with dual-clip, GSPO, CISPO, REINFORCE;
the contract every loss keeps (shape, masked tokens inert, no NaN from padding or empty rows); and the registry
`compute_policy_loss`, which has a case for every section of the config's `PolicyLossConfig` and hands each loss
exactly its section's knobs."""

from __future__ import annotations

import math
import typing
from collections.abc import Callable

import pytest
import torch

from sharpen.config.policy_losses import PolicyLossConfig
from sharpen.trainer.algorithms.aggregation import aggregate_loss, aggregation_normalizer
from sharpen.trainer.algorithms.covariance import select_clip_cov_tokens, select_kl_cov_tokens
from sharpen.trainer.algorithms.policy_losses import (
    PolicyLossMetrics,
    cispo_per_token,
    clip_cov_per_token,
    compute_policy_loss,
    gmpo_per_token,
    gspo_per_token,
    kl_cov_per_token,
    pg_per_token,
    ppo_clip_per_token,
    sapo_per_token,
    select_tokens,
)

F64 = torch.float64


def _leaf(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64, requires_grad=True)


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def _ones_mask(batch: int, seq: int) -> torch.Tensor:
    return torch.ones(batch, seq, dtype=torch.bool)


def _grad(per_token: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(per_token.sum(), leaf)
    return grad


# --- PPO-clip ----------------------------------------------------------------------------------------------------

# ratios r = [1.5, 0.5, 1.1] (old logprobs 0), advantages [+2, -1, +1], eps 0.2:
#   token 0: -min(3.0, 1.2 * 2) = -2.4, clipped high (no gradient)
#   token 1: -min(-0.5, 0.8 * -1) = 0.8, clipped low (no gradient)
#   token 2: -min(1.1, 1.1) = -1.1, unclipped: d(-r A)/d logprob = -r A = -1.1
_RATIOS = [math.log(1.5), math.log(0.5), math.log(1.1)]
_ADVANTAGES = [[2.0, -1.0, 1.0]]


def test_ppo_clip_hand_computed_values_metrics_and_gradient():
    logprobs = _leaf([_RATIOS])
    per_token, metrics = ppo_clip_per_token(
        logprobs, torch.zeros(1, 3, dtype=F64), _t(_ADVANTAGES), _ones_mask(1, 3), clip_eps_low=0.2, clip_eps_high=0.2
    )
    torch.testing.assert_close(per_token, _t([[-2.4, 0.8, -1.1]]))
    assert (metrics.num_clipped_low.item(), metrics.num_clipped_high.item()) == (1.0, 1.0)
    assert metrics.num_dual_clipped.item() == 0.0
    assert metrics.ratio_sum.item() == pytest.approx(1.5 + 0.5 + 1.1, abs=1e-12)
    torch.testing.assert_close(_grad(per_token, logprobs), _t([[0.0, 0.0, -1.1]]))


def _reference_ppo_clip_loss(logprobs, old_logprobs, advantages, mask, *, clip_eps_low, clip_eps_high, normalizer):
    """The pre-split loss (sharpen's former ``compute_ppo_clip_loss``): masked sum of the PPO terms / normalizer."""
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs.detach())
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    loss = (-torch.minimum(unclipped, clipped) * mask).sum() / normalizer
    return loss, ((clipped < unclipped).to(logprobs.dtype) * mask).sum(), (ratio.detach() * mask).sum()


def test_ppo_clip_with_token_mean_aggregation_matches_the_former_fused_loss():
    generator = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(3, 5, generator=generator, dtype=F64) * 2).requires_grad_(True)
    old = logprobs.detach() + torch.randn(3, 5, generator=generator, dtype=F64) * 0.3
    advantages = torch.randn(3, 1, generator=generator, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    per_token, metrics = ppo_clip_per_token(logprobs, old, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    normalizer = aggregation_normalizer("token_mean", mask)
    loss = aggregate_loss(per_token, mask, "token_mean", normalizer=normalizer)
    reference, num_clipped, ratio_sum = _reference_ppo_clip_loss(
        logprobs, old, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.28, normalizer=normalizer
    )
    assert num_clipped > 0
    torch.testing.assert_close(loss, reference)
    assert metrics.num_clipped_low + metrics.num_clipped_high == num_clipped
    torch.testing.assert_close(metrics.ratio_sum, ratio_sum)
    torch.testing.assert_close(torch.autograd.grad(loss, logprobs)[0], torch.autograd.grad(reference, logprobs)[0])


def test_dual_clip_bounds_the_loss_of_a_huge_ratio_with_negative_advantage():
    # r = e^5 ~ 148 with A = -1: plain PPO's loss is r |A| ~ 148 with gradient 148; dual-clip c = 3 caps it at 3
    # with no gradient. r = 2 (below c) keeps PPO's loss 2 and gradient 2; A > 0 is never dual-clipped.
    logprobs = _leaf([[5.0, math.log(2.0), 5.0]])
    advantages = _t([[-1.0, -1.0, 1.0]])

    def run(c: float | None) -> tuple[torch.Tensor, PolicyLossMetrics, torch.Tensor]:
        per_token, metrics = ppo_clip_per_token(
            logprobs,
            torch.zeros(1, 3, dtype=F64),
            advantages,
            _ones_mask(1, 3),
            clip_eps_low=0.2,
            clip_eps_high=0.2,
            dual_clip_c=c,
        )
        return per_token, metrics, _grad(per_token, logprobs)

    plain, plain_metrics, plain_grad = run(None)
    torch.testing.assert_close(plain, _t([[math.exp(5.0), 2.0, -1.2]]))
    torch.testing.assert_close(plain_grad, _t([[math.exp(5.0), 2.0, 0.0]]))
    assert plain_metrics.num_dual_clipped.item() == 0.0

    dual, dual_metrics, dual_grad = run(3.0)
    torch.testing.assert_close(dual, _t([[3.0, 2.0, -1.2]]))
    torch.testing.assert_close(dual_grad, _t([[0.0, 2.0, 0.0]]))
    assert dual_metrics.num_dual_clipped.item() == 1.0
    assert dual_metrics.num_clipped_high.item() == 1.0  # token 2, A > 0


def test_dual_clip_with_per_sequence_advantages_and_invalid_c():
    # [batch, 1] advantages broadcast: row 0 (A = -2) is capped at 3 * 2 = 6, row 1 (A = +2) is untouched
    logprobs = _leaf([[5.0, 0.0], [5.0, 0.0]])
    per_token, metrics = ppo_clip_per_token(
        logprobs,
        torch.zeros(2, 2, dtype=F64),
        _t([[-2.0], [2.0]]),
        _ones_mask(2, 2),
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        dual_clip_c=3.0,
    )
    torch.testing.assert_close(per_token, _t([[6.0, 2.0], [-2.4, -2.0]]))
    assert metrics.num_dual_clipped.item() == 1.0
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_clip_per_token(
            logprobs, logprobs, _t([[1.0]]), _ones_mask(2, 2), clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=1.0
        )


# --- GSPO --------------------------------------------------------------------------------------------------------


def test_gspo_ratio_is_the_geometric_mean_over_the_sequence_and_clipped_per_sequence():
    # row 0: token log-ratios [0.1, 0.3] -> s = exp(0.2) ~ 1.221 > 1 + 0.1, A = +1: both tokens clipped, loss -1.1
    # row 1: log-ratios [0.02, -0.02, (padding 9.0)] -> s = 1 inside the range, A = -1: loss s |A| = 1, grad s |A|
    logprobs = _leaf([[0.1, 0.3, 0.0], [0.02, -0.02, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    per_token, metrics = gspo_per_token(
        logprobs, torch.zeros(2, 3, dtype=F64), _t([[1.0], [-1.0]]), mask, clip_eps_low=0.1, clip_eps_high=0.1
    )
    torch.testing.assert_close(per_token, _t([[-1.1, -1.1, 0.0], [1.0, 1.0, 0.0]]))
    assert metrics.num_clipped_high.item() == 2.0 and metrics.num_clipped_low.item() == 0.0  # counted per token
    assert metrics.ratio_sum.item() == pytest.approx(2 * math.exp(0.2) + 2 * 1.0, abs=1e-12)
    torch.testing.assert_close(_grad(per_token, logprobs), _t([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))


def test_gspo_token_gradient_is_the_sequence_ratio_not_the_token_ratio():
    # unclipped (wide eps), A = 2: d loss_t / d logprob_t = -s A for every token, whatever its own ratio
    logprobs = _leaf([[0.1, 0.3, -0.4]])
    per_token, _ = gspo_per_token(
        logprobs, torch.zeros(1, 3, dtype=F64), _t([[2.0]]), _ones_mask(1, 3), clip_eps_low=0.5, clip_eps_high=0.5
    )
    s = 1.0  # exp(mean(0.1, 0.3, -0.4)) = exp(0)
    torch.testing.assert_close(per_token, _t([[-s * 2] * 3]))
    torch.testing.assert_close(_grad(per_token, logprobs), _t([[-s * 2] * 3]))


def test_gspo_equals_ppo_when_all_tokens_of_a_sequence_share_the_ratio():
    # every token of row i has log-ratio delta_i, so s_i equals each token ratio: GSPO and PPO coincide
    deltas = [0.5, -0.5, 0.05]
    old = _t([[-1.0, -2.0, -0.5, -1.5]] * 3)
    logprobs = (old + _t([[d] for d in deltas])).requires_grad_(True)
    advantages = _t([[1.0], [-1.0], [0.5]])
    kwargs = {"clip_eps_low": 0.2, "clip_eps_high": 0.2}
    gspo, gspo_metrics = gspo_per_token(logprobs, old, advantages, _ones_mask(3, 4), **kwargs)
    ppo, ppo_metrics = ppo_clip_per_token(logprobs, old, advantages, _ones_mask(3, 4), **kwargs)
    torch.testing.assert_close(gspo, ppo)
    torch.testing.assert_close(_grad(gspo, logprobs), _grad(ppo, logprobs))
    assert gspo_metrics.num_clipped_high == ppo_metrics.num_clipped_high == 4.0
    assert gspo_metrics.num_clipped_low == ppo_metrics.num_clipped_low == 4.0
    torch.testing.assert_close(gspo_metrics.ratio_sum, ppo_metrics.ratio_sum)


def test_gspo_token_form_with_seq_mean_token_mean_equals_the_sequence_objective():
    """GSPO's paper objective: mean over sequences of -min(s_i A_i, clip(s_i) A_i), differentiated through s_i."""
    generator = torch.Generator().manual_seed(1)
    logprobs = (-torch.rand(5, 6, generator=generator, dtype=F64) * 2).requires_grad_(True)
    old = logprobs.detach() + torch.randn(5, 6, generator=generator, dtype=F64) * 0.05
    advantages = _t([[1.0], [-1.0], [0.5], [-2.0], [1.0]])
    mask = torch.tensor(
        [[1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]],
        dtype=torch.bool,
    )
    eps = 0.01  # small enough that some sequences clip and others do not
    per_token, metrics = gspo_per_token(logprobs, old, advantages, mask, clip_eps_low=eps, clip_eps_high=eps)
    token_form = aggregate_loss(
        per_token, mask, "seq_mean_token_mean", normalizer=aggregation_normalizer("seq_mean_token_mean", mask)
    )

    m = mask.to(F64)
    lengths = m.sum(-1, keepdim=True)
    nonempty = lengths.squeeze(-1) > 0
    s = torch.exp(((logprobs - old) * m).sum(-1, keepdim=True) / lengths.clamp(min=1))  # [batch, 1]
    seq_loss = -torch.minimum(s * advantages, s.clamp(1 - eps, 1 + eps) * advantages).squeeze(-1)  # [batch]
    sequence_form = seq_loss[nonempty].mean()

    assert 0 < metrics.num_clipped_low + metrics.num_clipped_high < m.sum()  # both branches are exercised
    torch.testing.assert_close(token_form, sequence_form)
    grad_token = torch.autograd.grad(token_form, logprobs)[0]
    torch.testing.assert_close(grad_token, torch.autograd.grad(sequence_form, logprobs)[0])


# --- CISPO -------------------------------------------------------------------------------------------------------


def test_cispo_keeps_the_gradient_where_ppo_clips_it_away():
    # same tokens as the PPO case: PPO's gradient is [0, 0, -1.1]; CISPO's is -clip(r) A = [-1.2*2, 0.8, -1.1]
    logprobs = _leaf([_RATIOS])
    args = (logprobs, torch.zeros(1, 3, dtype=F64), _t(_ADVANTAGES), _ones_mask(1, 3))
    per_token, metrics = cispo_per_token(*args, clip_eps_high=0.2, clip_eps_low=0.2)
    weights = [1.2, 0.8, 1.1]
    expected = [-w * a * lp for w, a, lp in zip(weights, _ADVANTAGES[0], _RATIOS, strict=True)]
    torch.testing.assert_close(per_token, _t([expected]))
    torch.testing.assert_close(_grad(per_token, logprobs), _t([[-2.4, 0.8, -1.1]]))
    assert (metrics.num_clipped_low.item(), metrics.num_clipped_high.item()) == (1.0, 1.0)
    ppo, _ = ppo_clip_per_token(*args, clip_eps_low=0.2, clip_eps_high=0.2)
    torch.testing.assert_close(_grad(ppo, logprobs), _t([[0.0, 0.0, -1.1]]))


def test_cispo_weight_is_stop_gradient_and_unbounded_below_with_eps_low_one():
    # r = 0.1, A = 1, eps_low = 1 (MiniMax-M1: no lower bound): weight 0.1, gradient exactly -0.1 (no d r / d logp)
    logprobs = _leaf([[math.log(0.1)]])
    per_token, metrics = cispo_per_token(
        logprobs, torch.zeros(1, 1, dtype=F64), _t([[1.0]]), _ones_mask(1, 1), clip_eps_high=0.28, clip_eps_low=1.0
    )
    torch.testing.assert_close(_grad(per_token, logprobs), _t([[-0.1]]))
    assert metrics.num_clipped_low.item() == 0.0


# --- REINFORCE and on-policy agreement ----------------------------------------------------------------------------


def test_pg_is_minus_advantage_times_logprob():
    logprobs = _leaf([[-1.0, -2.0, -3.0]])
    per_token, metrics = pg_per_token(logprobs, _t([[2.0, -1.0, 5.0]]), torch.tensor([[True, True, False]]))
    torch.testing.assert_close(per_token, _t([[2.0, -2.0, 0.0]]))
    torch.testing.assert_close(_grad(per_token, logprobs), _t([[-2.0, 1.0, 0.0]]))
    assert metrics.ratio_sum.item() == 2.0 and metrics.num_clipped_high.item() == 0.0


def test_on_policy_every_loss_has_the_reinforce_gradient():
    # old == current logprobs: every ratio is 1, nothing clips, and d loss / d logprob = -A for all four losses
    generator = torch.Generator().manual_seed(2)
    logprobs = (-torch.rand(3, 4, generator=generator, dtype=F64)).requires_grad_(True)
    old = logprobs.detach().clone()
    advantages = torch.randn(3, 1, generator=generator, dtype=F64)
    mask = _ones_mask(3, 4)
    clip = {"clip_eps_low": 0.2, "clip_eps_high": 0.2}
    expected = _grad(pg_per_token(logprobs, advantages, mask)[0], logprobs)
    torch.testing.assert_close(expected, (-advantages).expand(3, 4))
    for per_token, _ in (
        ppo_clip_per_token(logprobs, old, advantages, mask, dual_clip_c=3.0, **clip),
        gspo_per_token(logprobs, old, advantages, mask, **clip),
        cispo_per_token(logprobs, old, advantages, mask, **clip),
        sapo_per_token(logprobs, old, advantages, mask, tau_pos=1.0, tau_neg=1.05),
        gmpo_per_token(logprobs, old, advantages, mask, log_clip_low=0.4, log_clip_high=0.4),
    ):
        torch.testing.assert_close(_grad(per_token, logprobs), expected)


# --- the contract of every loss -----------------------------------------------------------------------------------

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, PolicyLossMetrics]]
_LOSSES: dict[str, LossFn] = {
    "ppo": lambda lp, old, a, m: ppo_clip_per_token(lp, old, a, m, clip_eps_low=0.2, clip_eps_high=0.28),
    "ppo_dual": lambda lp, old, a, m: ppo_clip_per_token(
        lp, old, a, m, clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0
    ),
    "gspo": lambda lp, old, a, m: gspo_per_token(lp, old, a, m, clip_eps_low=3e-4, clip_eps_high=4e-4),
    "cispo": lambda lp, old, a, m: cispo_per_token(lp, old, a, m, clip_eps_high=0.28, clip_eps_low=1.0),
    "sapo": lambda lp, old, a, m: sapo_per_token(lp, old, a, m, tau_pos=1.0, tau_neg=1.05),
    "gmpo": lambda lp, old, a, m: gmpo_per_token(lp, old, a, m, log_clip_low=0.4, log_clip_high=0.4),
    "pg": lambda lp, old, a, m: pg_per_token(lp, a, m),
}


@pytest.mark.parametrize("name", list(_LOSSES))
@pytest.mark.parametrize("advantage_shape", ["per_sequence", "per_token"])
def test_contract_masked_tokens_are_inert_and_garbage_padding_gives_no_nan(name: str, advantage_shape: str):
    # row 1 is all padding (an empty completion); padding holds NaN/inf in both logprob tensors
    # valid log-ratios cancel within each row (GSPO's s_i = 1) and stay inside every clip range, so all get gradient
    logprobs = _leaf([[-1.0, -0.5, float("nan")], [float("nan"), float("-inf"), float("nan")], [-0.1, -2.0, -3.0]])
    old = _t([[-1.1, -0.4, float("inf")], [float("nan")] * 3, [-0.15, -1.95, float("-inf")]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    advantages = _t([[1.0], [-1.0], [-0.5]])
    if advantage_shape == "per_token":
        advantages = advantages.expand(3, 3).clone()
    per_token, metrics = _LOSSES[name](logprobs, old, advantages, mask)
    assert per_token.shape == (3, 3)
    assert torch.isfinite(per_token).all()
    assert torch.equal(per_token[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
    grad = _grad(per_token, logprobs)
    assert torch.isfinite(grad).all()
    assert torch.equal(grad[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
    assert grad[mask].abs().min() > 0  # every loss token does get a gradient here
    for value in (metrics.num_clipped_low, metrics.num_clipped_high, metrics.num_dual_clipped, metrics.ratio_sum):
        assert value.shape == () and not value.requires_grad and torch.isfinite(value)
    assert metrics.num_clipped_low + metrics.num_clipped_high <= mask.sum()


@pytest.mark.parametrize("name", list(_LOSSES))
def test_contract_metrics_are_at_least_float32_for_bfloat16_inputs(name: str):
    logprobs = torch.full((2, 300), -1.0, dtype=torch.bfloat16)
    per_token, metrics = _LOSSES[name](
        logprobs, logprobs - 0.5, torch.ones(2, 1, dtype=torch.bfloat16), _ones_mask(2, 300)
    )
    assert per_token.dtype == torch.bfloat16
    assert metrics.ratio_sum.dtype == torch.float32
    if name not in ("pg", "sapo"):  # SAPO has no clip
        assert metrics.num_clipped_high.item() == 600.0  # r = e^0.5 > 1 + eps everywhere; exact above 256


def test_invalid_clip_ranges_raise():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="clip_eps_low"):
        ppo_clip_per_token(x, x, x, x.bool(), clip_eps_low=1.5, clip_eps_high=0.2)
    with pytest.raises(ValueError, match="clip_eps_high"):
        gspo_per_token(x, x, x, x.bool(), clip_eps_low=0.1, clip_eps_high=-0.1)


# --- the registry ------------------------------------------------------------------------------------------------

_SECTIONS: tuple[type[PolicyLossConfig], ...] = typing.get_args(typing.get_args(PolicyLossConfig)[0])
# The knobs of the registry test; each section takes those it carries and keeps its paper's defaults for the rest.
_REGISTRY_KNOBS = {"clip_eps_low": 0.1, "clip_eps_high": 0.3, "dual_clip_c": 3.0}
# Ratios far outside [1 - eps_low, 1 + eps_high] and a negative advantage, so that every bound (dual-clip too) acts.
_REGISTRY_LOGPROBS = [[-0.1, -3.0, -1.0], [-2.0, -0.5, -4.0]]
_REGISTRY_OLD_LOGPROBS = [[-1.5, -1.0, -1.0], [-0.5, -2.5, -4.0]]
_REGISTRY_ADVANTAGES = [[-2.0], [1.0]]
_REGISTRY_MASK = [[True, True, False], [True, True, True]]
_DIRECT: dict[str, Callable[..., tuple[torch.Tensor, PolicyLossMetrics]]] = {
    "ppo_clip": lambda lp, old, adv, mask: ppo_clip_per_token(
        lp, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.3, dual_clip_c=3.0
    ),
    "gspo": lambda lp, old, adv, mask: gspo_per_token(lp, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.3),
    "cispo": lambda lp, old, adv, mask: cispo_per_token(lp, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.3),
    "sapo": lambda lp, old, adv, mask: sapo_per_token(lp, old, adv, mask, tau_pos=1.0, tau_neg=1.05),
    "gmpo": lambda lp, old, adv, mask: gmpo_per_token(lp, old, adv, mask, log_clip_low=0.4, log_clip_high=0.4),
    "clip_cov": lambda lp, old, adv, mask: clip_cov_per_token(
        lp,
        old,
        adv,
        mask,
        selected=select_clip_cov_tokens(old, adv, mask, fraction=2e-4, cov_low=1.0, cov_high=5.0),
        clip_eps_low=0.1,
        clip_eps_high=0.3,
    ),
    "kl_cov": lambda lp, old, adv, mask: kl_cov_per_token(
        lp, old, adv, mask, selected=select_kl_cov_tokens(old, adv, mask, fraction=2e-3), coef=1.0
    ),
    "pg": lambda lp, old, adv, mask: pg_per_token(lp, adv, mask),
}


def _type(section: type[PolicyLossConfig]) -> str:
    return typing.get_args(section.model_fields["type"].annotation)[0]


@pytest.mark.parametrize("section", _SECTIONS, ids=_type)
def test_every_section_of_the_union_has_a_case(section: type[PolicyLossConfig]):
    """The registry knows every member of `PolicyLossConfig` with its paper's defaults (pyright's assert_never
    checks it statically; this at run time), and `select_tokens` selects exactly for the losses that say so."""
    inputs = (
        _leaf(_REGISTRY_LOGPROBS),
        _t(_REGISTRY_OLD_LOGPROBS),
        _t(_REGISTRY_ADVANTAGES),
        torch.tensor(_REGISTRY_MASK),
    )
    per_token, _ = compute_policy_loss(section(), *inputs)
    assert per_token.shape == inputs[0].shape and torch.isfinite(per_token).all()
    assert torch.isfinite(_grad(per_token, inputs[0])).all()
    selected = select_tokens(section(), inputs[0].detach(), inputs[2], inputs[3])
    assert (selected is not None) == section.selects_tokens


@pytest.mark.parametrize("section", _SECTIONS, ids=_type)
def test_the_registry_gives_each_loss_exactly_its_arguments(section: type[PolicyLossConfig]):
    """Bit-identical to calling the loss directly with the section's values: the registry does no arithmetic."""
    name = _type(section)
    assert name in _DIRECT, f"add the direct call of the new loss {name!r}"
    loss = section.model_validate({k: v for k, v in _REGISTRY_KNOBS.items() if k in section.model_fields})
    inputs = (
        _leaf(_REGISTRY_LOGPROBS),
        _t(_REGISTRY_OLD_LOGPROBS),
        _t(_REGISTRY_ADVANTAGES),
        torch.tensor(_REGISTRY_MASK),
    )
    direct_inputs = (_leaf(_REGISTRY_LOGPROBS), *inputs[1:])
    per_token, metrics = compute_policy_loss(loss, *inputs)
    expected, expected_metrics = _DIRECT[name](*direct_inputs)
    assert torch.equal(per_token, expected)
    assert torch.equal(_grad(per_token, inputs[0]), _grad(expected, direct_inputs[0]))
    for field in PolicyLossMetrics.__slots__:
        assert torch.equal(getattr(metrics, field), getattr(expected_metrics, field)), field
