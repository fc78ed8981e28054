"""`Objective`: what the trainer optimises, from ``trainer.algorithm``'s typed parts.

It owns the objective's maths on one micro-batch — the policy loss (`compute_policy_loss`) weighted by the
off-policy correction (`compute_correction`), the entropy bonus, the KL term to the reference policy (as a loss
term; as a reward penalty it is `kl_penalties`' job) — each aggregated with the mini-batch's normaliser, and the
state that goes with it: the KL coefficient's controller and Clip-Cov's random draws. It reads each part's knobs
from its section and never sees a rank, a micro-batch split or an optimizer: how many passes run, on which rank and
in which order is the trainer's (`trainer.py`, `lockstep.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from sharpen.config.algorithm import AlgorithmConfig
from sharpen.config.kl import KLEstimator, KLLoss, KLReward, NoKL
from sharpen.trainer.algorithms.aggregation import aggregate_loss, aggregation_normalizer
from sharpen.trainer.algorithms.kl import build_kl_controller, kl_per_token
from sharpen.trainer.algorithms.offpolicy import OffPolicyCorrection, compute_correction, normalizer_terms
from sharpen.trainer.algorithms.policy_losses import compute_policy_loss, select_tokens
from sharpen.trainer.algorithms.sampling_mask import drop_outside
from sharpen.trainer.backends.base import ReferenceScorer
from sharpen.trainer.packing import MicroBatch

CORRECTION_SUM, CORRECTION_MAX = "correction_sum/", "correction_max/"
"""Prefixes of the off-policy correction's additive statistics and maxima in a step's metric sums."""

Aggregate = Callable[[torch.Tensor], torch.Tensor]
"""A [batch, seq] per-token term -> its scalar, aggregated like the policy loss."""


class Objective:
    """The RL objective of ``config`` (``trainer.algorithm``). ``reference``: the frozen reference policy, needed
    when the KL is a loss term; ``temperature``: the sampling temperature the logprobs are taken at;
    ``truncates``: whether they are the engine's top-k / top-p truncated distribution's (a sampled token outside the
    trainer's kept set, logprob -inf, leaves the loss and counts in ``offpolicy/outside_truncation``);
    ``constant_length``: the constant of ``seq_mean_token_sum_norm``."""

    def __init__(
        self,
        config: AlgorithmConfig,
        *,
        reference: ReferenceScorer | None,
        temperature: float,
        constant_length: float,
        truncates: bool = False,
    ) -> None:
        if config.kl.needs_reference and reference is None:
            raise ValueError(f'trainer.algorithm.kl.type = "{config.kl.type}" needs a reference policy')
        self.config = config
        self.reference = reference
        self.temperature = temperature
        self.truncates = truncates
        self.constant_length = constant_length
        self.kl_controller = build_kl_controller(config.kl)
        self.entropy_coef = config.entropy_coef
        """The entropy bonus's weight this step: entropy_coef, or the adaptive coefficient (`update_entropy`)."""
        self.cov_generator = torch.Generator().manual_seed(0)  # Clip-Cov's draws (not checkpointed)

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the policy's logprobs before the step's first update must be scored apart: the policy moves
        within the step (several epochs or mini-batches), or the weight normaliser needs them first."""
        config = self.config
        return config.num_epochs > 1 or config.num_mini_batches > 1 or config.off_policy_correction.normalizes_weights()

    @property
    def collects_correction_sums(self) -> bool:
        """Whether the correction's additive statistics are kept (rejection criteria or normalised weights)."""
        correction = self.config.off_policy_correction
        return bool(correction.reject) or correction.normalizes_weights()

    @property
    def selects_tokens(self) -> bool:
        """Whether the policy loss treats tokens selected over the whole mini-batch apart (`select_tokens`)."""
        return self.config.policy_loss.selects_tokens

    def normalizer(self, lengths: list[int]) -> float:
        """The mini-batch's aggregation denominator, from its rollouts' loss-token counts (every rank has them)."""
        counts = torch.tensor(lengths)
        mask = torch.arange(int(counts.max()))[None, :] < counts[:, None]  # [rollouts, longest]
        return aggregation_normalizer(self.config.aggregation, mask)

    def correction(
        self, old: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, *, normalizer: float | None
    ) -> OffPolicyCorrection:
        """The off-policy correction of ``old`` (the trainer's logprobs before the update) against ``engine``."""
        return compute_correction(self.config.off_policy_correction, old, engine, mask, normalizer=normalizer)

    def weight_normalizer_terms(self, whole: MicroBatch) -> dict[str, float]:
        """``weight_sum`` and ``count`` of the kept importance weights of ``whole`` (a rank's share of a mini-batch
        with its old logprobs): summed over ranks, their quotient is the mini-batch's weight normaliser."""
        assert whole.old_logprobs is not None, "the normaliser needs the old logprobs"
        _, old, mask, _ = drop_outside(whole.old_logprobs, whole.old_logprobs, whole.loss_mask)
        correction = self.correction(old, whole.engine_logprobs, mask, normalizer=None)
        return normalizer_terms(correction, per_sequence=self.config.off_policy_correction.weights_per_sequence)

    def select_tokens(self, whole: MicroBatch) -> torch.Tensor | None:
        """The tokens the policy loss treats apart, over a whole mini-batch ([batch, seq]); the covariance uses the
        engine's logprobs (the policy the tokens were sampled from; pi_old up to the mismatch)."""
        advantages = whole.advantages.to(torch.float32)
        return select_tokens(
            self.config.policy_loss, whole.engine_logprobs, advantages, whole.loss_mask, generator=self.cov_generator
        )

    def micro_batch_loss(
        self,
        micro: MicroBatch,
        logprobs: torch.Tensor,
        old: torch.Tensor,
        entropy: torch.Tensor | None,
        normalizer: float,
        sums: dict[str, float],
        *,
        extra_loss: Callable[[Aggregate], torch.Tensor] | None = None,
        selected: torch.Tensor | None = None,
        weight_normalizer: float | None = None,
        reference_logprobs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss of one micro-batch, and its metric sums added to ``sums``. ``logprobs`` [batch, seq]: the
        policy's, with gradient; ``old``: before the step's update; ``entropy``: the policy's per-token entropy (None:
        not computed). ``extra_loss``: a term added to the loss, given the aggregation (the distillation loss);
        ``selected``: the tokens the loss treats apart (`select_tokens`, on this micro-batch's rows);
        ``weight_normalizer``: the mini-batch's importance-weight normaliser; ``reference_logprobs``: the reference
        policy's, scored before the step (a sharded reference); None: the reference scores ``micro`` here."""
        config = self.config
        num_tokens = float(micro.loss_mask.sum())
        logprobs, old, mask, num_outside = drop_outside(logprobs, old, micro.loss_mask)
        if self.truncates:
            sums["offpolicy/outside_truncation"] += num_outside  # a fraction of the loss tokens in the metrics
        correction = self.correction(old, micro.engine_logprobs, mask, normalizer=weight_normalizer)
        per_token, loss_metrics = compute_policy_loss(
            config.policy_loss, logprobs, old, micro.advantages, correction.mask, selected=selected
        )

        def aggregate(values: torch.Tensor) -> torch.Tensor:
            return aggregate_loss(
                values,
                correction.mask,
                config.aggregation,
                normalizer=normalizer,
                constant_length=self.constant_length,
            )

        loss = aggregate(per_token * correction.weights)
        if entropy is not None:
            sums["entropy"] += float(entropy.detach()[micro.loss_mask].sum())
            if self.entropy_coef > 0:
                loss = loss - self.entropy_coef * aggregate(entropy)
        if self.reference is not None and not config.kl.in_reward:
            ref = reference_logprobs
            if ref is None:
                ref = self.reference.token_logprobs(
                    micro.input_ids,
                    micro.attention_mask,
                    micro.loss_mask,
                    temperature=self.temperature,  # the full distribution: finite for any sampled token
                    images=micro.images,
                    routes=micro.row_routes,
                )
            kl = kl_per_token(logprobs, ref, self._kl_estimator())
            sums["kl"] += float(kl.detach()[mask].sum())
            loss = loss + self.kl_controller.coef * aggregate(kl)
        if extra_loss is not None:
            loss = loss + extra_loss(aggregate)
        sums["num_tokens"] += num_tokens
        sums["loss_total"] += float(loss.detach())
        sums["clip_fraction"] += float(loss_metrics.num_clipped_low + loss_metrics.num_clipped_high)
        sums["dual_clip_fraction"] += float(loss_metrics.num_dual_clipped)
        sums["ratio_mean"] += float(loss_metrics.ratio_sum)
        for name, value in correction.metrics.items():
            if name != "offpolicy/num_tokens":
                sums[name] += value * num_tokens  # token-weighted mean over micro-batches
        for name, value in correction.sums.items():
            sums[CORRECTION_SUM + name] += value
        for name, value in correction.maxima.items():
            sums[CORRECTION_MAX + name] = max(sums[CORRECTION_MAX + name], value)
        return loss

    def kl_penalty_terms(self, engine_logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
        """Per-token KL_t(engine || reference) of the KL's estimator ([batch, seq]), for the reward penalty."""
        return kl_per_token(engine_logprobs, reference_logprobs, self._kl_estimator())

    def update_kl(self, measured_kl: float, num_samples: int) -> None:
        """Let an adaptive KL coefficient react to the step's measured KL."""
        self.kl_controller.update(measured_kl, num_samples)

    def update_entropy(self, measured_entropy: float) -> None:
        """Move an adaptive entropy coefficient toward ``trainer.algorithm.entropy.target`` after a step whose mean
        token entropy (over every rank's tokens) was ``measured_entropy``: c + adapt_rate * (target - H), clamped to
        [0, coef_max]. No target, or a step without a finite entropy: unchanged."""
        entropy = self.config.entropy
        if entropy.target is None or not math.isfinite(measured_entropy):
            return
        moved = self.entropy_coef + entropy.adapt_rate * (entropy.target - measured_entropy)
        self.entropy_coef = min(max(moved, 0.0), entropy.coef_max)

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps: the KL coefficient and the entropy coefficient (the adaptive controllers'
        only state)."""
        return {"kl_coef": self.kl_controller.coef, "entropy_coef": self.entropy_coef}

    def load_state(self, state: dict[str, float]) -> None:
        self.kl_controller = build_kl_controller(self.config.kl, coef=state["kl_coef"])
        # checkpoints written before the adaptive entropy coefficient hold only the KL's
        self.entropy_coef = state.get("entropy_coef", self.config.entropy_coef)

    def _kl_estimator(self) -> KLEstimator:
        match self.config.kl:
            case NoKL():
                raise AssertionError("a reference policy scores only when a KL term is configured")
            case KLLoss() | KLReward() as kl:
                return kl.estimator
