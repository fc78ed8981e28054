"""Shared-prompt scoring: rows of a micro-batch with identical prompt ids run that prompt through the model once.

`score_shared_prompts` is a drop-in for `score_tokens` on a right-padded micro-batch whose targets are completion
tokens. It makes two forward passes instead of one: the distinct prompts (each once), keeping every layer's keys and
values inside the autograd graph, then every row's completion, attending to its prompt's keys/values (expanded to
the rows, not copied, when the micro-batch holds one prompt) and to its own earlier completion tokens. A prompt's
gradient is the sum over the rows that read it, which autograd forms by itself. The result has `score_tokens`'
layout (``[batch, seq - 1]``, 0 outside the target mask), so the loss code is unchanged.

Owns the two passes, the two caches they use and the grouping of rows by prompt (`group_by_prompt`). It does not
decide whether to share (``trainer.share_prompt``) or how rollouts are split into micro-batches: sharing only saves
what the rows of one micro-batch have in common, so it pays when micro-batches hold whole groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from sharpen.trainer.algorithms.sampling_mask import SamplingMask
from sharpen.trainer.backends.base import TokenScores
from sharpen.trainer.backends.chunked_logits import score_on_grid

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def group_by_prompt(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Indices of ``prompts`` grouped by identical token ids, groups in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(index)
    return list(groups.values())


@dataclass(kw_only=True, slots=True)
class SharedPromptLayout:
    """A right-padded micro-batch rearranged for the two passes. Completion slot ``j`` of a row is its ``j``-th
    completion token, the target at index ``prompt_length - 1 + j`` of the micro-batch's ``[batch, seq - 1]``."""

    prompt_ids: torch.Tensor  # [num_prompts, max_prompt_len] right-padded, each distinct prompt once
    prompt_mask: torch.Tensor  # [num_prompts, max_prompt_len]
    prompt_lengths: torch.Tensor  # [num_prompts]
    row_prompt: torch.Tensor  # [batch] index of each row's prompt
    completion_inputs: torch.Tensor  # [batch, max_completion_len - 1] completion tokens but the last (inputs)
    completion_mask: torch.Tensor  # [batch, max_completion_len - 1]
    targets: torch.Tensor  # [batch, max_completion_len] completion tokens (pad beyond each row's end)
    target_mask: torch.Tensor  # [batch, max_completion_len] bool: slots to score

    @property
    def num_prompts(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def num_input_tokens(self) -> int:
        """Token positions the two passes run, padding included (what the unshared pass runs: batch x seq)."""
        return self.prompt_ids.numel() + self.completion_inputs.numel()


def build_layout(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, target_mask: torch.Tensor, *, prompt_lengths: Sequence[int]
) -> SharedPromptLayout:
    """`SharedPromptLayout` of a right-padded micro-batch (``input_ids``/``attention_mask`` [batch, seq],
    ``target_mask`` [batch, seq - 1] as for `score_tokens`); ``prompt_lengths``: each row's prompt tokens.
    Targets must be completion tokens: a prompt token has no completion pass to be scored in."""
    batch = input_ids.shape[0]
    if batch == 0:
        raise ValueError("cannot score an empty micro-batch")
    if len(prompt_lengths) != batch:
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for a micro-batch of {batch} rows")
    ids = input_ids.tolist()
    row_lengths = attention_mask.sum(dim=1).tolist()
    target_rows = target_mask.tolist()
    completions = []
    for row, (prompt_len, row_len) in enumerate(zip(prompt_lengths, row_lengths, strict=True)):
        if not 1 <= prompt_len <= row_len:
            raise ValueError(f"row {row}: prompt length {prompt_len} outside 1..{row_len} (the row's tokens)")
        outside = [
            t for t, is_target in enumerate(target_rows[row]) if is_target and not prompt_len - 1 <= t < row_len - 1
        ]
        if outside:
            raise ValueError(
                f"row {row}: target index {outside[0]} is not a completion token (those are {prompt_len - 1}.."
                f"{row_len - 2}); shared-prompt scoring scores completion tokens only"
            )
        completions.append(ids[row][prompt_len:row_len])
    groups = group_by_prompt([ids[row][:prompt_len] for row, prompt_len in enumerate(prompt_lengths)])
    row_prompt = [0] * batch
    for index, rows in enumerate(groups):
        for row in rows:
            row_prompt[row] = index
    max_prompt = max(prompt_lengths)
    max_completion = max(1, *(len(c) for c in completions))  # one slot even without any: the prompt's last token
    prompt_ids = torch.zeros((len(groups), max_prompt), dtype=torch.long)
    prompt_mask = torch.zeros((len(groups), max_prompt), dtype=torch.long)
    for index, rows in enumerate(groups):
        prompt = ids[rows[0]][: prompt_lengths[rows[0]]]
        prompt_ids[index, : len(prompt)] = torch.tensor(prompt)
        prompt_mask[index, : len(prompt)] = 1
    targets = torch.zeros((batch, max_completion), dtype=torch.long)
    slot_mask = torch.zeros((batch, max_completion), dtype=torch.bool)
    for row, completion in enumerate(completions):
        targets[row, : len(completion)] = torch.tensor(completion, dtype=torch.long)
        start = prompt_lengths[row] - 1
        slot_mask[row, : len(completion)] = torch.tensor(target_rows[row][start : start + len(completion)])
    completion_mask = (
        torch.arange(max_completion - 1)[None, :] < torch.tensor([len(c) - 1 for c in completions])[:, None]
    )
    device = input_ids.device
    return SharedPromptLayout(
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        prompt_lengths=prompt_mask.sum(dim=1).to(device),
        row_prompt=torch.tensor(row_prompt, dtype=torch.long, device=device),
        completion_inputs=(targets[:, :-1] * completion_mask).to(device),
        completion_mask=completion_mask.long().to(device),
        targets=targets.to(device),
        target_mask=slot_mask.to(device),
    )


def score_shared_prompts(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_mask: torch.Tensor,
    *,
    prompt_lengths: Sequence[int],
    temperature: float,
    with_entropy: bool = False,
    entropy_requires_grad: bool = False,
    logits_chunk_tokens: int = 0,
    sampling_mask: SamplingMask | None = None,
) -> TokenScores:
    """`score_tokens` of a right-padded micro-batch, each distinct prompt computed once (see the module docstring).

    Arguments as for `score_tokens`, plus ``prompt_lengths`` (each row's prompt tokens; rows whose first
    ``prompt_length`` ids are equal share one prompt pass). ``target_mask`` may select completion tokens only.
    The LM head is `score_tokens`' own (`chunked_logits.score_on_grid`)."""
    layout = build_layout(input_ids, attention_mask, target_mask, prompt_lengths=prompt_lengths)
    hidden = shared_prompt_hidden(model, layout)  # [batch, max_completion_len, hidden]
    selected = hidden[layout.target_mask]  # [num_targets, hidden], in the row-major order of target_mask's
    return score_on_grid(
        cast(nn.Module, model.get_output_embeddings()),
        selected,
        layout.targets[layout.target_mask],
        target_mask,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_requires_grad=entropy_requires_grad,
        chunk_tokens=logits_chunk_tokens,
        sampling_mask=sampling_mask,
    )


def shared_prompt_hidden(model: PreTrainedModel, layout: SharedPromptLayout) -> torch.Tensor:
    """Final hidden states that predict each completion slot: [batch, max_completion_len, hidden]. Slot 0 comes
    from the prompt pass (the prompt's last position), slot ``j > 0`` from completion input ``j - 1``."""
    decoder = model.get_decoder()
    recording = Cache(layer_class_to_replicate=_RecordingLayer)
    with _cache_kept_under_checkpointing(model):
        prompt_hidden = decoder(
            input_ids=layout.prompt_ids,
            attention_mask=layout.prompt_mask,
            past_key_values=recording,
            use_cache=False,  # the cache is ours; the flag only asks the model to make one
        ).last_hidden_state  # [num_prompts, max_prompt_len, hidden]
        last = prompt_hidden[torch.arange(layout.num_prompts, device=prompt_hidden.device), layout.prompt_lengths - 1]
        first_slot = last[layout.row_prompt][:, None]  # [batch, 1, hidden]
        if layout.completion_inputs.shape[1] == 0:  # every row has at most one completion token
            return first_slot
        prefix = Cache(layers=list(_prefix_layers(recording, layout, model, prompt_hidden)))
        attention_mask, position_ids = _completion_attention(layout)
        completion_hidden = decoder(
            input_ids=layout.completion_inputs,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=prefix,
            use_cache=False,
        ).last_hidden_state  # [batch, max_completion_len - 1, hidden]
    return torch.cat([first_slot, completion_hidden], dim=1)


def _completion_attention(layout: SharedPromptLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The completion pass's attention mask over its prompt's real tokens and its own ([batch, max_prompt_len +
    max_completion_len - 1]), and position ids that continue its prompt's ([batch, max_completion_len - 1])."""
    attention_mask = torch.cat([layout.prompt_mask[layout.row_prompt], layout.completion_mask], dim=1)
    offsets = torch.arange(layout.completion_inputs.shape[1], device=layout.row_prompt.device)
    return attention_mask, layout.prompt_lengths[layout.row_prompt][:, None] + offsets[None, :]


def _prefix_layers(
    recording: Cache, layout: SharedPromptLayout, model: PreTrainedModel, prompt_hidden: torch.Tensor
) -> Iterator[_PrefixLayer]:
    """Each layer's prompt keys/values for every row: a broadcast view when there is one prompt, else gathered."""
    num_layers = model.config.num_hidden_layers
    if len(recording.layers) != num_layers:
        raise RuntimeError(
            f"the prompt pass recorded keys/values of {len(recording.layers)} of {num_layers} layers: this model "
            "or transformers version drops the cache (gradient checkpointing does, without "
            "_can_checkpoint_with_cache); turn trainer.share_prompt off"
        )
    batch = layout.row_prompt.shape[0]
    for layer in cast(list[_RecordingLayer], recording.layers):
        keys, values = layer.keys, layer.values
        assert keys is not None and values is not None
        if prompt_hidden.requires_grad and not keys.requires_grad:
            raise RuntimeError(
                "the prompt's keys/values left the autograd graph (reentrant gradient checkpointing runs its "
                "forward without grad): use gradient_checkpointing_kwargs={'use_reentrant': False}"
            )
        if layout.num_prompts == 1:
            keys, values = keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1)
        else:
            keys, values = keys[layout.row_prompt], values[layout.row_prompt]
        yield _PrefixLayer(keys=keys, values=values)


class _RecordingLayer(DynamicLayer):
    """Prompt pass: keeps the layer's keys/values and attends to them alone. It replaces rather than appends, so
    the backward's recompute under gradient checkpointing records the same states again instead of doubling them."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class _PrefixLayer(DynamicLayer):
    """Completion pass: the prompt's keys/values ([batch, kv_heads, max_prompt_len, head_dim]) before the new ones.
    Only reads (nothing is stored), so a recompute under gradient checkpointing sees the same states."""

    def __init__(self, *, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


@contextlib.contextmanager
def _cache_kept_under_checkpointing(model: nn.Module) -> Iterator[None]:
    """transformers' checkpointed layers drop any cache, because one that appends would be appended to twice
    (forward, then the backward's recompute). Ours never append, which is what ``_can_checkpoint_with_cache`` is
    for; it is set on the instances for the two passes only (the recompute reuses the arguments the forward got)."""
    layers = [
        module
        for module in model.modules()
        if isinstance(module, GradientCheckpointingLayer) and not module._can_checkpoint_with_cache
    ]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache  # back to the class's False
