"""Packing rollouts into micro-batches of tensors (the trainer's only view of rollouts).

A `MicroBatch` always holds one right-padded row per rollout: the loss code reads those (per-sequence quantities,
sequence-level ratios and aggregation need a row per sequence). With packing (``trainer.packing``) it also holds
the model's input as one `PackedRow`: the rollouts end to end without padding, positions restarting at 0 at each
rollout, so that the forward pass costs the real tokens only; `unpack_scores` puts the packed row's per-token
values back on the padded rows. Attention stays inside each rollout because the model derives a block-diagonal
mask from the restarting positions when it is given no attention mask (transformers' packed-sequence detection;
`scoring.score_tokens`). The split into micro-batches is by count (`split_micro_batches`) or by a token
budget (`split_micro_batches_by_tokens`); this module does not decide which, nor split across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sharpen.expert_routes import Routes
from sharpen.types import ImagePart, Rollout


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
    packed: PackedRow | None = None  # the model's input without padding (``trainer.packing``)
    prompt_lengths: tuple[int, ...] = ()  # each row's prompt tokens (rows with equal prompts can share one pass)
    images: tuple[tuple[ImagePart, ...], ...] = ()  # each row's images (`Rollout.images`); () when no row has any
    routes: Routes | None = None  # expert routes to replay in the forward (`trainer.routes.forward_routes`)
    row_routes: Routes | None = None  # the same on the padded rows (what a reference policy scores)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass(kw_only=True, slots=True)
class PackedRow:
    """A micro-batch's rollouts end to end in one row, without padding. Position t of ``target_mask`` refers to
    predicting ``input_ids[0, t + 1]``; it is set exactly at the micro-batch's loss-mask targets, in the same order
    (rollout by rollout, then by position), and never across a rollout boundary."""

    input_ids: torch.Tensor  # [1, num_tokens]
    position_ids: torch.Tensor  # [1, num_tokens] 0, 1, ... restarting at every rollout
    target_mask: torch.Tensor  # [1, num_tokens - 1] bool

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def pack_micro_batch(
    rollouts: list[Rollout],
    *,
    pad_token_id: int,
    device: torch.device,
    is_packed: bool = False,
    old_logprobs: list[list[float]] | None = None,
    token_advantages: list[list[float]] | None = None,
    old_values: list[list[float]] | None = None,
    returns: list[list[float]] | None = None,
) -> MicroBatch:
    """Right-pad ``rollouts`` into one `MicroBatch`. The optional per-token inputs hold one list per rollout, one
    value per trained completion token (`Rollout.num_loss_tokens`), and are placed at those tokens' target
    positions (0 elsewhere). Tokens an environment appended (``rollout.loss_mask`` False) are inputs only.
    ``token_advantages`` replaces the rollouts' sequence advantages (``advantages`` is then [batch, seq - 1]);
    ``rollout.advantage`` must still be set, as the mark of a trainable rollout. ``is_packed``: also build the
    `PackedRow` of the rollouts (in this order); rollouts with images are never packed (a vision model derives its
    3-D positions per right-padded row)."""
    if not rollouts:
        raise ValueError("cannot pack an empty micro-batch")
    images = tuple(r.images for r in rollouts) if any(r.images for r in rollouts) else ()
    if is_packed and images:
        raise ValueError(
            "trainer.packing: rollouts with images cannot be packed into one row (a vision model's 3-D positions "
            "are computed per row); set trainer.packing = false for image prompts"
        )
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
        packed=pack_row(rollouts, device=device) if is_packed else None,
        prompt_lengths=tuple(len(r.prompt_ids) for r in rollouts),
        images=images,
    )


def pack_row(rollouts: list[Rollout], *, device: torch.device) -> PackedRow:
    """The rollouts' tokens end to end, each with positions from 0, and their trained targets."""
    input_ids, position_ids, target_mask = [], [], []
    for rollout in rollouts:
        tokens = rollout.prompt_ids + rollout.completion_ids
        is_target = torch.zeros(len(tokens), dtype=torch.bool)  # index t: predicting tokens[t + 1]
        is_target[trained_positions(rollout, len(rollout.prompt_ids) - 1)] = True
        input_ids.append(torch.tensor(tokens, dtype=torch.long))
        position_ids.append(torch.arange(len(tokens)))
        target_mask.append(is_target)  # its last entry (the boundary to the next rollout) is never a target
    return PackedRow(
        input_ids=torch.cat(input_ids)[None].to(device),
        position_ids=torch.cat(position_ids)[None].to(device),
        target_mask=torch.cat(target_mask)[None, :-1].to(device),
    )


def unpack_scores(values: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
    """Per-token values of ``micro``'s packed row ([1, num_tokens - 1], as `score_tokens` returns them) on its
    padded rows: [batch, seq - 1], 0 outside the loss mask. Differentiable."""
    assert micro.packed is not None, "a micro-batch packed with is_packed=True"
    rows = torch.zeros(micro.loss_mask.shape, dtype=values.dtype, device=values.device)  # [batch, seq - 1]
    rows[micro.loss_mask] = values[micro.packed.target_mask]
    return rows


def trained_positions(rollout: Rollout, start: int) -> torch.Tensor:
    """Target indices of the rollout's trained completion tokens, the first completion token's being ``start``."""
    if rollout.loss_mask is None:
        return torch.arange(start, start + len(rollout.completion_ids))
    return start + torch.tensor(rollout.loss_mask, dtype=torch.bool).nonzero().flatten()


def split_micro_batches(
    rollouts: list[Rollout], micro_batch_size: int, *, by_prompt: bool = False
) -> list[list[Rollout]]:
    """Chunks of ``micro_batch_size`` after sorting by length (less padding), or with ``by_prompt`` by prompt
    first, so that the samples of a prompt land in one micro-batch and share its prompt pass. The order never
    changes the step's gradient, because losses are summed and divided by the whole batch's token count."""
    if by_prompt:
        ordered = sorted(rollouts, key=lambda r: (len(r.prompt_ids), r.prompt_ids, r.num_tokens))
    else:
        ordered = sorted(rollouts, key=lambda r: r.num_tokens)
    return [ordered[i : i + micro_batch_size] for i in range(0, len(ordered), micro_batch_size)]


def split_micro_batches_by_tokens(rollouts: list[Rollout], max_tokens: int) -> list[list[Rollout]]:
    """Micro-batches of at most ``max_tokens`` tokens (`Rollout.num_tokens`) each, for packing; a rollout longer than
    ``max_tokens`` forms one alone. First-fit decreasing: longest first (ties by position), each into the first
    micro-batch with room, so few micro-batches and each nearly full. Deterministic (every rank computes the same);
    the order never changes the step's gradient (see `split_micro_batches`)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    order = sorted(range(len(rollouts)), key=lambda index: (-rollouts[index].num_tokens, index))
    chunks: list[list[Rollout]] = []
    loads: list[int] = []
    for index in order:
        rollout = rollouts[index]
        fits = next((c for c, load in enumerate(loads) if load + rollout.num_tokens <= max_tokens), None)
        if fits is None:
            chunks.append([rollout])
            loads.append(rollout.num_tokens)
        else:
            chunks[fits].append(rollout)
            loads[fits] += rollout.num_tokens
    return chunks
