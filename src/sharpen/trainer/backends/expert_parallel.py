"""Expert parallelism: a Mixture-of-Experts model's experts split over the ``ep`` ranks, tokens sent to them.

`apply_expert_parallel` shards every experts module of a transformers MoE (its fused ``gate_up_proj`` ``[experts,
2 x intermediate, hidden]`` and ``down_proj`` ``[experts, hidden, intermediate]``: Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3) over the ep mesh, dimension 0, as DTensors: rank ``c`` of an ep group holds experts ``c x E / ep`` to
``(c + 1) x E / ep - 1``. FSDP2 then shards those local experts over the ranks that hold the same ones (the
backend's ``edp`` mesh) and everything else over all the data ranks, as torchtitan does.

Each rank routes its own tokens (its router is whole). The experts module's forward then dispatches each (token,
chosen expert) pair to the rank that holds the expert with one uneven all-to-all, runs the local experts on what it
received, and sends the results back with a second all-to-all, whose backward is the first's reverse (autograd
through the functional collectives' ``all_to_all_single_autograd``, as torchtitan's: gloo runs it on CPUs, NCCL on
GPUs). The routing
weights are applied on the token's own rank, so the router's gradient never leaves it. Every rank's local experts
take part in the graph even when no token reached them, so FSDP2 reduces a gradient (zeros) for every rank.

`apply_expert_tensor_parallel` splits every expert over the ``tp`` ranks instead (tensor parallelism of an MoE; the
plan `tensor_parallel.apply_tensor_parallel` follows for the other layers): each rank holds, of every expert, a
slice of ``gate_up_proj``'s output rows and of ``down_proj``'s, both dimension 1. The tokens and their routes are
the same on every ``tp`` rank (a replicated router on the same input). Each rank computes its slice of the gate and
up projections for every (token, expert) pair, the slices are all-gathered, each rank applies the activation to the
whole row, computes its slice of the down projection's output, and those are all-gathered too: every output
element is one whole dot product computed on one rank, as on one device (the ``"gather"`` plan of the dense layers,
whichever plan they take; the ``"rowwise"`` plan's packed gate/up split needs a layout a DTensor cannot name). In
the backward an all-gather's gradient is this rank's slice, and the inputs of the two sliced projections, whose
gradients are partial on each rank, are all-reduced (Megatron's copy-to-region). Experts and their routes never
differ across the ``tp`` ranks, so the routers' gradients need no reduction.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor

EXPERT_CLASSES = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts", "DeepseekV3Experts")
"""The experts modules whose weights are fused ``[experts, ...]`` tensors and whose forward takes ``(hidden,
top_k_index, top_k_weights)``."""


class ExpertParallelError(ValueError):
    """A model or an ep size that expert parallelism cannot split (one line for the user)."""


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules of ``model``, in order."""
    return [module for module in model.modules() if type(module).__name__ in EXPERT_CLASSES]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Shard every experts module of ``model`` over ``mesh``: the ep ranks (1-D), or ``ep x tp`` (2-D: each rank's
    experts split over the tp ranks by output rows too, as `apply_expert_tensor_parallel` splits them) and make its
    forward dispatch tokens by all-to-all over the ep ranks; returns the experts modules (FSDP2 shards them over the
    ranks that hold the same experts). Every rank must hold the same whole weights before (each keeps its slice)."""
    modules = expert_modules(model)
    if not modules:
        raise ExpertParallelError(
            f"expert parallelism splits the experts of {', '.join(EXPERT_CLASSES)}; this model has none"
        )
    size = mesh.size(0)
    split_tp = mesh.ndim == 2
    placements: list[Placement] = [Shard(0), Shard(1)] if split_tp else [Shard(0)]
    for module in modules:
        experts: Any = module
        if experts.num_experts % size:
            raise ExpertParallelError(f"the model's {experts.num_experts} experts are not divisible by ep {size}")
        _shard(module, mesh, placements, tp=mesh.size(1) if split_tp else 1)
        module.forward = _DispatchedExperts(module, mesh)  # an instance attribute: module() calls it
    return modules


def _shard(module: nn.Module, mesh: DeviceMesh, placements: list[Placement], *, tp: int) -> None:
    """Both fused weights of an experts module as DTensors on ``mesh``, each rank keeping its slice of the whole
    weights every rank holds; ``tp``: the ranks its output rows are split over (dimension 1)."""
    for name in ("gate_up_proj", "down_proj"):
        whole = cast(nn.Parameter, getattr(module, name))
        if whole.shape[1] % tp:
            raise ExpertParallelError(f"the experts' {name} has {whole.shape[1]} output rows, not divisible by tp {tp}")
        local = distribute_tensor(whole.detach(), mesh, placements, src_data_rank=None)
        setattr(module, name, nn.Parameter(local, requires_grad=whole.requires_grad))


def apply_expert_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Split every expert of ``model`` over the 1-D ``mesh`` (the tp ranks) by output rows, in place (see the module
    docstring); returns the experts modules. Every rank must hold the same whole weights before (each keeps its
    slice)."""
    modules = expert_modules(model)
    for module in modules:
        _shard(module, mesh, [Shard(1)], tp=mesh.size())
        module.forward = _SlicedExperts(module, mesh)  # an instance attribute: module() calls it
    return modules


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight (differentiable)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


