"""The RL objective's configuration: advantages, policy losses, KL and entropy terms, off-policy corrections
(`AlgorithmConfig`), the critic of PPO with GAE (`CriticConfig`) and on-policy distillation (`DistillationConfig`).
Mounted in `TrainerConfig` (schema.py). Pydantic only, like the rest of `sharpen.config`; docs/algorithms.md gives
each formula and its paper.
"""

from __future__ import annotations

import warnings
from functools import cache
from typing import Any, Literal, cast, get_args

from pydantic import Field, field_validator, model_validator

from sharpen.config.advantages import AdvantageConfig, GRPOAdvantage
from sharpen.config.corrections import CorrectionConfig, OffPolicyRejectConfig, TokenTISCorrection
from sharpen.config.kl import KLConfig, NoKL
from sharpen.config.legacy_keys import TypedSection, migrate_algorithm_keys
from sharpen.config.policy_losses import AggregationMode, PolicyLossConfig, PPOClipLoss
from sharpen.config.section import DeprecatedKeyWarning, Section

__all__ = ["AlgorithmConfig", "CriticConfig", "DistillationConfig", "EntropyConfig", "OffPolicyRejectConfig"]


@cache
def _typed_sections() -> dict[str, TypedSection]:
    """The typed sections of `AlgorithmConfig` (classes by ``type``, the default type), read from its fields."""
    sections: dict[str, TypedSection] = {}
    for name, field in AlgorithmConfig.model_fields.items():
        if field.discriminator != "type":
            continue
        members = get_args(field.annotation)
        classes = {get_args(c.model_fields["type"].annotation)[0]: c for c in members}
        sections[name] = TypedSection(classes=classes, default=field.get_default(call_default_factory=True).type)
    return sections


class EntropyConfig(Section):
    """The adaptive entropy coefficient: after each step, c <- clamp(c + adapt_rate * (target - H), 0, coef_max),
    where H is the step's mean token entropy (``train/entropy``, over every rank's tokens, so every rank computes
    the same c) and c starts at ``entropy_coef``. Below the target the bonus grows, above it it shrinks. Logged as
    ``entropy/coef`` (the coefficient the step trained with) and kept in checkpoints, so a resumed run continues
    with the same c. docs/algorithms.md, Adaptive entropy."""

    target: float | None = Field(default=None, gt=0.0)
    """Target mean token entropy (nats); None: the coefficient stays at entropy_coef."""
    adapt_rate: float = Field(default=0.01, gt=0.0)
    """Change of the coefficient per nat of entropy below (or above) the target, per step."""
    coef_max: float = Field(default=0.01, gt=0.0)
    """Largest coefficient: a bonus that could grow without bound would trade the reward for noise."""


