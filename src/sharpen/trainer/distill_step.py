"""The distillation part of one trainer step (``trainer.distillation``): the teacher's scores, as advantages or loss.

Before the step's first update, `DistillationStep` runs the frozen teacher once over every rollout of this rank
(without gradient, on the teacher's own prompt when it has one) and keeps its logprob of each trained token. Each
micro-batch pass then hands it the policy's logprobs before the step's update (pi_old, scored by the trainer with
the teacher's numerics: `with_advantages`); their per-token reverse KL to the teacher is the step's
``distill/reverse_kl`` and, in advantage mode, the distillation advantage added to each token's task advantage. In
loss mode `micro_batch_loss` adds coef * the KL estimator of the student's current logprobs against the teacher's,
or the top-k KL, which runs the teacher again on each micro-batch at the student's top-k tokens.

Why pi_old and not the engine's logprobs: the teacher runs in the trainer, so the student's side must be computed
the same way. The engine's logprobs differ from the trainer's by the engine's rounding (vLLM in bfloat16 against
the trainer's autocast over float32 weights; recipes/distill.toml measured engine/trainer ratios of 0.82-0.89 at p01
and 1.08-1.21 at p99): noise in every token's advantage as large as a small teacher/student gap, and a floor
KL(engine || trainer) under the measured mean (k3 0.0006-0.002 per token there) that no update removes. With pi_old
a teacher equal to the student measures exactly 0.

It owns no model (`TeacherPolicy` does) and does not decide the micro-batches or when the optimizer steps
(`Trainer.step` does); the formulas are `algorithms/distill.py`'s.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

import torch

from sharpen.config.algorithm import DistillationConfig
from sharpen.trainer.algorithms.distill import (
    distillation_advantages,
    quantile,
    reverse_kl_per_token,
    top_k_reverse_kl,
)
from sharpen.trainer.algorithms.kl import kl_per_token
from sharpen.trainer.backends.teacher import TeacherPolicy
from sharpen.trainer.packing import MicroBatch, pack_micro_batch, split_micro_batches
from sharpen.types import Rollout

StudentTopK = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(input_ids, attention_mask, target_mask) -> the student's top-k (ids, logprobs), each [num_targets, k], with
gradient (`SingleDeviceBackend.score_top_k` at the trainer's temperature and k)."""


