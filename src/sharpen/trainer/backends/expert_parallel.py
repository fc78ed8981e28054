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
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

EXPERT_CLASSES = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts", "DeepseekV3Experts")
"""The experts modules whose weights are fused ``[experts, ...]`` tensors and whose forward takes ``(hidden,
top_k_index, top_k_weights)``."""


class ExpertParallelError(ValueError):
    """A model or an ep size that expert parallelism cannot split (one line for the user)."""


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules of ``model``, in order."""
    return [module for module in model.modules() if type(module).__name__ in EXPERT_CLASSES]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Shard every experts module of ``model`` over the 1-D ``mesh`` (the ep ranks) and make its forward dispatch
    tokens by all-to-all; returns the experts modules (FSDP2 shards them over the ranks that hold the same
    experts). Every rank must hold the same whole weights before (each keeps its slice)."""
    modules = expert_modules(model)
    if not modules:
        raise ExpertParallelError(
            f"expert parallelism splits the experts of {', '.join(EXPERT_CLASSES)}; this model has none"
        )
    size = mesh.size()
    for module in modules:
        experts: Any = module
        if experts.num_experts % size:
            raise ExpertParallelError(f"the model's {experts.num_experts} experts are not divisible by ep {size}")
        for name in ("gate_up_proj", "down_proj"):
            whole = cast(nn.Parameter, getattr(module, name))
            local = distribute_tensor(whole.detach(), mesh, [Shard(0)], src_data_rank=None)  # each keeps its slice
            setattr(module, name, nn.Parameter(local, requires_grad=whole.requires_grad))
        module.forward = _DispatchedExperts(module, mesh)  # an instance attribute: module() calls it
    return modules


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight (differentiable)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


class _DispatchedExperts:
    """The forward of an experts module under expert parallelism (see the module docstring)."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh) -> None:
        self.module = module
        self.group = mesh.get_group()
        self.size = mesh.size()

    def __call__(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        module: Any = self.module
        gate_up, down = _local(module.gate_up_proj), _local(module.down_proj)  # [E / ep, ...]
        num_local = gate_up.shape[0]
        top_k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs by expert, so by destination rank
        experts = flat[order]
        tokens = order // top_k
        destination = experts // num_local
        send = torch.bincount(destination, minlength=self.size)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        send_splits, receive_splits = send.tolist(), received.tolist()
        local_ids = torch.empty(sum(receive_splits), dtype=experts.dtype, device=experts.device)
        dist.all_to_all_single(local_ids, experts - destination * num_local, receive_splits, send_splits, self.group)
        inputs = hidden_states[tokens]
        arrived = all_to_all_single_autograd(inputs, receive_splits, send_splits, self.group)
        outputs = self._run_local(arrived, local_ids, gate_up, down)
        back = all_to_all_single_autograd(outputs, send_splits, receive_splits, self.group)
        weights = top_k_weights.reshape(-1)[order, None]
        contributions = (back * weights).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, tokens, contributions)

    def _run_local(
        self, arrived: torch.Tensor, local_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
    ) -> torch.Tensor:
        """This rank's experts on the rows sent to them (``local_ids``: which local expert each row goes to)."""
        module: Any = self.module
        # every local weight takes part, with zero weight when no row reached it: each rank reduces a gradient; and
        # the rows that arrived do, even when none did: their gradient goes back by the reverse all-to-all, which
        # every rank of the group must join (a rank sent rows to the others even if it received none)
        outputs = 0.0 * arrived + 0.0 * (gate_up.sum() + down.sum()).to(arrived.dtype)
        for expert in torch.unique(local_ids).tolist():
            rows = (local_ids == expert).nonzero().squeeze(1)
            gate, up = nn.functional.linear(arrived[rows], gate_up[expert]).chunk(2, dim=-1)
            result = nn.functional.linear(module.act_fn(gate) * up, down[expert])
            outputs = outputs.index_add(0, rows, result.to(outputs.dtype))
        return outputs