class _DispatchedExperts:
    """The forward of an experts module under expert parallelism (see the module docstring)."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh) -> None:
        self.module = module
        self.group = mesh.get_group(0)
        self.size = mesh.size(0)
        self.tp_group = mesh.get_group(1) if mesh.ndim == 2 else None
        """``ep x tp``: the ranks that hold the other slices of the same experts."""

    def __call__(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        module: Any = self.module
        gate_up, down = _local(module.gate_up_proj), _local(module.down_proj)  # [E / ep, ...]
        num_local = gate_up.shape[0]
        order, experts, tokens = _pairs_by_expert(top_k_index)  # so by destination rank
        destination = experts // num_local
        send = torch.bincount(destination, minlength=self.size)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        send_splits, receive_splits = send.tolist(), received.tolist()
        local_ids = torch.empty(sum(receive_splits), dtype=experts.dtype, device=experts.device)
        dist.all_to_all_single(local_ids, experts - destination * num_local, receive_splits, send_splits, self.group)
        inputs = hidden_states if self.tp_group is None else _CopyToGroup.apply(hidden_states, self.tp_group)
        arrived = all_to_all_single_autograd(inputs[tokens], receive_splits, send_splits, self.group)
        outputs = _run_experts(arrived, local_ids, gate_up, down, module.act_fn, group=self.tp_group)
        back = all_to_all_single_autograd(outputs, send_splits, receive_splits, self.group)
        return _combine(hidden_states, back, tokens, top_k_weights.reshape(-1)[order, None])


class _SlicedExperts:
    """The forward of an experts module split over the tp ranks (see the module docstring)."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh) -> None:
        self.module = module
        self.group = mesh.get_group()

    def __call__(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        module: Any = self.module
        gate_up, down = _local(module.gate_up_proj), _local(module.down_proj)  # [E, rows / tp, ...]
        order, experts, tokens = _pairs_by_expert(top_k_index)
        inputs = _CopyToGroup.apply(hidden_states, self.group)[tokens]
        outputs = _run_experts(inputs, experts, gate_up, down, module.act_fn, group=self.group)
        return _combine(hidden_states, outputs, tokens, top_k_weights.reshape(-1)[order, None])


def _pairs_by_expert(top_k_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of ``top_k_index`` ``[tokens, top_k]`` sorted by expert (stable): the sorting order
    over the flattened pairs, each pair's expert and its token."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, flat[order], order // top_k_index.shape[1]


def _combine(
    hidden_states: torch.Tensor, outputs: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Each token's experts' ``outputs`` (one row per (token, expert) pair), weighted and summed into its row."""
    contributions = (outputs * weights).to(hidden_states.dtype)
    return torch.zeros_like(hidden_states).index_add(0, tokens, contributions)


def _run_experts(
    rows: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act_fn: Any,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The experts on ``rows`` (``experts``: which of ``gate_up``/``down``'s experts each row goes to). ``group``:
    the tp ranks, when each holds a slice of every expert's output rows (gathered after each projection); None: whole
    experts."""
    # every weight takes part, with zero weight when no row reached it: each rank reduces a gradient; and the rows
    # do, even when there are none: under expert parallelism their gradient goes back by the reverse all-to-all,
    # which every rank of the group must join (a rank sent rows to the others even if it received none)
    chosen = [(expert, (experts == expert).nonzero().squeeze(1)) for expert in torch.unique(experts).tolist()]
    unused = 0.0 * (rows.sum() + gate_up.sum() + down.sum())
    projected = _scatter(
        rows, [(at, nn.functional.linear(rows[at], gate_up[expert])) for expert, at in chosen], width=gate_up.shape[1]
    )
    gate, up = _gather_columns(projected + unused.to(projected.dtype), group).chunk(2, dim=-1)
    hidden = act_fn(gate) * up  # in the projections' dtype (an autocast's), as the model's own experts
    if group is not None:
        hidden = _CopyToGroup.apply(hidden, group)
    outputs = _scatter(
        hidden, [(at, nn.functional.linear(hidden[at], down[expert])) for expert, at in chosen], width=down.shape[1]
    )
    return _gather_columns(outputs.to(rows.dtype), group)


def _scatter(rows: torch.Tensor, results: list[tuple[torch.Tensor, torch.Tensor]], *, width: int) -> torch.Tensor:
    """One output row of ``width`` per input row of ``rows``: each ``(at, result)`` puts its rows at positions ``at``
    (each position in one of them; no results: zeros, still in ``rows``' graph)."""
    if not results:
        return rows.new_zeros(rows.shape[0], width) + 0.0 * rows.sum()
    first = results[0][1]
    out = first.new_zeros(rows.shape[0], first.shape[1])
    for at, result in results:
        out = out.index_add(0, at, result)
    return out


def _gather_columns(local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return local if group is None else _GatherColumns.apply(local, group)


class _GatherColumns(torch.autograd.Function):
    """All-gather the ranks' column slices (last dimension, in rank order) in the forward; this rank's slice of the
    gradient in the backward (what follows the gather runs the same on every rank)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rank, ctx.width = dist.get_rank(group), local.shape[-1]
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width].contiguous(), None


class _CopyToGroup(torch.autograd.Function):
    """The identity in the forward; an all-reduce (sum) of the gradient in the backward: the input of a projection
    whose output rows are split over the ranks gets a partial gradient on each."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total, None
