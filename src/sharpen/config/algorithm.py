"""The RL objective's configuration: advantages, policy losses, KL and entropy terms, off-policy corrections
(`AlgorithmConfig`), the critic of PPO with GAE (`CriticConfig`) and on-policy distillation (`DistillationConfig`).
Mounted in `TrainerConfig` (schema.py). Pydantic only, like the rest of `sharpen.config`; docs/algorithms.md gives
each formula and its paper.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from sharpen.config.section import Section


class OffPolicyRejectConfig(Section):
    """One rejection criterion of trainer.algorithm.off_policy_reject, on the per-token divergence between the
    trainer's old policy and the engine's, with r_t = pi_old(y_t) / pi_engine(y_t): k1 = log r_t, k2 =
    0.5 (log r_t)^2, k3 = (r_t - 1) - log r_t. A token criterion tests each token's divergence; a sequence criterion
    tests the sum, mean or max of its tokens' divergences and keeps or drops the whole sequence. docs/algorithms.md
    gives each form."""

    level: Literal["token", "sequence"]
    """What a failed test drops: the token, or every token of the sequence."""
    statistic: Literal["sum", "mean", "max"] | None = None
    """Sequence criteria only (required there): the sequence's statistic of its tokens' divergences. With k1, sum
    tests the product ratio prod_t r_t and mean the geometric-mean ratio exp(mean_t log r_t); max needs k2 or k3."""
    divergence: Literal["k1", "k2", "k3"] = "k1"
    """Per-token divergence: k1 (log ratio, signed: tested as a ratio band [low, high]), or the non-negative k2 /
    k3 (tested against the upper threshold high)."""
    low: float | None = Field(default=None, ge=0.0, le=1.0)
    """k1 only (required there): the lowest kept ratio (exp of the statistic); 0 means no lower bound."""
    high: float = Field(gt=0.0)
    """k1: the highest kept ratio (at least 1); k2 / k3: the largest kept divergence (or statistic of them)."""

    @property
    def name(self) -> str:
        """The criterion's name in metrics: ``token_k1``, ``seq_mean_k1``, ``seq_max_k3``, ..."""
        return f"token_{self.divergence}" if self.level == "token" else f"seq_{self.statistic}_{self.divergence}"

    @model_validator(mode="after")
    def _check_form(self) -> OffPolicyRejectConfig:
        if self.level == "token" and self.statistic is not None:
            raise ValueError('statistic applies to level = "sequence" only (a token is tested on its own divergence)')
        if self.level == "sequence" and self.statistic is None:
            raise ValueError('level = "sequence" needs statistic = "sum", "mean" or "max"')
        if self.divergence == "k1":
            if self.statistic == "max":
                raise ValueError('statistic = "max" needs divergence = "k2" or "k3" (k1 is signed: use a k1 band)')
            if self.low is None:
                raise ValueError("a k1 criterion needs low (its ratio band is [low, high]; low = 0: no lower bound)")
            if self.high < 1.0:
                raise ValueError(f"a k1 criterion needs high >= 1 (a ratio of 1 must be kept), got high = {self.high}")
        elif self.low is not None:
            raise ValueError(f"low applies to k1 only: {self.divergence} is non-negative, give only its threshold high")
        return self


