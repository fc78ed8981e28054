"""The critic's part of one trainer step (PPO with a critic, ``advantage = "gae"``).

Before the step's first update, `CriticStep` runs the value model over every rollout without gradient, puts the
rollout's score on its last completion token as the only reward, and turns the two into per-token advantages and
returns with GAE (whitened over the step's tokens when configured); a truncated completion (``is_truncated``) is
bootstrapped with the value of the state after its last token. During the update it supplies those targets
to packing and computes the clipped value loss of each micro-batch, aggregated like the policy loss, so the critic
trains on the same mini-batches and epochs as the policy. It owns no parameters (`ValueModel` does) and does not
decide when the optimizers step (`Trainer.step` does).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from sharpen.config.algorithm import CriticConfig
from sharpen.trainer.algorithms.advantages import StdConvention
from sharpen.trainer.algorithms.aggregation import AggregationMode, aggregate_loss
from sharpen.trainer.algorithms.estimators import compute_gae, whiten
from sharpen.trainer.algorithms.value import compute_value_loss
from sharpen.trainer.backends.critic import ValueModel
from sharpen.trainer.packing import MicroBatch, pack_micro_batch, split_micro_batches
from sharpen.types import Rollout


@dataclass(kw_only=True, slots=True)
class CriticTargets:
    """One rollout's per-completion-token quantities, fixed for the whole step."""

    advantages: list[float]
    old_values: list[float]
    returns: list[float]


def sequence_score(rollout: Rollout) -> float:
    if rollout.reward is None or rollout.reward.score is None:
        raise ValueError(
            f"rollout {rollout.example.task_key} has an advantage but no reward score; GAE needs the score "
            "(abstained rollouts must keep advantage = None)"
        )
    return rollout.reward.score