class DistillationStep:
    def __init__(
        self,
        config: DistillationConfig,
        teacher: TeacherPolicy,
        rollouts: list[Rollout],
        *,
        micro_batch_size: int,
        pad_token_id: int,
        temperature: float,
        student_top_k: StudentTopK | None = None,
    ) -> None:
        if config.top_k > 0 and student_top_k is None:
            raise ValueError("trainer.distillation.top_k > 0 needs the student's top-k scores (single-device backend)")
        self.config = config
        self.teacher = teacher
        self.micro_batch_size = micro_batch_size
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.student_top_k = student_top_k
        self.teacher_logprobs: dict[int, list[float]] = {}  # keyed by rollout id: one per trained token
        self.reverse_kl: dict[int, torch.Tensor] = {}  # keyed by rollout id: rkl_t of pi_old, one per trained token
        self.sums: dict[str, float] = defaultdict(float)  # loss-mode terms, token-weighted
        self._ensure_scored(rollouts)

    def teacher_micro_batch(self, chunk: list[Rollout]) -> MicroBatch:
        """``chunk`` with each rollout's prompt replaced by the teacher's; the completions (and loss masks) are the
        student's, so the trained tokens come out in the same order as in the student's micro-batch."""
        placeholders = [replace(r, prompt_ids=self.teacher.prompt_ids(r), advantage=0.0, segments=[]) for r in chunk]
        return pack_micro_batch(placeholders, pad_token_id=self.pad_token_id, device=self.teacher.device)

    def _ensure_scored(self, rollouts: list[Rollout]) -> None:
        missing = [r for r in rollouts if id(r) not in self.teacher_logprobs]
        for chunk in split_micro_batches(missing, self.micro_batch_size):
            micro = self.teacher_micro_batch(chunk)
            logprobs = self.teacher.token_logprobs(
                micro.input_ids,
                micro.attention_mask,
                micro.loss_mask,
                temperature=self.temperature,
                images=micro.images,
            )  # [batch, seq - 1]
            for row, rollout in enumerate(chunk):
                self.teacher_logprobs[id(rollout)] = logprobs[row][micro.loss_mask[row]].tolist()

    def _teacher_rows(self, chunk: list[Rollout], mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """[batch, seq - 1] the teacher's logprobs at ``chunk``'s trained tokens (0 elsewhere), as ``like``."""
        self._ensure_scored(chunk)
        teacher = torch.zeros_like(like)
        teacher[mask] = torch.tensor(
            [lp for r in chunk for lp in self.teacher_logprobs[id(r)]], dtype=like.dtype, device=like.device
        )
        return teacher

    def with_advantages(
        self, chunk: list[Rollout], micro: MicroBatch, old_logprobs: torch.Tensor, *, is_filler: bool = False
    ) -> MicroBatch:
        """``micro`` for the policy loss. ``old_logprobs``: the policy's before this step's update, [batch, seq - 1]
        (the trainer's pi_old: what the first update's forward computes, or the stored ones of a multi-update step).
        Records each rollout's per-token rkl = log pi_old - log pi_teacher for the step's metric (the first time it
        is seen; never for a filler pass). Advantage mode: ``micro`` with each trained token's advantage (the
        rollout's, or the per-token one it already has) plus coef * the distillation advantage; loss mode: ``micro``
        unchanged."""
        mask = micro.loss_mask
        old = old_logprobs.detach().double()
        rkl = torch.where(mask, reverse_kl_per_token(old, self._teacher_rows(chunk, mask, old)), 0.0)
        if not is_filler:
            for row, rollout in enumerate(chunk):
                self.reverse_kl.setdefault(id(rollout), rkl[row][mask[row]].cpu())
        if self.config.mode != "advantage":
            return micro
        distill = distillation_advantages(rkl, mask, gamma=self.config.gamma)  # [batch, seq - 1], 0 off the mask
        task = micro.advantages.double()  # [batch, 1] or [batch, seq - 1]
        advantages = torch.where(mask, task + self.config.coef * distill, 0.0)
        return replace(micro, advantages=advantages.to(micro.advantages.dtype))

    def micro_batch_loss(
        self,
        chunk: list[Rollout],
        micro: MicroBatch,
        logprobs: torch.Tensor,
        aggregate: Callable[[torch.Tensor], torch.Tensor],
        *,
        sums: dict[str, float],
    ) -> torch.Tensor:
        """Loss mode: coef * the aggregated per-token KL term of this micro-batch (0 in advantage mode).
        ``logprobs``: the student's current ones, [batch, seq - 1] with gradient; ``aggregate``: the policy
        loss's aggregation (its mask and normaliser). ``sums``: where the term's token sums go (``self.sums``; a
        filler pass hands a throwaway)."""
        if self.config.mode != "loss":
            return logprobs.new_zeros(())
        mask = micro.loss_mask
        if self.config.top_k > 0:
            per_token = self._top_k_kl(chunk, micro, mask)
            name = "top_k_kl"
        else:
            teacher = self._teacher_rows(chunk, mask, logprobs.detach())  # [batch, seq - 1]
            per_token = kl_per_token(logprobs, teacher, self.config.kl_estimator, clamp=None)
            name = f"loss_{self.config.kl_estimator}"
        sums[name] += float(per_token.detach()[mask].sum())
        sums["num_tokens"] += float(mask.sum())
        return self.config.coef * aggregate(per_token)

    def _top_k_kl(self, chunk: list[Rollout], micro: MicroBatch, mask: torch.Tensor) -> torch.Tensor:
        """[batch, seq - 1] the top-k reverse KL at each trained token (0 elsewhere), with the student's gradient."""
        assert self.student_top_k is not None
        ids, student = self.student_top_k(micro.input_ids, micro.attention_mask, mask)  # [num_targets, k]
        rows = self.teacher_micro_batch(chunk)
        teacher = self.teacher.candidate_logprobs(
            rows.input_ids, rows.attention_mask, rows.loss_mask, ids, temperature=self.temperature
        )  # [num_targets, k], the same targets in the same order
        per_token = torch.zeros(mask.shape, dtype=student.dtype, device=student.device)
        per_token[mask] = top_k_reverse_kl(student, teacher)
        return per_token

    def metrics(
        self, all_reduce_sum: Callable[[dict[str, float]], dict[str, float]], num_ranks: int
    ) -> dict[str, float]:
        """``distill/reverse_kl`` (mean per token of log pi_old - log pi_teacher over the step's rollouts, every
        rank's), its p50 and p90 (on several ranks: the mean of the ranks' quantiles), and the loss-mode term's
        token mean."""
        values = torch.cat([torch.zeros(0, dtype=torch.float64), *self.reverse_kl.values()])
        local = {
            "rkl_sum": float(values.sum()),
            "rkl_count": float(values.numel()),
            "p50": quantile(values, 0.5) if values.numel() else 0.0,
            "p90": quantile(values, 0.9) if values.numel() else 0.0,
            **{f"term_{name}": value for name, value in self.sums.items()},
        }
        summed = all_reduce_sum(local)
        metrics = {
            "distill/reverse_kl": summed["rkl_sum"] / max(summed["rkl_count"], 1.0),
            "distill/reverse_kl_p50": summed["p50"] / num_ranks,
            "distill/reverse_kl_p90": summed["p90"] / num_ranks,
        }
        num_tokens = summed.pop("term_num_tokens", 0.0)
        for name, value in summed.items():
            if name.startswith("term_") and num_tokens:
                metrics[f"distill/{name.removeprefix('term_')}"] = value / num_tokens
        return metrics