class AlgorithmConfig(Section):
    """The RL objective. docs/algorithms.md gives each formula and its paper."""

    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "passk", "gae"] = (
        "grpo"
    )
    """Advantage estimator: GRPO (group mean/std), Dr.GRPO (group mean only), RLOO (leave-one-out), REINFORCE++
    (per-token returns of the score and the KL penalty, normalised over the batch's tokens), REINFORCE++-baseline
    (the same with the group mean subtracted from the score), ReMax (greedy baseline), Pass@k (the analytic
    advantage of the best-of-passk_k reward; a score >= 1 counts as correct) or GAE (per-token, from a learned value
    model: PPO with a critic, configured in trainer.critic)."""
    passk_k: int = Field(default=1, ge=1)
    """advantage = "passk": the k of pass@k, 1 <= k < rollout.num_samples_per_prompt (k = the group size makes every
    group's estimate 0 or 1, so every advantage 0); 1 is GRPO with the population std (Chen et al. 2025)."""
    advantage_std: Literal["unbiased", "population"] = "unbiased"
    """Standard-deviation convention wherever advantages are divided by one (GRPO's group std, REINFORCE++'s batch
    std, the critic's whitening): ``unbiased`` divides the squared deviations by k - 1 (what veRL's GRPO advantage
    and TRL's GRPOTrainer compute, torch.std), ``population`` by k."""
    reinforce_pp_gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """REINFORCE++ (both variants): discount per trained token of the return G_t = sum_{k >= t} gamma^(k - t) rew_k,
    rew_k the KL penalty of token k (kl_in_reward) plus the score on the last token (the paper's 1.0: every token
    sees the whole score). GAE's discount is trainer.critic.gamma."""
    policy_loss: Literal["ppo_clip", "gspo", "cispo", "sapo", "gmpo", "clip_cov", "kl_cov", "pg"] = "ppo_clip"
    """Policy loss: PPO clip (token ratio), GSPO (sequence ratio), CISPO (clipped stop-gradient IS weight on the
    log-likelihood), SAPO (soft sigmoid gate instead of the clip), GMPO (geometric mean of log-space-clipped token
    ratios), Clip-Cov / KL-Cov (PPO with the gradient of a few high-covariance tokens detached / unclipped with a
    |log r| penalty on them) or plain on-policy policy gradient. GSPO and GMPO are sequence objectives: they need
    loss_aggregation = "seq_mean_token_mean"."""
    clip_eps_low: float = Field(default=0.2, ge=0.0)
    """The ratio is clipped below at 1 - clip_eps_low (PPO, GSPO, CISPO)."""
    clip_eps_high: float = Field(default=0.2, ge=0.0)
    """The ratio is clipped above at 1 + clip_eps_high (DAPO's clip-higher when larger than low)."""
    dual_clip_c: float | None = Field(default=None, gt=1.0)
    """Dual-clip PPO: for negative advantages the loss is bounded by c * |A| (None: off)."""
    sapo_tau_pos: float = Field(default=1.0, gt=0.0)
    """SAPO: gate temperature for tokens with a positive advantage (the paper's 1.0)."""
    sapo_tau_neg: float = Field(default=1.05, gt=0.0)
    """SAPO: gate temperature for tokens with a zero or negative advantage (the paper's 1.05: damped harder)."""
    gmpo_log_clip_low: float = Field(default=0.4, ge=0.0)
    """GMPO: token log-ratios are clipped below at -gmpo_log_clip_low (the paper's ratio range is (e^-0.4, e^0.4))."""
    gmpo_log_clip_high: float = Field(default=0.4, ge=0.0)
    """GMPO: token log-ratios are clipped above at gmpo_log_clip_high."""
    clip_cov_fraction: float = Field(default=2e-4, gt=0.0, le=1.0)
    """Clip-Cov: fraction of a mini-batch's loss tokens (at least 1) whose gradient is detached, drawn at random
    among those with covariance inside (clip_cov_min, clip_cov_max) (the paper's 2e-4)."""
    clip_cov_min: float = 1.0
    """Clip-Cov: lower bound of the covariance of the tokens that may be drawn (the paper's 1)."""
    clip_cov_max: float = 5.0
    """Clip-Cov: upper bound of the covariance of the tokens that may be drawn (the paper's 5)."""
    kl_cov_fraction: float = Field(default=2e-3, gt=0.0, le=1.0)
    """KL-Cov: fraction of a mini-batch's loss tokens (at least 1), those of largest covariance, that get the
    |log r| penalty (the paper's 2e-3 for 7B models; 2e-4 for 32B)."""
    kl_cov_coef: float = Field(default=1.0, ge=0.0)
    """KL-Cov: weight of the |log r| penalty on the selected tokens (the paper's 1)."""
    loss_aggregation: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = (
        "token_mean"
    )
    """How per-token losses become one number, normalised over the whole mini-batch so the micro-batch split never
    changes the gradient. seq_mean_token_sum_norm divides each sequence's sum by a constant (Dr.GRPO)."""
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
    """Weight of the entropy bonus (0: entropy is still logged, no extra cost beyond the logits already computed)."""
    kl_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the KL(policy || reference) loss term; 0 loads no reference model and runs no reference forward."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k2"
    """Per-token KL estimator used as the loss. k2's gradient is the true reverse-KL gradient on on-policy samples;
    k3 (GRPO's choice) is an unbiased value but a biased gradient; k1's expected gradient is zero."""
    kl_target: float | None = Field(default=None, gt=0.0)
    """Adaptive KL coefficient (Ziegler et al.): steer the measured KL towards this target (None: fixed kl_coef)."""
    kl_horizon: int = Field(default=10000, ge=1)
    """Horizon (in samples) of the adaptive KL controller."""
    kl_in_reward: bool = False
    """Apply the KL as a per-token reward penalty, -kl_coef * KL_t(engine || reference) with kl_estimator, before
    the advantages (REINFORCE++, PPO-RLHF), instead of as a loss term. Needs kl_coef > 0."""
    off_policy_correction: Literal["none", "token_tis", "sequence_tis", "token_mask", "icepop", "sequence_mask"] = (
        "token_tis"
    )
    """Correction of the loss against the engine's (behaviour) logprobs: truncated importance sampling per token or
    per sequence, masking tokens/sequences whose ratio leaves [off_policy_low, off_policy_high] (weight 1), or
    IcePop (weight = the ratio inside that band, 0 outside). On by default: the engine's numerics never exactly
    match the trainer's."""
    off_policy_cap: float = Field(default=2.0, gt=0.0)
    """Truncation of the importance weight for the *_tis corrections."""
    off_policy_low: float = Field(default=0.5, ge=0.0)
    """Lower edge of the kept ratio band for the *_mask and icepop corrections."""
    off_policy_high: float = Field(default=2.0, gt=0.0)
    """Upper edge of the kept ratio band for the *_mask and icepop corrections."""
    off_policy_reject: list[OffPolicyRejectConfig] = Field(default_factory=list[OffPolicyRejectConfig])
    """Rejection criteria applied on top of off_policy_correction (empty: none): a token stays in the loss only if
    every criterion keeps it; rejected tokens and sequences get weight 0 and leave the loss mask, the others keep
    the correction's weight. E.g. ``[{level = "token", low = 0.5, high = 2.0}, {level = "sequence", statistic =
    "max", divergence = "k3", high = 1.0}]``."""
    off_policy_normalize: bool = False
    """Divide the importance weights by their mean over the kept tokens (token_tis, icepop) or kept sequences
    (sequence_tis) of the whole mini-batch, so that they average 1: less variance, a small bias. Needs the trainer's
    old logprobs before the first micro-batch (one extra forward pass without gradient when num_epochs and
    num_mini_batches are 1)."""

    @model_validator(mode="after")
    def _check_band(self) -> AlgorithmConfig:
        if self.kl_in_reward and self.kl_coef == 0:
            raise ValueError("kl_in_reward needs kl_coef > 0")
        if self.off_policy_low > self.off_policy_high:
            raise ValueError(
                f"off_policy_low = {self.off_policy_low} is above off_policy_high = {self.off_policy_high}"
            )
        names = [criterion.name for criterion in self.off_policy_reject]
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(
                f"off_policy_reject lists {', '.join(repeated)} more than once: merge their bounds into one criterion"
            )
        if self.off_policy_normalize and self.off_policy_correction not in ("token_tis", "sequence_tis", "icepop"):
            raise ValueError(
                f'off_policy_normalize needs importance weights: off_policy_correction = "token_tis", "sequence_tis" '
                f'or "icepop" (the weights of "{self.off_policy_correction}" are all 1)'
            )
        if self.clip_cov_min >= self.clip_cov_max:
            raise ValueError(f"clip_cov_min = {self.clip_cov_min} must be below clip_cov_max = {self.clip_cov_max}")
        if self.policy_loss in ("gspo", "gmpo") and self.loss_aggregation != "seq_mean_token_mean":
            raise ValueError(
                f'policy_loss = "{self.policy_loss}" is a sequence-level objective (its paper averages the loss over '
                f'sequences): it needs loss_aggregation = "seq_mean_token_mean", got "{self.loss_aggregation}"'
            )
        return self


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