class CriticStep:
    def __init__(
        self,
        critic: ValueModel,
        config: CriticConfig,
        rollouts: list[Rollout],
        *,
        micro_batch_size: int,
        pad_token_id: int,
        std: StdConvention = "unbiased",
    ) -> None:
        self.critic = critic
        self.config = config
        self.std: StdConvention = std  # the whitening's std convention (trainer.algorithm.advantage.std)
        self.sums: dict[str, float] = defaultdict(float)
        self.grad_norms: list[float] = []
        self.targets, self.start_metrics = self._compute_targets(
            rollouts, micro_batch_size=micro_batch_size, pad_token_id=pad_token_id
        )

    @torch.no_grad()
    def _compute_targets(
        self, rollouts: list[Rollout], *, micro_batch_size: int, pad_token_id: int
    ) -> tuple[dict[int, CriticTargets], dict[str, float]]:
        """GAE advantages, old values and returns per rollout (keyed by id), from the critic before any update;
        and the metrics of those values."""
        raw: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for chunk in split_micro_batches(rollouts, micro_batch_size):
            micro = pack_micro_batch(chunk, pad_token_id=pad_token_id, device=self.critic.device)
            mask = micro.loss_mask  # [batch, seq - 1]
            values, final_values = self.critic.values_and_final_values(
                micro.input_ids, micro.attention_mask, mask, micro.images
            )
            rewards = torch.zeros_like(values)  # [batch, seq - 1]: the score lands on the last completion token
            last = mask.shape[1] - 1 - mask.flip(1).int().argmax(dim=1)  # [batch]
            scores = torch.tensor([sequence_score(r) for r in chunk], dtype=torch.float32, device=values.device)
            rewards[torch.arange(len(chunk), device=values.device), last] = scores
            for row, rollout in enumerate(chunk):  # per-token terms (the KL penalty) on their own tokens
                if rollout.token_rewards is not None:
                    rewards[row, mask[row]] += torch.tensor(rollout.token_rewards, device=values.device)
            # A completion cut at the token limit is not terminal: GAE bootstraps it with V of the state after its
            # last token; a finished one ends there (bootstrap 0).
            truncated = torch.tensor([r.is_truncated for r in chunk], dtype=torch.bool, device=values.device)
            bootstrap = torch.where(truncated, final_values, torch.zeros_like(final_values))  # [batch]
            advantages, returns = compute_gae(
                rewards, values, mask, gamma=self.config.gamma, lam=self.config.lam, bootstrap_values=bootstrap
            )
            for row, rollout in enumerate(chunk):
                keep = mask[row]
                raw[id(rollout)] = (advantages[row][keep], values[row][keep], returns[row][keep])
        flat_advantages = torch.cat([raw[id(r)][0] for r in rollouts])  # [num_tokens]
        flat_values = torch.cat([raw[id(r)][1] for r in rollouts])  # [num_tokens]
        flat_returns = torch.cat([raw[id(r)][2] for r in rollouts])  # [num_tokens]
        if self.config.whiten_advantages:
            flat_advantages = whiten(flat_advantages, torch.ones_like(flat_advantages, dtype=torch.bool), std=self.std)
        targets: dict[int, CriticTargets] = {}
        offset = 0
        for rollout in rollouts:
            end = offset + rollout.num_loss_tokens
            targets[id(rollout)] = CriticTargets(
                advantages=flat_advantages[offset:end].tolist(),
                old_values=flat_values[offset:end].tolist(),
                returns=flat_returns[offset:end].tolist(),
            )
            offset = end
        return targets, value_metrics(flat_values, flat_returns)

    def pack_inputs(self, chunk: list[Rollout]) -> dict[str, list[list[float]]]:
        """Keyword arguments of `pack_micro_batch` for the per-token advantages, old values and returns."""
        targets = [self.targets[id(r)] for r in chunk]
        return {
            "token_advantages": [t.advantages for t in targets],
            "old_values": [t.old_values for t in targets],
            "returns": [t.returns for t in targets],
        }

    def micro_batch_loss(
        self, micro: MicroBatch, *, mode: AggregationMode, normalizer: float, constant_length: float
    ) -> torch.Tensor:
        """This micro-batch's share of the mini-batch's value loss (call ``backward`` on it)."""
        assert micro.old_values is not None and micro.returns is not None, "pack with pack_inputs()"
        # [batch, seq - 1]
        values = self.critic.values(micro.input_ids, micro.attention_mask, micro.loss_mask, micro.images)
        # value_clip = 0 is "off" in the config (TOML has no null to spell None)
        per_token, loss_metrics = compute_value_loss(
            values, micro.old_values, micro.returns, micro.loss_mask, value_clip=self.config.value_clip or None
        )
        loss = aggregate_loss(per_token, micro.loss_mask, mode, normalizer=normalizer, constant_length=constant_length)
        self.sums["value_loss_total"] += float(loss.detach())
        self.sums["num_tokens"] += float(micro.loss_mask.sum())
        self.sums["num_clipped"] += float(loss_metrics.num_clipped)
        return loss

    def clip_and_step(self, max_grad_norm: float) -> None:
        self.grad_norms.append(self.critic.clip_and_step(max_grad_norm))

    def metrics(self) -> dict[str, float]:
        num_updates = max(len(self.grad_norms), 1)
        grad_norm = sum(self.grad_norms) / num_updates
        return {
            **self.start_metrics,
            "critic/value_loss": self.sums["value_loss_total"] / num_updates,
            "critic/clip_fraction": self.sums["num_clipped"] / max(self.sums["num_tokens"], 1.0),
            "critic/grad_norm": grad_norm if math.isfinite(grad_norm) else float("nan"),
        }


def value_metrics(values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
    """Means and explained variance 1 - Var(R - V) / Var(R) over the step's tokens (flat [num_tokens] tensors), for
    the values the advantages were computed from. Explained variance is NaN when the returns do not vary."""
    variance = float(returns.var(unbiased=False))
    residual = float((returns - values).var(unbiased=False))
    return {
        "critic/value_mean": float(values.mean()),
        "critic/return_mean": float(returns.mean()),
        "critic/explained_variance": 1.0 - residual / variance if variance > 0 else float("nan"),
    }
