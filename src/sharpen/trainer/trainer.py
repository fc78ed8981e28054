"""`Trainer.step(batch) -> metrics`: optimizer steps of the configured policy objective on a batch of rollouts.

Per step: the batch is split into ``num_mini_batches`` mini-batches (one optimizer step each) and passed over
``num_epochs`` times. Each mini-batch's loss is aggregated with a denominator computed from the whole mini-batch,
so the micro-batch split never changes the update. The policy ratio is taken against the "old" logprobs (the
trainer's own, at the start of the step); the off-policy correction reweights or masks tokens by the ratio of the
old logprobs to the engine's (behaviour) logprobs. With one epoch and one mini-batch the old logprobs are the
current ones, detached, and no extra forward pass runs (unless ``off_policy_normalize`` needs them for the
mini-batch's weight normaliser before its first micro-batch). With a critic (``advantage = "gae"``) the per-token
advantages come from `CriticStep`, and the critic trains on the same mini-batches with its own optimizer. The
trainer never imports rollout code: weights leave through `named_weights()`, and orchestration decides where they
go.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from sharpen.config.advantages import GAEAdvantage
from sharpen.config.schema import TrainerConfig
from sharpen.expert_routes import Routers, Routes, routes_tensor
from sharpen.trainer.algorithms.offpolicy import correction_metrics
from sharpen.trainer.algorithms.sampling_mask import SamplingMask
from sharpen.trainer.backends import SingleDeviceBackend, ValueModel
from sharpen.trainer.backends.base import (
    ReferenceScorer,
    ScoreInputs,
    TokenScores,
    TrainerBackend,
    UpFrontReferenceScorer,
)
from sharpen.trainer.backends.teacher import TeacherPolicy
from sharpen.trainer.critic_step import CriticStep
from sharpen.trainer.distill_step import DistillationStep
from sharpen.trainer.lockstep import RankLockstep
from sharpen.trainer.objective import CORRECTION_MAX, CORRECTION_SUM, Objective
from sharpen.trainer.packing import (
    MicroBatch,
    pack_micro_batch,
    split_micro_batches,
    split_micro_batches_by_tokens,
    unpack_scores,
)
from sharpen.trainer.precision import LossScaler
from sharpen.trainer.route_step import RouteStep
from sharpen.trainer.routes import forward_routes, probe_scores, rollout_routes
from sharpen.types import ImagePart, ProbeScores, Rollout, TrainBatch
from sharpen.weight_shards import WeightShard


def _pop_prefixed(sums: dict[str, float], prefix: str) -> dict[str, float]:
    """Remove the entries of ``sums`` whose names start with ``prefix``; return them without it."""
    return {name.removeprefix(prefix): sums.pop(name) for name in [name for name in sums if name.startswith(prefix)]}


def _rows_of(selection: dict[int, torch.Tensor], chunk: list[Rollout], loss_mask: torch.Tensor) -> torch.Tensor:
    """The [batch, seq] mask of ``chunk``'s selected tokens on the micro-batch's rows (``loss_mask`` positions)."""
    rows = torch.zeros_like(loss_mask)
    for row, rollout in enumerate(chunk):
        rows[row, loss_mask[row]] = selection[id(rollout)].to(loss_mask.device)
    return rows


def _advantage_inputs(chunk: list[Rollout], critic_step: CriticStep | None) -> dict[str, list[list[float]]]:
    """`pack_micro_batch`'s per-token advantage inputs of ``chunk``: the critic's GAE targets, or the rollouts' own
    ``token_advantages`` (REINFORCE++) when any has them; none (sequence advantages) otherwise."""
    if critic_step is not None:
        return critic_step.pack_inputs(chunk)
    if all(r.token_advantages is None for r in chunk):
        return {}
    per_token = [
        r.token_advantages if r.token_advantages is not None else [r.advantage or 0.0] * r.num_loss_tokens
        for r in chunk
    ]
    return {"token_advantages": per_token}


class Trainer:
    def __init__(
        self,
        config: TrainerConfig,
        *,
        backend: TrainerBackend,
        pad_token_id: int,
        temperature: float = 1.0,
        sampling_mask: SamplingMask | None = None,
        max_new_tokens: int | None = None,
        reference: ReferenceScorer | None = None,
        critic: ValueModel | None = None,
        teacher: TeacherPolicy | None = None,
    ) -> None:
        algorithm = config.algorithm
        if config.distillation.enabled != (teacher is not None):
            raise ValueError("a teacher (TeacherPolicy) is needed exactly when trainer.distillation.enabled = true")
        if config.distillation.top_k > 0 and not isinstance(backend, SingleDeviceBackend):
            raise ValueError(
                "trainer.distillation.top_k > 0 runs on the single-device backend only (trainer_ranks = 1)"
            )
        if algorithm.advantage.needs_critic != (critic is not None):
            raise ValueError('a critic (ValueModel) is needed exactly when trainer.algorithm.advantage = "gae"')
        if critic is not None and backend.num_ranks > 1:
            raise ValueError('advantage = "gae" (a critic) runs on one device only; the critic is not sharded')
        if (
            algorithm.aggregation == "seq_mean_token_sum_norm"
            and (algorithm.aggregation_constant or max_new_tokens) is None
        ):
            raise ValueError("seq_mean_token_sum_norm needs trainer.algorithm.aggregation_constant or max_new_tokens")
        self.config = config
        self.backend = backend
        self.reference = reference
        self.critic = critic
        self.teacher = teacher
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.sampling_mask = None if sampling_mask is None or sampling_mask.is_off else sampling_mask
        """The engine's top-k / top-p: the policy's logprobs and entropy are the truncated distribution's (the
        reference and the probe score the full one; docs/algorithms.md, "Top-k and top-p")."""
        self.objective = Objective(
            algorithm,
            reference=reference,
            temperature=temperature,
            truncates=self.sampling_mask is not None,
            constant_length=float(algorithm.aggregation_constant or max_new_tokens or 1),
        )
        self.lockstep = RankLockstep(backend)
        self.reward_kl = 0.0  # mean per-token KL measured by the last `kl_penalties` call
        self.router: Routers | None = getattr(backend, "routers", None)
        """A Mixture-of-Experts policy's routers (the backend's); None for a dense one."""
        moe = config.moe
        if self.router is None and (moe.routing_replay != "none" or moe.aux_loss_coef or moe.expert_bias_update_rate):
            raise ValueError("trainer.moe needs a Mixture-of-Experts policy whose backend replays its routes")
        self._routes: RouteStep | None = None
        """This step's expert routes (a Mixture-of-Experts policy; `RouteStep`)."""

    def step(self, batch: TrainBatch) -> dict[str, float]:
        algorithm = self.config.algorithm
        rollouts = [r for r in batch.rollouts if r.advantage is not None and r.num_loss_tokens]
        if not rollouts:
            return {"train/num_loss_tokens": 0.0, "train/skipped": 1.0}
        self._check_images(rollouts)
        size = math.ceil(len(rollouts) / algorithm.num_mini_batches)
        mini_batches = [rollouts[i : i + size] for i in range(0, len(rollouts), size)]
        route_metrics_now = self._start_routes(rollouts)
        try:
            metrics = self._step(rollouts, mini_batches, skip_above=batch.skip_grad_norm_above)
            return metrics | route_metrics_now | self._finish_routes()
        finally:
            self._routes = None

    def _step(
        self, rollouts: list[Rollout], mini_batches: list[list[Rollout]], *, skip_above: float | None
    ) -> dict[str, float]:
        """`step`'s optimizer steps over ``mini_batches`` and their metrics (the routes' are `RouteStep`'s);
        ``skip_above``: `TrainBatch.skip_grad_norm_above`."""
        algorithm = self.config.algorithm
        old_logprobs = None
        if self.objective.needs_old_logprobs:
            local = [r for mini_batch in mini_batches for r in self.lockstep.local_share(mini_batch)]
            old_logprobs = self._old_logprobs(local, filler=rollouts[:1])
        critic_step = None
        if self.critic is not None:
            critic_step = CriticStep(
                self.critic,
                self.config.critic,
                rollouts,
                micro_batch_size=self.config.micro_batch_size,
                pad_token_id=self.pad_token_id,
                std=algorithm.advantage.std if isinstance(algorithm.advantage, GAEAdvantage) else "unbiased",
            )
        distill_step = self._distillation_step(mini_batches)
        sums: dict[str, float] = defaultdict(float)
        grad_norms = []
        scaler: LossScaler | None = getattr(self.backend, "loss_scaler", None)  # fp16's
        overflows_before = scaler.num_overflows if scaler is not None else 0
        for _ in range(algorithm.num_epochs):
            for mini_batch in mini_batches:
                self._accumulate(mini_batch, old_logprobs, critic_step, sums, distill_step=distill_step)
                grad_norms.append(self.backend.clip_and_step(skip_above=math.inf if skip_above is None else skip_above))
                if critic_step is not None:
                    critic_step.clip_and_step(self.config.max_grad_norm)
        kl_coef, entropy_coef = self.objective.kl_controller.coef, self.objective.entropy_coef
        sums = self.backend.share_loss_sums(dict(sums))  # a pipeline's losses ran on its last stage
        maxima = _pop_prefixed(sums, CORRECTION_MAX)
        if self.objective.collects_correction_sums:
            maxima = self.lockstep.max_over_ranks(maxima)
        sums = self.lockstep.sum_over_ranks(sums)
        correction_sums = _pop_prefixed(sums, CORRECTION_SUM)
        num_tokens = sums.pop("num_tokens")
        loss = sums.pop("loss_total") / len(grad_norms)  # the mean over optimizer steps of each mini-batch's loss
        metrics = {f"train/{name}": value / num_tokens for name, value in sums.items() if not name.startswith("off")}
        metrics["train/loss"] = loss
        metrics.update({name: value / num_tokens for name, value in sums.items() if name.startswith("off")})
        if self.objective.collects_correction_sums:
            metrics.update(correction_metrics(correction_sums, maxima))
        if algorithm.kl.in_reward:
            metrics["train/kl"] = self.reward_kl
        if algorithm.kl.needs_reference and math.isfinite(metrics["train/kl"]):
            self.objective.update_kl(metrics["train/kl"], len(rollouts))
        # a non-finite gradient norm means the backend skipped that optimizer step (NaN/Inf guard); under fp16 the
        # ones the loss scale answered by halving are dynamic scaling at work, not bad steps (`LossScaler`)
        finite = [norm for norm in grad_norms if math.isfinite(norm)]
        overflows = scaler.num_overflows - overflows_before if scaler is not None else 0
        metrics.update(
            {
                "train/grad_norm": sum(finite) / len(finite) if finite else float("nan"),
                "train/num_loss_tokens": num_tokens / algorithm.num_epochs,
                "train/num_sequences": float(len(rollouts)),
                "train/num_optimizer_steps": float(len(finite)),
                "train/num_nonfinite_updates": float(len(grad_norms) - len(finite) - overflows),
                "train/kl_coef": kl_coef,
            }
        )
        if scaler is not None:
            metrics |= {"train/loss_scale": scaler.scale, "train/num_loss_scale_overflows": float(overflows)}
        if skip_above is not None:
            metrics["train/num_skipped_updates"] = float(sum(norm > skip_above for norm in finite))
            metrics["train/num_optimizer_steps"] -= metrics["train/num_skipped_updates"]
        if algorithm.entropy.target is not None:
            metrics["entropy/coef"] = entropy_coef
            self.objective.update_entropy(metrics.get("train/entropy", math.nan))
        if critic_step is not None:
            metrics.update(critic_step.metrics())
        if distill_step is not None:
            metrics.update(distill_step.metrics(self.backend.all_reduce_sum, self.backend.num_ranks))
        return metrics

    def _start_routes(self, rollouts: list[Rollout]) -> dict[str, float]:
        """A Mixture-of-Experts step's `RouteStep`, and the ``moe/`` measurement of the engine's routes against the
        trainer's before any update. Collective; {} for a dense policy."""
        if self.router is None:
            return {}
        self._routes = RouteStep(self.router, self.config.moe, rollouts, lockstep=self.lockstep)

        def score(micro: MicroBatch, routes: Routes | None) -> TokenScores:
            inputs = replace(self._policy_inputs(micro), routes=routes)
            return self.backend.score_micro_batches(
                [inputs], temperature=self.temperature, sampling_mask=self.sampling_mask
            )[0]

        return self._routes.measure_engine(
            rollouts,
            score=score,
            micro_batch_size=self.config.micro_batch_size,
            pad_token_id=self.pad_token_id,
            device=self.backend.device,
        )

    def _finish_routes(self) -> dict[str, float]:
        """The ``moe/train_*`` metrics of this step's training passes (collective); {} for a dense policy."""
        return {} if self._routes is None else self._routes.finish(self.backend.share_loss_sums)

    def _with_routes(self, micro: MicroBatch, chunk: list[Rollout]) -> MicroBatch:
        """``micro`` with this step's routes of ``chunk`` to replay (`RouteStep.with_routes`)."""
        return micro if self._routes is None else self._routes.with_routes(micro, chunk)

    def _check_images(self, rollouts: list[Rollout]) -> None:
        """Rollouts with images train with the policy, the reference policy, the critic and a teacher that scores the
        student's own prompts token by token: what scores them otherwise (a teacher prompt of its own, the top-k
        distillation, packed rows) takes no pixel inputs yet, so refuse rather than score image placeholders as if
        they were text."""
        if not any(r.images for r in rollouts):
            return
        teacher = self.teacher
        unsupported = [
            name
            for name, is_on in (
                ("trainer.distillation.teacher_prompt", teacher is not None and teacher.prompt is not None),
                ("trainer.distillation.top_k > 0", teacher is not None and self.config.distillation.top_k > 0),
                ("trainer.packing", self.config.packing),
            )
            if is_on
        ]
        if unsupported:
            raise ValueError(f"rollouts with images cannot be trained with {', '.join(unsupported)} yet")

    def _distillation_step(self, mini_batches: list[list[Rollout]]) -> DistillationStep | None:
        """The teacher's scores of this rank's rollouts (``trainer.distillation``), before any update."""
        if self.teacher is None:
            return None
        backend, top_k = self.backend, self.config.distillation.top_k
        student_top_k = None
        if top_k > 0 and isinstance(backend, SingleDeviceBackend):
            student_top_k = partial(backend.score_top_k, temperature=self.temperature, k=top_k)
        return DistillationStep(
            self.config.distillation,
            self.teacher,
            [r for mini_batch in mini_batches for r in self.lockstep.local_share(mini_batch)],
            micro_batch_size=self.config.micro_batch_size,
            pad_token_id=self.pad_token_id,
            temperature=self.temperature,
            student_top_k=student_top_k,
        )

    def _accumulate(
        self,
        rollouts: list[Rollout],
        old_logprobs: dict[int, list[float]] | None,
        critic_step: CriticStep | None,
        sums: dict[str, float],
        *,
        distill_step: DistillationStep | None = None,
    ) -> None:
        """Forward/backward this rank's micro-batches of one mini-batch, accumulating gradients and metric sums.
        The normaliser comes from the whole mini-batch (every rank has it), so the ranks' gradients sum to the
        single-device gradient."""
        algorithm = self.config.algorithm
        normalizer = self.objective.normalizer([r.num_loss_tokens for r in rollouts])
        selection = self._selection(rollouts, critic_step)
        weight_normalizer = self._weight_normalizer(rollouts, old_logprobs)
        mini_batch_tokens = sum(r.num_tokens for r in rollouts)
        local = self.lockstep.local_share(rollouts)
        passes: list[tuple[list[Rollout], bool, MicroBatch]] = []
        for chunk, is_filler in self.lockstep.chunks(local, filler=rollouts[:1], split=self._split_micro_batches):
            micro = pack_micro_batch(
                chunk,
                pad_token_id=self.pad_token_id,
                device=self.backend.device,
                is_packed=self.config.packing,
                old_logprobs=None if old_logprobs is None or is_filler else [old_logprobs[id(r)] for r in chunk],
                **_advantage_inputs(chunk, critic_step),
            )
            passes.append((chunk, is_filler, self._with_routes(micro, chunk)))
        reference_logprobs = self._reference_logprobs([micro for _, _, micro in passes])

        def micro_batch_loss(index: int, policy_scores: TokenScores) -> torch.Tensor:
            """The loss of pass ``index`` (on a pipeline: on its last stage alone, in the schedule's order)."""
            chunk, is_filler, micro = passes[index]
            scores = self._unpacked(micro, policy_scores)
            balance = None
            if self._routes is not None and not is_filler:
                balance = self._routes.training_pass(micro, policy_scores.routes, mini_batch_tokens=mini_batch_tokens)
            old = micro.old_logprobs if micro.old_logprobs is not None else scores.logprobs.detach()
            extra_loss = None
            if distill_step is not None:
                # the KL to the teacher from pi_old; advantage mode: plus the distillation advantage; loss mode:
                # the KL-to-teacher term (0 in advantage mode)
                micro = distill_step.with_advantages(chunk, micro, old, is_filler=is_filler)
                distill_sums = defaultdict(float) if is_filler else distill_step.sums
                extra_loss = partial(distill_step.micro_batch_loss, chunk, micro, scores.logprobs, sums=distill_sums)
            loss = self.objective.micro_batch_loss(
                micro,
                scores.logprobs,
                old,
                scores.entropy,
                normalizer,
                defaultdict(float) if is_filler else sums,
                extra_loss=extra_loss,
                selected=None if selection is None else _rows_of(selection, chunk, micro.loss_mask),
                weight_normalizer=weight_normalizer,
                reference_logprobs=None if reference_logprobs is None else reference_logprobs[index],
            )
            if critic_step is not None:
                value_loss = critic_step.micro_batch_loss(
                    micro,
                    mode=algorithm.aggregation,
                    normalizer=normalizer,
                    constant_length=self.objective.constant_length,
                )
                value_loss.backward()
            if balance is not None:  # trainer.moe.aux_loss_coef
                loss = loss + balance
            return loss * 0.0 if is_filler else loss  # a filler pass only keeps the ranks' collectives in step

        routes_step = self._routes
        trained_routes = self.backend.train_micro_batches(
            [
                self._policy_inputs(
                    micro,
                    balance_weight=0.0
                    if routes_step is None or is_filler
                    else routes_step.balance_weight(micro, mini_batch_tokens=mini_batch_tokens),
                )
                for _, is_filler, micro in passes
            ],
            micro_batch_loss,
            temperature=self.temperature,
            sampling_mask=self.sampling_mask,
            with_entropy=True,
            entropy_requires_grad=self.objective.entropy_coef > 0,
        )
        if trained_routes is not None and self._routes is not None:  # a pipeline's, known after its run
            for (_, is_filler, micro), routes in zip(passes, trained_routes, strict=True):
                if not is_filler:
                    self._routes.training_pass(micro, routes, mini_batch_tokens=mini_batch_tokens)

    def _reference_logprobs(self, micros: list[MicroBatch]) -> list[torch.Tensor] | None:
        """A sharded reference's logprobs of each of this rank's passes, scored before they train (collective: on a
        pipeline the loss runs on the last stage alone, where the other stages cannot join a reference forward);
        None where the reference scores inside the loss (a whole copy) or the KL is a reward."""
        reference = self.reference
        if not isinstance(reference, UpFrontReferenceScorer) or self.config.algorithm.kl.in_reward:
            return None
        inputs = [self._policy_inputs(micro) for micro in micros]
        logprobs = reference.score_micro_batches(inputs, temperature=self.temperature)
        return [
            self._unpacked(micro, TokenScores(logprobs=values, entropy=None)).logprobs
            for micro, values in zip(micros, logprobs, strict=True)
        ]

    def _weight_normalizer(self, rollouts: list[Rollout], old_logprobs: dict[int, list[float]] | None) -> float | None:
        """``off_policy_normalize``: the mean of the kept importance weights over the whole mini-batch (per token,
        or per sequence for sequence_tis), from every rank's share (collective), so that neither the micro-batch
        split nor the number of ranks changes it; 1 when nothing is kept, None when not normalising."""
        if not self.config.algorithm.off_policy_correction.normalizes_weights():
            return None
        assert old_logprobs is not None, "normalised weights make `step` score the old logprobs first"
        local = self.lockstep.local_share(rollouts)
        terms = {"weight_sum": 0.0, "count": 0.0}
        if local:
            old = [old_logprobs[id(r)] for r in local]
            whole = pack_micro_batch(
                local, pad_token_id=self.pad_token_id, device=torch.device("cpu"), is_packed=False, old_logprobs=old
            )
            terms = self.objective.weight_normalizer_terms(whole)
        terms = self.lockstep.sum_over_ranks(terms)
        return terms["weight_sum"] / terms["count"] if terms["count"] > 0 else 1.0

    def _selection(self, rollouts: list[Rollout], critic_step: CriticStep | None) -> dict[int, torch.Tensor] | None:
        """The tokens a Clip-Cov / KL-Cov loss treats apart, over the whole mini-batch (every rank computes the
        same), keyed by rollout id, so the selection does not depend on the micro-batch split; None for other
        losses. The advantages are the rollouts' (or the critic's)."""
        if not self.objective.selects_tokens:
            return None
        whole = pack_micro_batch(
            rollouts,
            pad_token_id=self.pad_token_id,
            device=torch.device("cpu"),
            is_packed=False,
            **_advantage_inputs(rollouts, critic_step),
        )
        selected = self.objective.select_tokens(whole)
        assert selected is not None, "a loss that selects tokens returns them"
        return {id(r): selected[row][whole.loss_mask[row]] for row, r in enumerate(rollouts)}

    def _policy_inputs(self, micro: MicroBatch, *, balance_weight: float = 0.0) -> ScoreInputs:
        """What the policy scores of ``micro``: its packed row when it has one, else its padded rows (with their
        prompts' lengths when prompts are computed once); ``balance_weight``: `ScoreInputs.balance_weight`."""
        packed = micro.packed
        if packed is None:
            return ScoreInputs(
                input_ids=micro.input_ids,
                attention_mask=micro.attention_mask,
                target_mask=micro.loss_mask,
                prompt_lengths=micro.prompt_lengths if self._shares_prompts(micro) else None,
                images=micro.images,
                routes=micro.routes,
                balance_weight=balance_weight,
            )
        return ScoreInputs(
            input_ids=packed.input_ids,
            attention_mask=None,
            target_mask=packed.target_mask,
            position_ids=packed.position_ids,
            routes=micro.routes,
            balance_weight=balance_weight,
        )

    @staticmethod
    def _unpacked(micro: MicroBatch, scores: TokenScores) -> TokenScores:
        """The policy's scores of `_policy_inputs(micro)` on ``micro``'s padded rows ([batch, seq - 1])."""
        if micro.packed is None:
            return scores
        entropy = None if scores.entropy is None else unpack_scores(scores.entropy, micro)
        return TokenScores(logprobs=unpack_scores(scores.logprobs, micro), entropy=entropy)

    def _split_micro_batches(self, rollouts: list[Rollout]) -> list[list[Rollout]]:
        """The policy's micro-batches: by a token budget with packing, else by count (a prompt's samples together
        when prompts are shared)."""
        if self.config.packing:
            return split_micro_batches_by_tokens(rollouts, self.config.micro_batch_tokens)
        by_prompt = self.config.share_prompt and self.backend.num_ranks == 1 and self.router is None
        return split_micro_batches(rollouts, self.config.micro_batch_size, by_prompt=by_prompt)

    def _shares_prompts(self, micro: MicroBatch) -> bool:
        """Whether ``micro`` is scored with its shared prompts computed once: ``trainer.share_prompt``, one device
        (the FSDP2 backend takes whole rows), and two rows at least with the same prompt."""
        if not self.config.share_prompt or self.backend.num_ranks != 1 or len(micro.prompt_lengths) < 2:
            return False
        if self.router is not None:  # routes are laid out over whole rows (trainer.routes)
            return False
        if micro.images:  # image rows run whole: the shared-prompt pass has no pixel inputs
            return False
        rows = zip(micro.input_ids, micro.prompt_lengths, strict=True)
        prompts = {tuple(row[:length].tolist()) for row, length in rows}
        return len(prompts) < len(micro.prompt_lengths)

    @torch.no_grad()
    def _score_completions(
        self,
        rollouts: list[Rollout],
        score: Callable[[list[MicroBatch]], list[TokenScores]],
        *,
        filler: list[Rollout] | None = None,
        routes: dict[int, torch.Tensor] | None = None,
        engine_routes: bool = False,
    ) -> dict[int, list[float]]:
        """``score(micros)`` ([batch, seq - 1] logprobs each) on every rollout's completion tokens, keyed by rollout
        id, without gradient. Advantages may not exist yet (the KL penalties feed them), so copies with a placeholder
        are packed. ``filler``: when ``score`` runs the (possibly sharded) policy, pad to the ranks' most
        micro-batches; its passes replay this step's routes. ``routes``: filled with each rollout's captured
        ``[tokens, layers, top_k]`` expert routes (a Mixture-of-Experts policy). ``engine_routes``: each micro-batch
        carries the routes its rollouts came with (``micro.routes``, over its padded rows), for ``score`` to replay."""
        if filler is None:
            chunks = [(chunk, False) for chunk in split_micro_batches(rollouts, self.config.micro_batch_size)]
        else:
            chunks = self.lockstep.chunks(rollouts, filler=filler, split=self._split_micro_batches)
        is_packed = self.config.packing and filler is not None  # the policy's passes; the reference's are padded
        micros = [
            pack_micro_batch(
                [replace(r, advantage=0.0) for r in chunk],
                pad_token_id=self.pad_token_id,
                device=self.backend.device,
                is_packed=is_packed,
            )
            for chunk, _ in chunks
        ]
        if filler is not None:
            micros = [self._with_routes(micro, chunk) for (chunk, _), micro in zip(chunks, micros, strict=True)]
        elif engine_routes:
            for (chunk, _), micro in zip(chunks, micros, strict=True):
                given = [None if r.routes is None else routes_tensor(r.routes) for r in chunk]
                micro.routes = micro.row_routes = forward_routes(micro, given)
        scored: dict[int, list[float]] = {}
        for (chunk, is_filler), micro, values in zip(chunks, micros, score(micros), strict=True):
            if is_filler:
                continue
            for row, rollout in enumerate(chunk):
                scored[id(rollout)] = values.logprobs[row][micro.loss_mask[row]].tolist()
            if routes is not None and values.routes is not None:
                routes.update(zip(map(id, chunk), rollout_routes(micro, values.routes), strict=True))
        return scored

    def _old_logprobs(self, rollouts: list[Rollout], *, filler: list[Rollout]) -> dict[int, list[float]]:
        """The policy's logprobs of every completion token before this step's first update, keyed by rollout id."""

        def score(micros: list[MicroBatch]) -> list[TokenScores]:
            inputs = [self._policy_inputs(micro) for micro in micros]
            scores = self.backend.score_micro_batches(
                inputs, temperature=self.temperature, sampling_mask=self.sampling_mask
            )
            return [replace(self._unpacked(micro, s), routes=s.routes) for micro, s in zip(micros, scores, strict=True)]

        route_step = self._routes
        captured: dict[int, torch.Tensor] | None = None
        if route_step is not None and route_step.captures_old_policy:
            captured = {}  # R2: the old policy's routes, replayed in this step's training passes
        scored = self._score_completions(rollouts, score, filler=filler, routes=captured)
        if route_step is not None and captured is not None:
            route_step.replay_old_policy(captured)
        return scored

    def kl_penalties(self, rollouts: list[Rollout]) -> list[list[float]]:
        """Per-token reward penalties -kl_coef * KL_t(engine || reference) for ``kl.type = "reward"``: the behaviour
        policy's logprobs are the engine's, so only the reference runs a forward pass."""
        reference = self.reference
        if reference is None:
            raise ValueError('kl_penalties needs a reference policy (trainer.algorithm.kl.type = "reward")')
        # R3: the reference replays the engine's routes, as the policy's passes do (R2's exist only in the step)
        replays = self.router is not None and self.config.moe.routing_replay == "r3"
        kl = self._score_completions(
            rollouts,
            lambda micros: [
                TokenScores(
                    logprobs=self.objective.kl_penalty_terms(
                        micro.engine_logprobs,
                        reference.token_logprobs(
                            micro.input_ids,
                            micro.attention_mask,
                            micro.loss_mask,
                            temperature=self.temperature,
                            images=micro.images,
                            routes=micro.routes,
                        ),
                    ),
                    entropy=None,
                )
                for micro in micros
            ],
            engine_routes=replays,
        )
        values = [value for row in kl.values() for value in row]
        self.reward_kl = sum(values) / max(len(values), 1)  # what the adaptive controller steers in this mode
        coef = self.objective.kl_controller.coef
        return [[-coef * value for value in kl[id(r)]] for r in rollouts]

    @torch.no_grad()
    def compute_logprobs(self, token_ids: list[int], images: tuple[ImagePart, ...] = ()) -> list[float]:
        """Logprobs of ``token_ids[1:]`` given their prefixes under the current weights (temperature 1), in the
        master weights' dtype without autocast: the weight-sync probe checks weights, not autocast rounding.
        ``images``: those the ids hold placeholders for (an image prompt's parity probe)."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.backend.device)
        mask = torch.ones_like(ids)
        target_mask = torch.ones((1, len(token_ids) - 1), dtype=torch.bool, device=self.backend.device)
        if images:
            scores = self.backend.score_tokens(
                ids, mask, target_mask, temperature=1.0, use_autocast=False, images=[images]
            )
            return scores.logprobs[0].tolist()
        logprobs = self.backend.token_logprobs(ids, mask, target_mask, temperature=1.0, use_autocast=False)
        return logprobs[0].tolist()

    def probe(self, token_ids: list[int]) -> ProbeScores:
        """`compute_logprobs` for the weight-sync probe, with a Mixture-of-Experts policy's routes when it records
        them (`routes.probe_scores`): an engine that can replays them, so the check compares the weights, not a
        route that the engine's rounding flipped."""
        return probe_scores(self.backend, token_ids) or ProbeScores(logprobs=self.compute_logprobs(token_ids))

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.backend.named_weights()

    def weight_shards(self) -> list[WeightShard]:
        """This rank's pieces of the weights, for the direct weight sync (`TrainerBackend.weight_shards`)."""
        return self.backend.weight_shards()

    def snapshot_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The current weights copied to host memory: a snapshot that later steps do not change (async mode
        publishes one per version)."""
        return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in self.named_weights()]

    def save_checkpoint(self, folder: Path) -> None:
        self.backend.save(folder)
        if self.critic is not None:
            self.critic.save(folder / "critic")
        if self.backend.is_writer:
            (folder / "trainer.json").write_text(json.dumps(self.objective.state()))

    def load_checkpoint(self, folder: Path) -> None:
        self.backend.load(folder)
        if self.critic is not None:
            self.critic.load(folder / "critic")
        self.objective.load_state(json.loads((folder / "trainer.json").read_text()))

    def export(self, folder: Path) -> None:
        self.backend.export(folder)
