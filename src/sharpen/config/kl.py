"""The KL term of ``trainer.algorithm.kl``: none, a loss term, or a per-token reward penalty, against a frozen
reference policy (the model's initial weights).

Adding a form: its section here (and in `KLConfig`), where the trainer applies it (``trainer/objective.py``), and a
test. docs/algorithms.md gives each estimator.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from sharpen.config.section import Section

KLEstimator = Literal["k1", "k2", "k3"]


class NoKL(Section):
    """No KL term: no reference model is loaded and no reference forward runs."""

    needs_reference: ClassVar[bool] = False
    in_reward: ClassVar[bool] = False
    type: Literal["none"] = "none"


class _KLTermSection(Section):
    needs_reference: ClassVar[bool] = True
    in_reward: ClassVar[bool] = False

    coef: float = Field(gt=0.0)
    """Weight of the KL (its starting value when target is set)."""
    estimator: KLEstimator = "k2"
    """Per-token KL estimator. k2's gradient is the true reverse-KL gradient on on-policy samples; k3 (GRPO's
    choice) is an unbiased value but a biased gradient; k1's expected gradient is zero (docs/algorithms.md)."""
    target: float | None = Field(default=None, gt=0.0)
    """Adaptive coefficient (Ziegler et al. 2019): steer the measured KL towards this target (None: fixed coef)."""
    horizon: int = Field(default=10000, ge=1)
    """Horizon (in samples) of the adaptive controller (the paper's 10000)."""


class KLLoss(_KLTermSection):
    """KL(policy || reference) as a loss term: + coef * estimator(log pi - log pi_ref), aggregated like the policy
    loss (GRPO, DAPO-style runs that keep a KL)."""

    type: Literal["loss"] = "loss"


class KLReward(_KLTermSection):
    """The KL as a per-token reward penalty, -coef * KL_t(engine || reference), added before the advantages
    (REINFORCE++, PPO-RLHF) instead of a loss term."""

    in_reward: ClassVar[bool] = True
    type: Literal["reward"] = "reward"


KLConfig = Annotated[NoKL | KLLoss | KLReward, Field(discriminator="type")]
"""``trainer.algorithm.kl``: a table with ``type`` (and ``coef``), or ``"none"``."""
