"""The advantage estimators of ``trainer.algorithm.advantage``: one section per estimator, chosen by ``type``, each
carrying only its own knobs with its paper's defaults.

Adding an estimator: its section here (and in `AdvantageConfig`), its function and ``case`` in
``trainer/algorithms/estimators.py: compute_advantages`` (a turn-level one, ``needs_turns``: in
``TurnAdvantageConfig`` and ``trainer/algorithms/turn_estimators.py: compute_turn_advantages``), and a test.
docs/algorithms.md gives each formula.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from sharpen.config.section import Section

StdConvention = Literal["unbiased", "population"]
"""How a standard deviation over k values is taken: ``unbiased`` divides the squared deviations by k - 1 (Bessel's
correction; torch.std's default, what veRL's GRPO advantage and TRL's GRPOTrainer compute), ``population`` by k."""


class _AdvantageSection(Section):
    needs_critic: ClassVar[bool] = False
    """The advantages are per token from a learned value model (trainer.critic), computed by the trainer."""
    needs_greedy_baseline: ClassVar[bool] = False
    """Each group also needs the score of its greedy completion (ReMax)."""
    needs_turns: ClassVar[bool] = False
    """The advantages are per turn of a multi-turn episode, from each turn's reward: every trained token of a turn
    gets its turn's advantage (the environment's tokens are not trained on)."""


class GRPOAdvantage(_AdvantageSection):
    """GRPO (Shao et al. 2024): the score minus its group's mean, divided by the group's std."""

    type: Literal["grpo"] = "grpo"
    std: StdConvention = "unbiased"
    """Standard-deviation convention of the group std: ``unbiased`` divides the squared deviations by k - 1 (veRL's
    GRPO advantage, TRL's GRPOTrainer, torch.std), ``population`` by k."""


class DrGRPOAdvantage(_AdvantageSection):
    """Dr.GRPO (Liu et al. 2025): the score minus its group's mean, not divided by the std."""

    type: Literal["drgrpo"] = "drgrpo"


class RLOOAdvantage(_AdvantageSection):
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): the score minus the mean of the group's other scores."""

    type: Literal["rloo"] = "rloo"


class ReinforcePPAdvantage(_AdvantageSection):
    """REINFORCE++ (Hu 2025): per-token returns of the score and the KL penalty, normalised over the batch's
    tokens; no group baseline."""

    type: Literal["reinforce_pp"] = "reinforce_pp"
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """Discount per trained token of the return G_t = sum_{k >= t} gamma^(k - t) rew_k, rew_k the KL penalty of
    token k (trainer.algorithm.kl.type = "reward") plus the score on the last token (the paper's 1.0: every token
    sees the whole score)."""
    std: StdConvention = "unbiased"
    """Standard-deviation convention of the batch std: ``unbiased`` (k - 1) or ``population`` (k)."""


class ReinforcePPBaselineAdvantage(_AdvantageSection):
    """REINFORCE++-baseline (Hu 2025): REINFORCE++ with the group mean subtracted from the score first."""

    type: Literal["reinforce_pp_baseline"] = "reinforce_pp_baseline"
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """Discount per trained token of the return (the paper's 1.0); as in reinforce_pp."""
    std: StdConvention = "unbiased"
    """Standard-deviation convention of the batch std: ``unbiased`` (k - 1) or ``population`` (k)."""


class ReMaxAdvantage(_AdvantageSection):
    """ReMax (Li et al. 2024): the score minus the score of the group's greedy completion."""

    needs_greedy_baseline: ClassVar[bool] = True
    type: Literal["remax"] = "remax"


class PassKAdvantage(_AdvantageSection):
    """Pass@k training (Chen et al. 2025): the analytic advantage of the best-of-k reward; a score >= 1 counts as
    correct."""

    type: Literal["passk"] = "passk"
    k: int = Field(ge=1)
    """The k of pass@k, 1 <= k < rollout.num_samples_per_prompt (k = the group size makes every group's estimate 0
    or 1, so every advantage 0); 1 is GRPO with the population std."""


class GAEAdvantage(_AdvantageSection):
    """GAE (Schulman et al. 2016): per-token advantages from a learned value model, PPO with a critic; the critic is
    configured in trainer.critic (its gamma and lambda there)."""

    needs_critic: ClassVar[bool] = True
    type: Literal["gae"] = "gae"
    std: StdConvention = "unbiased"
    """Standard-deviation convention of the critic's whitening: ``unbiased`` (k - 1, veRL's masked_whiten) or
    ``population`` (k)."""


class TurnGRPOAdvantage(_AdvantageSection):
    """Turn-level GRPO: each turn's discounted return of the turn rewards to go, normalised over every turn of its
    group (mean and std over the group's turns, whatever their turn index)."""

    needs_turns: ClassVar[bool] = True
    type: Literal["turn_grpo"] = "turn_grpo"
    gamma: float = Field(default=0.95, ge=0.0, le=1.0)
    """Discount per turn of the return R_t = sum_{k >= t} gamma^(k - t) r_k over the turn rewards r_k (GiGPO's
    0.95; 1.0 gives every turn of an episode its episode's return, so only the number of turns tells them apart)."""
    std: StdConvention = "unbiased"
    """Standard-deviation convention of the std over the group's turns: ``unbiased`` (k - 1) or ``population``
    (k)."""


class GiGPOAdvantage(_AdvantageSection):
    """GiGPO (Feng et al. 2025, arXiv 2505.10978): the episode's group-relative advantage plus omega times a
    step-level one, the turn's discounted return relative to the turns of its group that started from the same
    state (an anchor state: the same observation tokens)."""

    needs_turns: ClassVar[bool] = True
    type: Literal["gigpo"] = "gigpo"
    gamma: float = Field(default=0.95, ge=0.0, le=1.0)
    """Discount per turn of the step return R_t = sum_{k >= t} gamma^(k - t) r_k (the paper's 0.95)."""
    omega: float = Field(default=1.0, ge=0.0)
    """Weight of the step-level advantage: A = A_episode + omega * A_step (the paper's 1.0)."""
    normalize_std: bool = False
    """Divide both levels by their group's std (unbiased, + 1e-6) as GRPO does; false (the paper's agent runs,
    F_norm = 1) only subtracts the group's mean."""


TurnAdvantageConfig = TurnGRPOAdvantage | GiGPOAdvantage
"""The estimators with ``needs_turns``: their advantages are per turn (`compute_turn_advantages`)."""


AdvantageConfig = Annotated[
    GRPOAdvantage
    | DrGRPOAdvantage
    | RLOOAdvantage
    | ReinforcePPAdvantage
    | ReinforcePPBaselineAdvantage
    | ReMaxAdvantage
    | PassKAdvantage
    | GAEAdvantage
    | TurnGRPOAdvantage
    | GiGPOAdvantage,
    Field(discriminator="type"),
]
"""``trainer.algorithm.advantage``: a table with ``type``, or the name alone for the estimator with its defaults."""
