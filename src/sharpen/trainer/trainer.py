"""`Trainer.step(batch) -> metrics`: one optimizer step of the PPO-clip objective on a batch of rollouts.

The trainer recomputes logprobs of the rollouts' completion tokens, takes the importance ratio against the
engine's (behaviour) logprobs, and accumulates gradients over micro-batches with a token-mean normalised over
the whole step, so the micro-batch split never changes the update. It never imports rollout code: weights leave
through `named_weights()`, and orchestration decides where they go.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch

from sharpen.config.schema import TrainerConfig
from sharpen.trainer.algorithms import compute_mismatch_metrics, compute_ppo_clip_loss
from sharpen.trainer.backends import SingleDeviceBackend
from sharpen.trainer.packing import pack_micro_batch, split_micro_batches
from sharpen.types import TrainBatch


class Trainer:
    def __init__(
        self, config: TrainerConfig, *, backend: SingleDeviceBackend, pad_token_id: int, temperature: float = 1.0
    ) -> None:
        self.config = config
        self.backend = backend
        self.pad_token_id = pad_token_id
        self.temperature = temperature

    def step(self, batch: TrainBatch) -> dict[str, float]:
        rollouts = [r for r in batch.rollouts if r.advantage is not None and r.completion_ids]
        num_tokens = sum(len(r.completion_ids) for r in rollouts)
        algorithm = self.config.algorithm
        totals = {"loss": 0.0, "clipped": 0.0, "ratio": 0.0, "k1": 0.0, "k3": 0.0, "abs_diff": 0.0}
        abs_diff_max = 0.0
        for chunk in split_micro_batches(rollouts, self.config.micro_batch_size):
            micro = pack_micro_batch(chunk, pad_token_id=self.pad_token_id, device=self.backend.device)
            logprobs = self.backend.token_logprobs(
                micro.input_ids, micro.attention_mask, micro.loss_mask, temperature=self.temperature
            )
            out = compute_ppo_clip_loss(
                logprobs,
                micro.engine_logprobs,
                micro.advantages,
                micro.loss_mask,
                clip_eps_low=algorithm.clip_eps_low,
                clip_eps_high=algorithm.clip_eps_high,
                normalizer=num_tokens,
            )
            out.loss.backward()
            mismatch = compute_mismatch_metrics(logprobs, micro.engine_logprobs, micro.loss_mask)
            totals["loss"] += float(out.loss.detach())
            totals["clipped"] += float(out.num_clipped)
            totals["ratio"] += float(out.ratio_sum)
            totals["k1"] += float(mismatch["k1_sum"])
            totals["k3"] += float(mismatch["k3_sum"])
            totals["abs_diff"] += float(mismatch["abs_diff_sum"])
            abs_diff_max = max(abs_diff_max, float(mismatch["abs_diff_max"]))
        if num_tokens == 0:
            self.backend.optimizer.zero_grad(set_to_none=True)
            return {"train/num_loss_tokens": 0.0, "train/skipped": 1.0}
        grad_norm = self.backend.clip_and_step()
        return {
            "train/loss": totals["loss"],
            "train/grad_norm": grad_norm if math.isfinite(grad_norm) else float("nan"),
            "train/clip_fraction": totals["clipped"] / num_tokens,
            "train/ratio_mean": totals["ratio"] / num_tokens,
            "train/num_loss_tokens": float(num_tokens),
            "train/num_sequences": float(len(rollouts)),
            "mismatch/kl_k1": totals["k1"] / num_tokens,
            "mismatch/kl_k3": totals["k3"] / num_tokens,
            "mismatch/abs_logprob_diff_mean": totals["abs_diff"] / num_tokens,
            "mismatch/abs_logprob_diff_max": abs_diff_max,
        }

    @torch.no_grad()
    def compute_logprobs(self, token_ids: list[int]) -> list[float]:
        """Logprobs of ``token_ids[1:]`` given their prefixes under the current weights (temperature 1), in the
        master weights' dtype without autocast: the weight-sync probe checks weights, not autocast rounding."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.backend.device)
        mask = torch.ones_like(ids)
        target_mask = torch.ones((1, len(token_ids) - 1), dtype=torch.bool, device=self.backend.device)
        logprobs = self.backend.token_logprobs(ids, mask, target_mask, temperature=1.0, use_autocast=False)
        return logprobs[0].tolist()

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.backend.named_weights()

    def save_checkpoint(self, folder: Path) -> None:
        self.backend.save(folder)

    def load_checkpoint(self, folder: Path) -> None:
        self.backend.load(folder)

    def export(self, folder: Path) -> None:
        self.backend.export(folder)
