"""Context parallelism (Ulysses): each of the ``cp`` ranks runs the decoder on one slice of the sequence, and
attention trades the split for a split over heads.

Owns `ContextParallel`: it cuts a micro-batch's rows into ``cp`` equal slices of the sequence (padded to a multiple
of ``cp``), gives this rank its slice with the positions of the whole sequence, and gathers each rank's per-token
scores back into the ``[batch, seq - 1]`` grid. Inside every attention layer `ulysses_attention` (registered with
transformers as the attention implementation ``"sharpen_ulysses"``) all-to-alls q, k and v from ``[heads, slice]`` to
``[heads / cp, whole sequence]``, attends over the whole sequence (causal; block-diagonal for packed rows, with the
mask of the whole rows), and all-to-alls the output back (DeepSpeed-Ulysses, Jacobs et al.,
2023). Each rank's activations outside attention are 1 / cp of the sequence's.

The scores the loss sees are the same on every ``cp`` rank (gathered), so the gather's backward hands each rank the
gradient of its own slice only, once; FSDP2, which shards the parameters over ``dp_shard x cp``, then adds the ranks'
partial gradients into the whole one. It does not split data between ranks (the ``cp`` ranks of a data shard train
on the same rows) and does not run the LM head (`chunked_logits`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from sharpen.expert_routes import UNROUTED, Routes

ATTENTION = "sharpen_ulysses"
"""The name `ulysses_attention` is registered under in transformers' AttentionInterface."""
_ATTRIBUTE = "sharpen_context"
"""The attention layers' attribute that holds their `ContextParallel`."""


@dataclass(slots=True)
class _Rows:
    """The whole (padded) rows of the micro-batch that the ranks are computing: the attention mask over them."""

    mask: torch.Tensor | None
    """[batch, 1, seq, seq] bool, True where a query may attend to a key (packed rows: causal within each
    sequence); None: causal (right-padded rows)."""
    local: slice
    """This rank's slice of the padded rows."""
    padded: int
    """The rows' length padded to a multiple of ``cp x multiple``."""