class AlgorithmConfig(Section):
    """The RL objective: four typed parts (advantage estimator, policy loss, off-policy correction, KL term), each a
    section chosen by ``type`` with only its own knobs and its paper's defaults, plus how the loss is aggregated and
    how each batch is stepped. docs/algorithms.md gives each formula and its paper; the flat keys of earlier
    versions (``clip_eps_low``, ``kl_coef``, ...) still load, with one deprecation line (``config/legacy_keys.py``)."""

    advantage: AdvantageConfig = Field(default_factory=GRPOAdvantage)
    """Advantage estimator: grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline, remax, passk (with k) or gae
    (PPO with a critic, configured in trainer.critic). ``advantage = "rloo"`` is short for ``{type = "rloo"}``."""
    policy_loss: PolicyLossConfig = Field(default_factory=PPOClipLoss)
    """Policy loss: ppo_clip, gspo, cispo, sapo, gmpo, clip_cov, kl_cov or pg, each with its paper's knobs
    (``policy_loss = "gspo"`` is GSPO with the paper's clip range and aggregation)."""
    off_policy_correction: CorrectionConfig = Field(default_factory=TokenTISCorrection)
    """Correction of the loss against the engine's (behaviour) logprobs: none, token_tis, sequence_tis, token_mask,
    icepop or sequence_mask, with rejection criteria (``reject``). On by default (token_tis): the engine's numerics
    never exactly match the trainer's."""
    kl: KLConfig = Field(default_factory=NoKL)
    """KL to the reference policy: none, as a loss term (``{type = "loss", coef = 0.01}``) or as a per-token reward
    penalty (``{type = "reward", coef = 0.01, estimator = "k1"}``)."""
    loss_aggregation: AggregationMode | None = None
    """How per-token losses become one number, normalised over the whole mini-batch so the micro-batch split never
    changes the gradient; seq_mean_token_sum_norm divides each sequence's sum by a constant (Dr.GRPO). Left out: the
    policy loss's paper's (token_mean; seq_mean_token_mean for GSPO, GMPO and SAPO), written into the resolved
    config."""
    aggregation_constant: int | None = Field(default=None, ge=1)
    """The constant of seq_mean_token_sum_norm (None: rollout.max_new_tokens)."""
    mask_truncated: bool = False
    """Leave completions cut off at rollout.max_new_tokens out of the loss (DAPO overlong filtering); they still
    count in their group's advantage baseline."""
    num_epochs: int = Field(default=1, ge=1)
    """Passes over each batch of rollouts (PPO epochs)."""
    num_mini_batches: int = Field(default=1, ge=1)
    """Optimizer steps per epoch: the batch is split into this many mini-batches."""
    entropy_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the entropy bonus (0: entropy is still logged, no extra cost beyond the logits already computed);
    with ``entropy.target`` set, its starting value."""
    entropy: EntropyConfig = Field(default_factory=EntropyConfig)
    """An adaptive entropy coefficient toward a target entropy (off unless ``target`` is set)."""

    @model_validator(mode="before")
    @classmethod
    def _migrate_legacy_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        migrated, line = migrate_algorithm_keys(cast(dict[str, Any], data), _typed_sections())
        if line is not None:
            warnings.warn(line, DeprecatedKeyWarning, stacklevel=2)
        return migrated

    @model_validator(mode="after")
    def _check_entropy(self) -> AlgorithmConfig:
        if self.entropy.target is not None and self.entropy_coef > self.entropy.coef_max:
            raise ValueError(
                f"entropy_coef = {self.entropy_coef} (the adaptive coefficient's start) is above entropy.coef_max = "
                f"{self.entropy.coef_max}; raise coef_max or lower entropy_coef"
            )
        return self

    @model_validator(mode="after")
    def _resolve_aggregation(self) -> AlgorithmConfig:
        loss = self.policy_loss
        if self.loss_aggregation is None:
            self.loss_aggregation = loss.paper_aggregation  # validates again, then with a value: no loop
        elif loss.sequence_level and self.loss_aggregation != loss.paper_aggregation:
            raise ValueError(
                f'policy_loss = "{loss.type}" is a sequence-level objective (its paper averages the loss over '
                f'sequences): it needs loss_aggregation = "{loss.paper_aggregation}", got "{self.loss_aggregation}"'
            )
        return self

    @property
    def aggregation(self) -> AggregationMode:
        """The resolved loss aggregation (never None after validation)."""
        assert self.loss_aggregation is not None, "filled in by validation"
        return self.loss_aggregation


class CriticConfig(Section):
    """The value model of PPO with a critic, used only when trainer.algorithm.advantage = "gae": a copy of the
    policy's model (model.path) with a fresh scalar head, trained in the same step as the policy."""

    learning_rate: float = Field(default=1e-5, gt=0.0)
    """AdamW learning rate of the critic (betas, weight decay and max_grad_norm are the policy's)."""
    value_clip: float = Field(default=0.2, ge=0.0)
    """PPO value clipping: the loss takes the worse of the new value and the old value moved by at most this much
    towards it (0: off, plain squared error)."""
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """Discount per token in GAE."""
    lam: float = Field(default=0.95, ge=0.0, le=1.0)
    """GAE lambda: 1 gives Monte-Carlo returns minus the value, 0 the one-step TD error."""
    whiten_advantages: bool = True
    """Whiten the GAE advantages (zero mean, unit std) over all completion tokens of the step."""


