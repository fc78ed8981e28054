"""The reference policy of a sharded trainer (``runtime.trainer_ranks > 1``), split as the policy is.

Owns `ShardedReference`: a second `FSDP2Backend` of the initial weights under the policy's `ParallelLayout` (FSDP2,
tensor, context and pipeline parallelism), frozen, with no optimizer state. Each rank holds its share of it
instead of a whole copy (`frozen.ReferencePolicy`), which a model that needs tensor or pipeline parallelism cannot
afford. It scores with the policy's own kernels and reductions, so the KL before the first update is exactly 0 on
every layout.

Scoring it is collective: every rank calls it with the same number of micro-batches, in turn. On a pipeline the RL
loss runs on the last stage alone, where the other stages cannot join a reference forward, so the trainer scores a
mini-batch's passes with it before the schedule (`score_micro_batches`), as it does the old logprobs;
`token_logprobs` serves the reward-KL penalties, which every rank computes for the same rollouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from sharpen.config.lora import LoraConfig
from sharpen.config.schema import TrainerConfig
from sharpen.expert_routes import Routes
from sharpen.trainer.backends.base import ScoreInputs
from sharpen.trainer.backends.fsdp2 import FSDP2Backend
from sharpen.trainer.layout import ParallelLayout
from sharpen.types import ImagePart


class ShardedReference:
    """The frozen initial policy, sharded by ``layout`` like the trainer's `FSDP2Backend` (see the module docstring).
    Build it on every rank, after the policy's backend, with the same layout and seed."""

    def __init__(
        self, config: TrainerConfig, *, model_path: Path, dtype: str, layout: ParallelLayout, seed: int = 0
    ) -> None:
        # the base weights without adapters (a LoRA run's initial policy), and no activations kept for a backward
        frozen = config.model_copy(update={"lora": LoraConfig(), "gradient_checkpointing": False})
        self.backend = FSDP2Backend(frozen, model_path=model_path, dtype=dtype, layout=layout, seed=seed)
        self.backend.model.requires_grad_(False)
        self.backend.optimizer.param_groups.clear()  # never steps; holds no references to the weights
        self.device = self.backend.device

    @torch.no_grad()
    def score_micro_batches(self, inputs: Sequence[ScoreInputs], *, temperature: float) -> list[torch.Tensor]:
        """The logprobs of each micro-batch of ``inputs``, on every rank (collective)."""
        return [scores.logprobs for scores in self.backend.score_micro_batches(inputs, temperature=temperature)]

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        target_mask: torch.Tensor,
        *,
        temperature: float,
        images: Sequence[tuple[ImagePart, ...]] = (),
        routes: Routes | None = None,
    ) -> torch.Tensor:
        """`ReferenceScorer.token_logprobs` of one micro-batch (collective: every rank scores the same rows)."""
        inputs = ScoreInputs(
            input_ids=input_ids,
            attention_mask=attention_mask,
            target_mask=target_mask,
            images=tuple(images),
            routes=routes,
        )
        return self.score_micro_batches([inputs], temperature=temperature)[0]