@dataclass(slots=True)
class ContextParallel:
    """The ``cp`` ranks of this rank's group: ``rank`` of ``size`` (the ``cp`` mesh axis). ``multiple``: each
    rank's slice is padded to a multiple of it (the ``tp`` ranks' sequence-parallel shards of the slice). With
    ``size`` 1 (sequence parallelism alone) nothing is split or exchanged here: only the whole rows' attention
    mask is kept, because the decoder layers then see ``1 / tp`` of the sequence and transformers would build the
    mask of that shard."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    multiple: int = 1
    rows: _Rows | None = field(default=None)

    def attach(self, model: nn.Module) -> None:
        """Make ``model``'s attention layers run `ulysses_attention` with this group (register it once)."""
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION, ulysses_attention)
        config: Any = getattr(model, "config")  # noqa: B009 (a PreTrainedModel's)
        config._attn_implementation = ATTENTION
        for module in model.modules():
            if hasattr(module, "num_key_value_groups"):  # an attention layer
                setattr(module, _ATTRIBUTE, self)

    def split(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the rows: (input ids, their positions in the whole rows). Remembers the whole rows'
        attention mask for the attention layers, this rank's slice (`local`) and the padded length
        (`padded_length`): right-padded rows (no ``position_ids``; where the padding starts does not matter, see
        below) or packed rows (``position_ids``, each sequence restarting at 0)."""
        batch, length = input_ids.shape
        padded, local = self._slices(length)
        extra = padded - length
        device = input_ids.device
        if position_ids is None:
            # right-padded rows: causal attention alone; a padding key is seen only by padding queries, which
            # score nothing (so no [seq, seq] mask is built: the fused kernels stay usable)
            position_ids = torch.arange(padded, device=device).expand(batch, padded)
            mask = None
        else:  # packed: a sequence starts where the position restarts at 0; the padding is one sequence more
            position_ids = torch.cat([position_ids, torch.arange(extra, device=device).expand(batch, extra)], dim=1)
            sequence = (position_ids == 0).cumsum(dim=1)  # [batch, padded]
            same_sequence = (sequence[:, :, None] == sequence[:, None, :]).unsqueeze(1)
            causal = torch.ones(padded, padded, dtype=torch.bool, device=device).tril()
            mask = causal & same_sequence
        self.rows = _Rows(mask=mask, local=local, padded=padded)
        ids = F.pad(input_ids, (0, extra), value=0)
        return ids[:, local], position_ids[:, local]

    def _slices(self, length: int) -> tuple[int, slice]:
        """Rows of ``length`` tokens: their padded length, and this rank's slice of it."""
        step = self.size * self.multiple
        padded = -(-length // step) * step
        return padded, slice(self.rank * (padded // self.size), (self.rank + 1) * (padded // self.size))

    def local_routes(self, routes: Routes, rows: int, length: int) -> Routes:
        """Expert routes over ``rows`` whole rows of ``length`` tokens (flattened row by row, as a forward's
        routers see them without a split: `sharpen.expert_routes`) -> those of this rank's slice of the padded rows,
        as its routers see them (the padding `UNROUTED`: routed by the router itself)."""
        padded, local = self._slices(length)

        def cut(indices: torch.Tensor) -> torch.Tensor:
            grid = indices.reshape(rows, length, *indices.shape[1:])
            padding = grid.new_full((rows, padded - length, *indices.shape[1:]), UNROUTED)
            return torch.cat([grid, padding], dim=1)[:, local].reshape(-1, *indices.shape[1:])

        return Routes(layers=[cut(indices) for indices in routes.layers])

    def whole_routes(self, routes: Routes, rows: int, length: int) -> Routes:
        """What this rank's routers captured on its slice of ``rows`` rows of ``length`` tokens -> the same over the
        whole rows, gathered from every rank of the group (collective). The routers' probabilities keep their
        gradient: a loss on them that is the same on every rank hands each rank its own slice's, once, as
        `gather` does the scores'."""
        padded, _ = self._slices(length)

        def whole(local: torch.Tensor) -> torch.Tensor:
            grid = self.gather(local.reshape(rows, padded // self.size, *local.shape[1:]))
            return grid[:, :length].reshape(rows * length, *local.shape[1:])

        return Routes(
            layers=[whole(indices) for indices in routes.layers],
            differs=None if routes.differs is None else [whole(d.to(torch.uint8)).bool() for d in routes.differs],
            probs=None if routes.probs is None else [whole(probs) for probs in routes.probs],
        )

    @property
    def local(self) -> slice | None:
        """This rank's slice of the rows `split` last cut (None before any)."""
        return None if self.rows is None else self.rows.local

    @property
    def padded_length(self) -> int:
        """The padded length of the rows `split` last cut."""
        assert self.rows is not None, "ContextParallel.split must run first"
        return self.rows.padded

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[batch, padded / cp]`` per rank -> ``[batch, padded]`` on every rank (sequence order); the backward
        takes this rank's slice of the gradient (the loss on the gathered values is the same on every rank)."""
        if self.size == 1:
            return local
        return _GatherSlices.apply(local, self.group, self.size, self.rank)


class _GatherSlices(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup, size: int, rank: int) -> torch.Tensor:
        ctx.rank, ctx.width = rank, local.shape[1]
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        start = ctx.rank * ctx.width
        return grad[:, start : start + ctx.width].contiguous(), None, None, None


def _all_to_all(send: torch.Tensor, context: ContextParallel) -> torch.Tensor:
    """Equal slices of dim 0 exchanged between the ranks, with autograd (the backward is the reverse exchange)."""
    assert context.group is not None, "only a context-parallel group of several ranks exchanges slices"
    return wait_tensor(all_to_all_single_autograd(send, None, None, context.group))


def _sequence_to_heads(x: torch.Tensor, context: ContextParallel) -> torch.Tensor:
    """``[batch, heads, slice, dim]`` -> ``[batch, heads / cp, cp x slice, dim]`` (all-to-all, with autograd)."""
    batch, heads, length, dim = x.shape
    size = context.size
    send = x.reshape(batch, size, heads // size, length, dim).permute(1, 0, 2, 3, 4).contiguous()
    received = _all_to_all(send, context)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * length, dim)


def _heads_to_sequence(x: torch.Tensor, context: ContextParallel) -> torch.Tensor:
    """The inverse: ``[batch, heads / cp, cp x slice, dim]`` -> ``[batch, heads, slice, dim]``."""
    batch, local_heads, length, dim = x.shape
    size = context.size
    send = x.reshape(batch, local_heads, size, length // size, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = _all_to_all(send, context)
    return received.permute(1, 0, 2, 3, 4).reshape(batch, size * local_heads, length // size, dim)


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q ``[batch, heads, slice, dim]``, k/v with the key/value heads;
    returns ``([batch, slice, heads, dim], None)``. The mask transformers passes (of the slice alone) is ignored:
    the mask of the whole rows comes from `ContextParallel.split`."""
    context = cast(ContextParallel, getattr(module, _ATTRIBUTE))  # set by ContextParallel.attach
    assert context.rows is not None, "ContextParallel.split must run before the decoder"
    groups = int(getattr(module, "num_key_value_groups", 1))
    if groups > 1:  # every query head its key/value head, so that all three split over cp alike
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if context.size == 1:  # sequence parallelism alone: the layer already sees the whole sequence here
        q, k, v = query, key, value
    else:
        q, k, v = (_sequence_to_heads(t, context) for t in (query, key, value))
    mask = context.rows.mask
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout if module.training else 0.0, scale=scaling
    )
    if context.size > 1:
        out = _heads_to_sequence(out, context)
    return out.transpose(1, 2).contiguous(), None