class DistillationConfig(Section):
    """On-policy distillation: a frozen teacher (any HF causal LM with the student's tokenizer, run on the trainer's
    device) scores the tokens the student sampled; the per-token reverse KL, log pi_s(y_t) - log pi_t(y_t), becomes
    an advantage or a loss term, and mixes with the task reward's advantage (docs/algorithms.md, On-policy
    distillation)."""

    enabled: bool = False
    """Distil toward the teacher (off: no teacher is loaded and no teacher forward runs)."""
    teacher_path: str | None = None
    """The teacher: a model name known to ``sharpen models`` or a local HF causal-LM folder with the student's
    tokenizer (None: model.path, the student's initial weights, frozen; with teacher_prompt or teacher_temperature
    that is context distillation)."""
    mode: Literal["advantage", "loss"] = "advantage"
    """``advantage``: A_t = (task advantage) + coef * -(sum_{k >= t} gamma^(k - t) rkl_k), rkl_t from the
    policy's logprobs before the step's update (pi_old, scored by the trainer as the teacher is, not the engine's),
    held fixed, through the configured policy loss; ``loss``: coef * kl_estimator(rkl_t) added to the loss with a
    gradient, aggregated like the policy loss (or the top-k KL with top_k > 0)."""
    coef: float = Field(default=1.0, gt=0.0)
    """Weight of the distillation advantage or loss term."""
    gamma: float = Field(default=0.0, ge=0.0, le=1.0)
    """Advantage mode: discount of the reverse KL of later tokens (0: each token's own, as the Thinking Machines
    recipe; 1: the return-to-go)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k2"
    """Loss mode: the per-token estimator of the sampled-token loss term; k2 (rkl^2 / 2) has the reverse-KL
    gradient on on-policy samples, k1's expected gradient is zero, k3's is the forward KL's (kl.py)."""
    top_k: int = Field(default=0, ge=0)
    """Loss mode: > 0 uses the top-k variant, the full-distribution reverse KL restricted to the student's k most
    likely tokens at each position (both renormalised over them), from both models' logits; less stable than the
    sampled-token estimate (the set moves with the student, mass outside it is ignored), one more student forward
    per micro-batch and [tokens, vocab] logits kept for the backward; single-device backend only. 0: sampled tokens."""
    teacher_prompt: str | None = None
    """Template of the system message the teacher sees instead of the student's (the user turns and the completion
    stay the same, so the teacher scores exactly the student's tokens): ``{answer}`` is the example's reference
    answer, ``{system}`` the student's system prompt. None: the teacher sees the student's prompt ids."""
    teacher_temperature: float | None = Field(default=None, gt=0.0)
    """The teacher's logits are divided by this (None: rollout.temperature, as the student's); below the student's
    temperature the teacher is a sharper version of itself."""

    @field_validator("teacher_prompt")
    @classmethod
    def _check_teacher_prompt(cls, value: str | None) -> str | None:
        import string  # only this validator parses templates

        if value is None:
            return value
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        except ValueError as error:
            raise ValueError(f"not a valid template ({error}); write a literal brace as {{{{ or }}}}") from None
        if fields - {"answer", "system"}:
            raise ValueError(
                f"unknown placeholders {sorted(fields - {'answer', 'system'})}; use {{answer}}, {{system}}"
            )
        return value

    @model_validator(mode="after")
    def _check_top_k(self) -> DistillationConfig:
        if self.top_k > 0 and self.mode != "loss":
            raise ValueError(
                f'trainer.distillation.top_k = {self.top_k} needs mode = "loss" (the top-k KL is a loss term with the '
                "student's gradient through its top-k logprobs)"
            )
        return self
