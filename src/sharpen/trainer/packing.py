"""Packing rollouts into padded micro-batches of tensors (the trainer's only view of rollouts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sharpen.types import Rollout


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    """Right-padded tensors for one forward/backward pass. Position t of the ``[batch, seq - 1]`` tensors refers to
    predicting ``input_ids[:, t + 1]``."""

    input_ids: torch.Tensor  # [batch, seq]
    attention_mask: torch.Tensor  # [batch, seq]
    loss_mask: torch.Tensor  # [batch, seq - 1] bool: completion tokens
    engine_logprobs: torch.Tensor  # [batch, seq - 1] behaviour logprobs (0 outside the mask)
    advantages: torch.Tensor  # [batch, 1] one per sequence, or [batch, seq - 1] per token (GAE; 0 outside the mask)
    old_logprobs: torch.Tensor | None = None  # [batch, seq - 1] the policy's before this step (multi-update steps)
    old_values: torch.Tensor | None = None  # [batch, seq - 1] the critic's before this step (PPO with a critic)
    returns: torch.Tensor | None = None  # [batch, seq - 1] the critic's regression targets (PPO with a critic)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def pack_micro_batch(
    rollouts: list[Rollout],
    *,
    pad_token_id: int,
    device: torch.device,
    old_logprobs: list[list[float]] | None = None,
    token_advantages: list[list[float]] | None = None,
    old_values: list[list[float]] | None = None,
    returns: list[list[float]] | None = None,
) -> MicroBatch:
    """Right-pad ``rollouts`` into one `MicroBatch`. The optional per-token inputs hold one list per rollout, one
    value per trained completion token (`Rollout.num_loss_tokens`), and are placed at those tokens' target
    positions (0 elsewhere). Tokens an environment appended (``rollout.loss_mask`` False) are inputs only.
    ``token_advantages`` replaces the rollouts' sequence advantages (``advantages`` is then [batch, seq - 1]);
    ``rollout.advantage`` must still be set, as the mark of a trainable rollout."""
    if not rollouts:
        raise ValueError("cannot pack an empty micro-batch")
    seq_len = max(r.num_tokens for r in rollouts)
    batch = len(rollouts)
    input_ids = torch.full((batch, seq_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, seq_len), dtype=torch.long)
    loss_mask = torch.zeros((batch, seq_len - 1), dtype=torch.bool)
    engine_logprobs = torch.zeros((batch, seq_len - 1), dtype=torch.float32)
    advantages = torch.zeros((batch, 1), dtype=torch.float32)
    per_token = {
        name: (lists, torch.zeros((batch, seq_len - 1), dtype=torch.float32))
        for name, lists in (
            ("old_logprobs", old_logprobs),
            ("advantages", token_advantages),
            ("old_values", old_values),
            ("returns", returns),
        )
        if lists is not None
    }
    for row, rollout in enumerate(rollouts):
        if rollout.advantage is None:
            raise ValueError(f"rollout {rollout.example.task_key} has no advantage; leave it out of the batch")
        tokens = rollout.prompt_ids + rollout.completion_ids
        input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        attention_mask[row, : len(tokens)] = 1
        start = len(rollout.prompt_ids) - 1  # target index of the first completion token
        positions = trained_positions(rollout, start)  # [num_loss_tokens]
        loss_mask[row, positions] = True
        engine_logprobs[row, positions] = torch.tensor(rollout.completion_logprobs, dtype=torch.float32)[
            positions - start
        ]
        advantages[row, 0] = rollout.advantage
        for lists, tensor in per_token.values():
            tensor[row, positions] = torch.tensor(lists[row], dtype=torch.float32)
    if "advantages" in per_token:
        advantages = per_token["advantages"][1]

    def optional(name: str) -> torch.Tensor | None:
        return per_token[name][1].to(device) if name in per_token else None

    return MicroBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        loss_mask=loss_mask.to(device),
        engine_logprobs=engine_logprobs.to(device),
        advantages=advantages.to(device),
        old_logprobs=optional("old_logprobs"),
        old_values=optional("old_values"),
        returns=optional("returns"),
    )


def trained_positions(rollout: Rollout, start: int) -> torch.Tensor:
    """Target indices of the rollout's trained completion tokens, the first completion token's being ``start``."""
    if rollout.loss_mask is None:
        return torch.arange(start, start + len(rollout.completion_ids))
    return start + torch.tensor(rollout.loss_mask, dtype=torch.bool).nonzero().flatten()


def split_micro_batches(rollouts: list[Rollout], micro_batch_size: int) -> list[list[Rollout]]:
    """Chunks of ``micro_batch_size`` after sorting by length (less padding). The order never changes the step's
    gradient, because losses are summed and divided by the whole batch's token count."""
    ordered = sorted(rollouts, key=lambda r: r.num_tokens)
    return [ordered[i : i + micro_batch_size] for i in range(0, len(ordered), micro_batch_size)]
