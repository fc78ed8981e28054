"""The four registries of the objective's typed sections on tiny hand-made inputs: every member of each union
(`AdvantageConfig`, `PolicyLossConfig`, `CorrectionConfig`, `KLConfig`), built with its defaults, goes through its
registry; and a section's knobs, not some other default, reach the function (GSPO's paper clip range, the TIS cap,
the KL coefficient and target)."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from sharpen.config.advantages import (
    AdvantageConfig,
    GAEAdvantage,
    PassKAdvantage,
    ReMaxAdvantage,
    TurnAdvantageConfig,
)
from sharpen.config.corrections import CorrectionConfig, TokenTISCorrection
from sharpen.config.kl import KLConfig, KLLoss, KLReward, NoKL
from sharpen.config.policy_losses import GSPOLoss, PolicyLossConfig, PPOClipLoss
from sharpen.trainer.algorithms.estimators import compute_advantages
from sharpen.trainer.algorithms.kl import AdaptiveKLController, FixedKLController, build_kl_controller, kl_per_token
from sharpen.trainer.algorithms.offpolicy import compute_correction
from sharpen.trainer.algorithms.policy_losses import compute_policy_loss, select_tokens
from sharpen.trainer.algorithms.turn_estimators import compute_turn_advantages

F64 = torch.float64
NAN = float("nan")


def _members(union: object) -> tuple[type, ...]:
    """The section classes of an ``Annotated[A | B | ..., Field(discriminator="type")]`` union."""
    return typing.get_args(typing.get_args(union)[0])


def _type(section: type) -> str:
    return typing.get_args(section.model_fields["type"].annotation)[0]


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# --- every member goes through its registry ------------------------------------------------------------------------


def _advantage(section: type[AdvantageConfig]) -> AdvantageConfig:
    """The section with its defaults; PassKAdvantage has no default k (1 is GRPO with the population std)."""
    return section.model_validate({"k": 1} if section is PassKAdvantage else {})


@pytest.mark.parametrize("section", _members(AdvantageConfig), ids=_type)
def test_every_advantage_section_goes_through_compute_advantages(section: type[AdvantageConfig]):
    scores = _t([[1.0, 0.0, NAN, 1.0], [0.5, 2.0, 1.0, 0.0]])  # one abstention
    baselines = torch.tensor([0.5, 1.0], dtype=F64) if section is ReMaxAdvantage else None
    if section is GAEAdvantage:  # its case refuses: GAE's advantages come from the critic, in the trainer
        with pytest.raises(ValueError, match="critic"):
            compute_advantages(_advantage(section), scores, baselines=baselines)
        return
    if section.needs_turns:  # its case refuses: per-turn advantages go through compute_turn_advantages (below)
        with pytest.raises(ValueError, match="turn-level estimator"):
            compute_advantages(_advantage(section), scores, baselines=baselines)
        return
    advantages = compute_advantages(_advantage(section), scores, baselines=baselines)
    assert advantages.shape == scores.shape
    assert torch.equal(torch.isnan(advantages), torch.isnan(scores))
    assert torch.isfinite(advantages[~torch.isnan(scores)]).all()


@pytest.mark.parametrize("section", typing.get_args(TurnAdvantageConfig), ids=_type)
def test_every_turn_advantage_section_goes_through_compute_turn_advantages_with_its_gamma(section: type):
    assert section.needs_turns and section in _members(AdvantageConfig)
    # two one-group samples: turns [0, 1] and [0]; every first turn from the same state
    rewards, mask = _t([[[0.0, 1.0], [0.0, 0.0]]]), torch.tensor([[[True, True], [True, False]]])
    states = torch.tensor([[[0, 1], [0, -1]]])
    advantages = compute_turn_advantages(section(), rewards, mask, states)
    assert torch.isfinite(advantages).all() and advantages[0, 1, 1] == 0.0  # past the second sample's last turn
    # gamma = 0: the first turn's return drops from 0.95 (the default's) to 0, its advantage with it
    undiscounted = compute_turn_advantages(section(gamma=0.0), rewards, mask, states)
    assert undiscounted[0, 0, 0] < advantages[0, 0, 0]


@pytest.mark.parametrize("section", _members(PolicyLossConfig), ids=_type)
def test_every_policy_loss_section_goes_through_compute_policy_loss(section: type[PolicyLossConfig]):
    logprobs = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]], dtype=F64, requires_grad=True)
    old = _t([[-1.1, -0.4, -2.0], [-0.2, -1.5, -9.0]])
    advantages = _t([[1.0], [-0.5]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    loss = section()
    selected = select_tokens(loss, old, advantages, mask, generator=torch.Generator().manual_seed(0))
    assert (selected is not None) == loss.selects_tokens
    per_token, metrics = compute_policy_loss(loss, logprobs, old, advantages, mask, selected=selected)
    assert per_token.shape == (2, 3) and torch.isfinite(per_token).all()
    assert per_token[1, 2].item() == 0.0  # the masked token
    (grad,) = torch.autograd.grad(per_token.sum(), logprobs)
    assert torch.isfinite(grad).all() and grad[mask].abs().sum() > 0
    assert torch.isfinite(metrics.ratio_sum)


@pytest.mark.parametrize("section", _members(CorrectionConfig), ids=_type)
def test_every_correction_section_goes_through_compute_correction(section: type[CorrectionConfig]):
    engine = torch.full((2, 3), -1.5, dtype=F64)
    trainer = engine + _t([[0.1, -0.2, 0.0], [1.0, 0.05, 3.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = compute_correction(section(), trainer, engine, mask)
    assert out.weights.shape == (2, 3) and torch.isfinite(out.weights).all() and (out.weights >= 0).all()
    assert not (out.mask & ~mask).any() and (out.weights[~out.mask] == 0).all()
    assert all(math.isfinite(value) for value in out.metrics.values())


_KL_SECTIONS: dict[type, KLConfig] = {NoKL: NoKL(), KLLoss: KLLoss(coef=0.1), KLReward: KLReward(coef=0.1)}


@pytest.mark.parametrize("section", _members(KLConfig), ids=_type)
def test_every_kl_section_goes_through_build_kl_controller(section: type[KLConfig]):
    assert section in _KL_SECTIONS, f"add the new KL section {section.__name__}"
    kl = _KL_SECTIONS[section]
    controller = build_kl_controller(kl)
    assert isinstance(controller, FixedKLController)
    assert controller.coef == (0.0 if isinstance(kl, NoKL) else 0.1)
    if isinstance(kl, KLLoss | KLReward):
        # the section's estimator, on log-ratios [0.2, -0.2]: k2 (the default) is 0.5 * 0.04 = 0.02 on each
        per_token = controller.coef * kl_per_token(_t([[-1.0, -1.4]]), _t([[-1.2, -1.2]]), kl.estimator)
        torch.testing.assert_close(per_token, _t([[0.1 * 0.02, 0.1 * 0.02]]), rtol=0, atol=1e-15)


# --- the knobs reach their functions -------------------------------------------------------------------------------


def test_gspo_default_clip_range_clips_a_sequence_ratio_of_1_001():
    """GSPO's paper range [1 - 3e-4, 1 + 4e-4] (not PPO's 0.2) clips the sequence ratio s = 1.001 for A > 0 and
    s = 0.999 for A < 0. Per token, loss = -min(s A, clip(s) A):
        row 0, A = +1: -min(1.001, 1.0004) = -1.0004, clipped high, no gradient;
        row 1, A = -1: -min(-0.999, -0.9997) = 0.9997, clipped low, no gradient.
    The token log-ratios differ (+-0.01 around log s); only their mean, the sequence ratio, is clipped."""
    up, down = math.log(1.001), math.log(0.999)
    old = _t([[-1.0, -2.0], [-1.0, -2.0]])
    logprobs = (old + _t([[up + 0.01, up - 0.01], [down + 0.01, down - 0.01]])).requires_grad_(True)
    advantages = _t([[1.0], [-1.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    per_token, metrics = compute_policy_loss(GSPOLoss(), logprobs, old, advantages, mask)
    torch.testing.assert_close(per_token, _t([[-1.0004, -1.0004], [0.9997, 0.9997]]), rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(per_token.sum(), logprobs)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert (metrics.num_clipped_high.item(), metrics.num_clipped_low.item()) == (2.0, 2.0)
    # a range of 0.2 given to the section leaves the same sequence ratios unclipped: -s A
    wide = GSPOLoss(clip_eps_low=0.2, clip_eps_high=0.2)
    unclipped, _ = compute_policy_loss(wide, logprobs, old, advantages, mask)
    torch.testing.assert_close(unclipped, _t([[-1.001, -1.001], [0.999, 0.999]]), rtol=0, atol=1e-12)
    # and PPO's default section (0.2 on token ratios) clips nothing either: -r_t A
    token_ratios = (logprobs - old).detach().exp()
    ppo, _ = compute_policy_loss(PPOClipLoss(), logprobs, old, advantages, mask)
    torch.testing.assert_close(ppo, -token_ratios * advantages, rtol=0, atol=1e-12)


def test_token_tis_cap_is_the_sections():
    # log-ratios [1, 0.2, -1]: ratios e = 2.718 (above either cap), e^0.2 = 1.221 and e^-1 (below both)
    engine = torch.full((1, 3), -1.5, dtype=F64)
    trainer = engine + _t([[1.0, 0.2, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    capped = compute_correction(TokenTISCorrection(cap=1.5), trainer, engine, mask)
    torch.testing.assert_close(capped.weights, _t([[1.5, math.exp(0.2), math.exp(-1.0)]]), rtol=0, atol=1e-12)
    assert capped.metrics["offpolicy/capped_fraction"] == pytest.approx(1 / 3)
    default = compute_correction(TokenTISCorrection(), trainer, engine, mask)  # the paper's C = 2
    torch.testing.assert_close(default.weights, _t([[2.0, math.exp(0.2), math.exp(-1.0)]]), rtol=0, atol=1e-12)


def test_kl_target_and_coef_override_reach_the_adaptive_controller():
    kl = KLLoss(coef=0.1, target=6.0, horizon=100)
    controller = build_kl_controller(kl)
    assert isinstance(controller, AdaptiveKLController)
    assert (controller.coef, controller.target, controller.horizon) == (0.1, 6.0, 100.0)
    # KL 9 against the target 6: the error 0.5 is clipped to 0.2; over 10 of the horizon's 100 steps beta grows 2%
    controller.update(9.0, 10)
    assert controller.coef == pytest.approx(0.1 * 1.02, rel=1e-15)
    assert build_kl_controller(kl, coef=0.25).coef == 0.25  # a resumed controller starts from its saved coef
