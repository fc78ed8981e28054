"""An MoE's expert routes on a pipeline (`pipeline_parallel`): the stages' routers as one, the routes to replay laid
out for the schedule, and the stages' captured routes gathered back per micro-batch.

Each stage replays and captures its own MoE layers (a `RouterReplay` each, made by `PipelineParallel`). Before a
run, `PipelineRouters.padded` lays a micro-batch's routes over the schedule's padded rows, ``[rows, length, MoE
layers, top_k]`` (a keyword argument the schedule splits by micro-batch, like the masks); during it, each stage
records what its layers chose, per micro-batch and MoE layer (`Captured`); after it, `PipelineRouters.gathered`
exchanges those over the pipeline's ranks, so every rank has each micro-batch's routes over all layers and its own
rows. It runs no schedule.

The load-balancing loss (``trainer.moe.aux_loss_coef``) needs each layer's router probabilities, which stay on
their stage, while the trainer's loss runs on the last stage. So, as Megatron does, each stage adds its own layers'
share to the backward itself: `stage_balance` computes it over the micro-batch's real tokens, weighted by the pass's
`ScoreInputs.balance_weight` over the model's MoE layers, and `with_added_loss` hands it a gradient of 1 in the
stage's backward, through the stage's output. The stages' shares add up to the loss the trainer adds on one device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sharpen.expert_routes import UNROUTED, RouterReplay, Routes, RoutingError, layer_balance_losses
from sharpen.trainer.backends.base import ScoreInputs

Captured = dict[int, dict[int, tuple[torch.Tensor, torch.Tensor | None]]]
"""Routes captured in a run: per micro-batch, per MoE layer (its position among the model's), the
``[padded rows x padded length, top_k]`` expert indices and, under replay, ``differs``."""


class PipelineRouters:
    """The routers of this rank's stages as one `expert_routes.Routers`: the model's MoE layer count, top-k and
    experts, and the expert-bias update of this rank's layers (each stage's `RouterReplay` with its layers'
    positions among the model's MoE layers)."""

    def __init__(
        self, stages: list[tuple[RouterReplay, list[int]]], *, num_layers: int, top_k: int, num_experts: int
    ) -> None:
        self.stages = stages
        self._shape = (num_layers, top_k, num_experts)

    @property
    def num_layers(self) -> int:
        return self._shape[0]

    @property
    def top_k(self) -> int:
        return self._shape[1]

    @property
    def num_experts(self) -> int:
        return self._shape[2]

    def update_bias(self, loads: list[list[float]], rate: float) -> None:
        if len(loads) != self.num_layers:
            raise RoutingError(f"expert loads of {len(loads)} MoE layers for a model of {self.num_layers}")
        for router, positions in self.stages:
            router.update_bias([loads[position] for position in positions], rate)

    def padded(self, item: ScoreInputs, *, rows: int, length: int) -> torch.Tensor:
        """``item``'s routes to replay as ``[rows, length, MoE layers, top_k]``, padded as the schedule pads its
        rows (`UNROUTED`: the router chooses; so is a micro-batch without routes)."""
        grid = torch.full((rows, length, self.num_layers, self.top_k), UNROUTED, dtype=torch.long)
        if item.routes is not None:
            batch, width = item.input_ids.shape
            given = torch.stack([indices.cpu() for indices in item.routes.layers], dim=1)  # [batch x width, L, k]
            grid[:batch, :width] = given.reshape(batch, width, *given.shape[1:])
        return grid

    def gathered(
        self,
        captured: Captured,
        inputs: Sequence[ScoreInputs],
        *,
        padded: tuple[int, int],
        group: dist.ProcessGroup,
        device: torch.device,
    ) -> list[Routes]:
        """Each of ``inputs``' routes over its own rows and every MoE layer, from what the pipeline's ranks
        ``captured`` on rows ``padded`` (rows, length) (collective over ``group``)."""
        local = {index: layers for index, layers in captured.items() if index < len(inputs)}
        parts: list[Captured | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, local, group=group)
        out = []
        for index, item in enumerate(inputs):
            layers: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
            for part in parts:
                layers.update((part or {}).get(index, {}))
            if sorted(layers) != list(range(self.num_layers)):
                raise RoutingError(f"micro-batch {index}: routes of MoE layers {sorted(layers)} came back")
            rows, length = item.input_ids.shape
            shape = (*padded, rows, length)
            ordered = [layers[position] for position in range(self.num_layers)]
            differs = [d for _, d in ordered]
            out.append(
                Routes(
                    layers=[_unpadded(indices, shape, device) for indices, _ in ordered],
                    differs=None
                    if any(d is None for d in differs)
                    else [_unpadded(d, shape, device) for d in differs if d is not None],
                )
            )
        return out


def _unpadded(tensor: torch.Tensor, shape: tuple[int, int, int, int], device: torch.device) -> torch.Tensor:
    """A schedule's ``[padded rows x padded length, ...]`` values of one micro-batch back on its own rows: ``shape``
    is (padded rows, padded length, rows, length)."""
    padded_rows, padded_length, rows, length = shape
    grid = tensor.reshape(padded_rows, padded_length, *tensor.shape[1:])[:rows, :length]
    return grid.reshape(rows * length, *tensor.shape[1:]).to(device)


def balance_inputs(item: ScoreInputs, *, rows: int, length: int) -> dict[str, torch.Tensor]:
    """A micro-batch's tensors for its stages' balancing loss, padded as the schedule pads its rows: ``balance``
    (``[rows]``, the pass's weight on each row) and ``real_tokens`` (``[rows, length]``: the rollouts' tokens, as
    `trainer.routes.real_tokens` counts them: a right-padded row's attended tokens, all of a packed row)."""
    batch, width = item.input_ids.shape
    real = item.attention_mask.bool() if item.attention_mask is not None else torch.ones(batch, width, dtype=torch.bool)
    grid = torch.zeros(rows, length, dtype=torch.bool)
    grid[:batch, :width] = real.cpu()
    return {"balance": torch.full((rows,), float(item.balance_weight)), "real_tokens": grid}


def stage_balance(used: Routes, real_tokens: torch.Tensor, weight: float, *, num_layers: int) -> torch.Tensor | None:
    """This stage's share of a pass's balancing loss: its layers' losses (`expert_routes.layer_balance_losses`, on
    the ``real_tokens``) summed, over the model's ``num_layers`` MoE layers, times the pass's ``weight``; None when
    there is nothing to add (no weight, no real token, no probabilities kept)."""
    tokens = real_tokens.reshape(-1)
    if weight == 0.0 or used.probs is None or not bool(tokens.any()):
        return None
    return torch.stack(layer_balance_losses(used, tokens)).sum() * (weight / num_layers)


def with_added_loss(hidden: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``hidden`` unchanged, and in the backward a gradient of 1 for ``loss`` (Megatron's aux-loss auto-scaler):
    the stage's output carries its share of a loss the last stage cannot compute."""
    if isinstance(hidden, DTensor):  # a sequence-parallel norm's output: the local shard carries it
        local = _AddedLoss.apply(hidden.to_local(), loss)
        return DTensor.from_local(
            local, hidden.device_mesh, hidden.placements, shape=hidden.shape, stride=hidden.stride()
        )
    return _AddedLoss.apply(hidden, loss)


class _AddedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype, ctx.loss_device = loss.shape, loss.dtype, loss.device
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=ctx.loss_device)
