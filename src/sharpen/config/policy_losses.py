"""The policy losses of ``trainer.algorithm.policy_loss``: one section per loss, chosen by ``type``, each carrying only
its own knobs with its paper's defaults and the loss aggregation its paper uses.

Adding a loss: its section here (and in `PolicyLossConfig`), its function and ``case`` in
``trainer/algorithms/policy_losses.py: compute_policy_loss`` (pyright's exhaustiveness check names a missing one),
and a test. docs/algorithms.md gives each formula.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from sharpen.config.section import Section

AggregationMode = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
"""How per-token losses become one number (``trainer.algorithm.loss_aggregation``)."""


class _PolicyLossSection(Section):
    paper_aggregation: ClassVar[AggregationMode] = "token_mean"
    """The aggregation the loss's paper uses: ``trainer.algorithm.loss_aggregation`` when that is left out."""
    sequence_level: ClassVar[bool] = False
    """A sequence objective: its ratio is per sequence, so it needs its paper's aggregation (GSPO, GMPO)."""
    selects_tokens: ClassVar[bool] = False
    """The loss treats a few tokens of each mini-batch apart, selected over the whole mini-batch (Clip-Cov,
    KL-Cov), so the trainer selects them before the first micro-batch."""


class PPOClipLoss(_PolicyLossSection):
    """PPO's clipped surrogate (Schulman et al. 2017) with the token ratio; clip-higher (DAPO) when clip_eps_high is
    above clip_eps_low; dual-clip (Ye et al. 2020) with dual_clip_c."""

    type: Literal["ppo_clip"] = "ppo_clip"
    clip_eps_low: float = Field(default=0.2, ge=0.0, le=1.0)
    """The ratio is clipped below at 1 - clip_eps_low (the paper's 0.2)."""
    clip_eps_high: float = Field(default=0.2, ge=0.0)
    """The ratio is clipped above at 1 + clip_eps_high (the paper's 0.2; DAPO's clip-higher: 0.28)."""
    dual_clip_c: float | None = Field(default=None, gt=1.0)
    """Dual-clip PPO: for negative advantages the loss is bounded by c * |A| (the paper's 3; None: off)."""


class GSPOLoss(_PolicyLossSection):
    """GSPO (Zheng et al. 2025): the sequence's geometric-mean ratio, clipped per sequence; a sequence objective,
    averaged over sequences (``seq_mean_token_mean``)."""

    paper_aggregation: ClassVar[AggregationMode] = "seq_mean_token_mean"
    sequence_level: ClassVar[bool] = True
    type: Literal["gspo"] = "gspo"
    clip_eps_low: float = Field(default=3e-4, ge=0.0, le=1.0)
    """The sequence ratio is clipped below at 1 - clip_eps_low (the paper's 3e-4: sequence ratios stay far closer
    to 1 than token ratios)."""
    clip_eps_high: float = Field(default=4e-4, ge=0.0)
    """The sequence ratio is clipped above at 1 + clip_eps_high (the paper's 4e-4)."""


class CISPOLoss(_PolicyLossSection):
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight; no token loses its
    gradient."""

    type: Literal["cispo"] = "cispo"
    clip_eps_low: float = Field(default=1.0, ge=0.0, le=1.0)
    """The weight is clipped below at 1 - clip_eps_low (the paper sets no lower bound: 1.0)."""
    clip_eps_high: float = Field(default=0.28, ge=0.0)
    """The weight is clipped above at 1 + clip_eps_high (the paper tunes only this and gives no value; 0.28 as in
    the CISPO losses of Trinity-RFT and torchforge)."""


class SAPOLoss(_PolicyLossSection):
    """SAPO (Gao et al. 2025): a soft sigmoid gate of the ratio instead of the clip, averaged per sequence."""

    paper_aggregation: ClassVar[AggregationMode] = "seq_mean_token_mean"
    type: Literal["sapo"] = "sapo"
    tau_pos: float = Field(default=1.0, gt=0.0)
    """Gate temperature for tokens with a positive advantage (the paper's 1.0)."""
    tau_neg: float = Field(default=1.05, gt=0.0)
    """Gate temperature for tokens with a zero or negative advantage (the paper's 1.05: damped harder)."""


class GMPOLoss(_PolicyLossSection):
    """GMPO (Zhao et al. 2025): the geometric mean of log-space-clipped token ratios; a sequence objective."""

    paper_aggregation: ClassVar[AggregationMode] = "seq_mean_token_mean"
    sequence_level: ClassVar[bool] = True
    type: Literal["gmpo"] = "gmpo"
    log_clip_low: float = Field(default=0.4, ge=0.0)
    """Token log-ratios are clipped below at -log_clip_low (the paper's ratio range is (e^-0.4, e^0.4))."""
    log_clip_high: float = Field(default=0.4, ge=0.0)
    """Token log-ratios are clipped above at log_clip_high."""


class ClipCovLoss(_PolicyLossSection):
    """Clip-Cov (Cui et al. 2025): PPO's clipped loss with the gradient of a few high-covariance tokens detached."""

    selects_tokens: ClassVar[bool] = True
    type: Literal["clip_cov"] = "clip_cov"
    clip_eps_low: float = Field(default=0.2, ge=0.0, le=1.0)
    """PPO's lower clip bound: 1 - clip_eps_low."""
    clip_eps_high: float = Field(default=0.2, ge=0.0)
    """PPO's upper clip bound: 1 + clip_eps_high."""
    fraction: float = Field(default=2e-4, gt=0.0, le=1.0)
    """Fraction of a mini-batch's loss tokens (at least 1) whose gradient is detached, drawn at random among those
    with covariance inside (cov_min, cov_max) (the paper's 2e-4)."""
    cov_min: float = 1.0
    """Lower bound of the covariance of the tokens that may be drawn (the paper's 1)."""
    cov_max: float = 5.0
    """Upper bound of the covariance of the tokens that may be drawn (the paper's 5)."""

    @model_validator(mode="after")
    def _check_bounds(self) -> ClipCovLoss:
        if self.cov_min >= self.cov_max:
            raise ValueError(f"cov_min = {self.cov_min} must be below cov_max = {self.cov_max}")
        return self


class KLCovLoss(_PolicyLossSection):
    """KL-Cov (Cui et al. 2025): the unclipped ratio loss with a |log r| penalty on the highest-covariance tokens."""

    selects_tokens: ClassVar[bool] = True
    type: Literal["kl_cov"] = "kl_cov"
    fraction: float = Field(default=2e-3, gt=0.0, le=1.0)
    """Fraction of a mini-batch's loss tokens (at least 1), those of largest covariance, that get the penalty (the
    paper's 2e-3 for 7B models; 2e-4 for 32B)."""
    coef: float = Field(default=1.0, ge=0.0)
    """Weight of the |log r| penalty on the selected tokens (the paper's 1)."""


class PGLoss(_PolicyLossSection):
    """Plain on-policy policy gradient (REINFORCE): no ratio, no clip."""

    type: Literal["pg"] = "pg"


PolicyLossConfig = Annotated[
    PPOClipLoss | GSPOLoss | CISPOLoss | SAPOLoss | GMPOLoss | ClipCovLoss | KLCovLoss | PGLoss,
    Field(discriminator="type"),
]
"""``trainer.algorithm.policy_loss``: a table with ``type``, or the name alone for the loss with its paper's knobs."""
