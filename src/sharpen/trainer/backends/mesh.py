"""The ranks' process group and its mesh: `init_distributed` joins the group that the launcher's variables describe
(torchrun's, a Ray actor's, a local rank's), `rank_device` is a rank's device, and `build_device_mesh` makes a
checked `ParallelLayout` a torch `DeviceMesh` with one named dimension per axis, from which `data_meshes` and
`expert_meshes` cut what FSDP2 shards over, what splits the data and what splits the experts; `weight_shard` is a
rank's box of a (possibly distributed) weight for the direct weight sync.

The mesh has the layout's axes in its order (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``), sizes of 1
included, so every backend asks for a dimension by name whatever the layout. ``torch.distributed`` must be
initialised with the layout's world size (real ranks, or a fake process group to check a layout in one process).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from sharpen.trainer.layout import AXES, LayoutError, ParallelLayout
from sharpen.weight_shards import WeightShard


def build_device_mesh(layout: ParallelLayout, *, device_type: str = "cpu") -> DeviceMesh:
    """The `DeviceMesh` of ``layout`` over the initialised process group (``device_type``: "cpu" with gloo,
    "cuda" with NCCL)."""
    if not dist.is_initialized():
        raise LayoutError("build_device_mesh needs torch.distributed initialised (one process per rank)")
    if dist.get_world_size() != layout.world_size:
        raise LayoutError(
            f"the layout ({layout.describe()}) has {layout.world_size} ranks, the process group {dist.get_world_size()}"
        )
    return init_device_mesh(device_type, layout.sizes, mesh_dim_names=AXES)


def data_meshes(mesh: DeviceMesh, layout: ParallelLayout) -> tuple[DeviceMesh, DeviceMesh]:
    """(the mesh FSDP2 shards over, the data-parallel ranks that split a batch). FSDP2 shards over ``dp_shard`` and,
    as torchtitan does, the context-parallel ranks (``dp_shard x cp``, whose gradients are partial sums over the
    sequence); HSDP replicates that over ``dp_replicate`` (a 2-D mesh). The trainer splits data over ``dp_replicate
    x dp_shard`` only: the ``cp`` and ``tp`` ranks of a data shard train on the same rows."""
    shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp") if layout.cp > 1 else mesh["dp_shard"]
    if layout.dp_replicate > 1:
        fsdp = mesh["dp_replicate", "dp_shard_cp"] if layout.cp > 1 else mesh["dp_replicate", "dp_shard"]
        return fsdp, mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return shard, mesh["dp_shard"]


def expert_meshes(mesh: DeviceMesh, fsdp_mesh: DeviceMesh, layout: ParallelLayout) -> tuple[DeviceMesh, DeviceMesh]:
    """(the ep ranks that split each MoE layer's experts, the mesh FSDP2 shards those experts over), from the mesh
    FSDP2 shards the other weights over (`data_meshes`: dp_shard, times cp; HSDP's replicas beside it). As torchtitan
    carves them, the ep groups are neighbouring ranks of its shard dimension, within each pipeline stage; the experts
    are sharded over the rest of that dimension (``edp``) and, like the other weights, replicated over dp_replicate.
    Each rank routes its own tokens, whichever axis split them from the others' (rows over dp_shard, a row's slices
    over cp). With tensor parallelism (without cp), the first is 2-D, ``ep x tp``, cut from the whole ``mesh``: each
    expert is split over the tp ranks too, and the ep groups are those of one tp coordinate."""
    if layout.tp > 1:
        if layout.cp > 1:
            raise LayoutError("expert parallelism with both tensor and context parallelism is not built yet")
        names = ("dp_replicate", "dp_shard", "tp") if layout.dp_replicate > 1 else ("dp_shard", "tp")
        split = mesh[names]._unflatten(
            names.index("dp_shard"), (layout.dp_shard // layout.ep, layout.ep), ("edp", "ep")
        )
        return split["ep", "tp"], split["dp_replicate", "edp"] if layout.dp_replicate > 1 else split["edp"]
    sizes = ((layout.dp_shard * layout.cp) // layout.ep, layout.ep)
    if layout.dp_replicate > 1:
        split = fsdp_mesh._unflatten(1, sizes, ("edp", "ep"))
        return split["ep"], split["dp_replicate", "edp"]
    split = fsdp_mesh._unflatten(0, sizes, ("edp", "ep"))
    return split["ep"], split["edp"]


_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(backend: str | None = None, *, timeout: timedelta = timedelta(minutes=10)) -> torch.device:
    """Join the process group that the standard launcher variables describe (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``, optional ``LOCAL_RANK``, as torchrun sets them); returns this rank's device.

    ``backend``: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank, ``cuda:LOCAL_RANK``); None picks nccl when CUDA
    is available. ``timeout`` bounds every collective, so a rank that died makes the others fail instead of hang.
    Idempotent: a second call returns the device without re-initialising."""
    missing = [name for name in _ENV_VARS if name not in os.environ]
    if missing:
        raise ValueError(f"init_distributed needs the launcher's variables; missing {', '.join(missing)}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (CUDA), got {backend!r}")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    return device


def rank_device(name: str) -> torch.device:
    """The config's device for this rank: "auto"/"cuda" mean ``cuda:LOCAL_RANK`` (when available)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def weight_shard(name: str, order: int, tensor: torch.Tensor) -> WeightShard | None:
    """This rank's box of the weight ``name`` for the direct weight sync, as a host copy (later steps do not change
    it), or None where another rank sends the same box: a DTensor replicated over a mesh dimension (dp_replicate,
    a tensor-parallel norm) is sent by the rank at coordinate 0 of that dimension. A plain tensor is whole."""
    if not isinstance(tensor, DTensor):
        return WeightShard.whole(name, order, tensor.detach().to("cpu", copy=True))
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh
        return None
    for dim, placement in enumerate(tensor.placements):
        if placement.is_partial():
            raise ValueError(f"weight {name} holds partial sums on mesh dimension {dim}: it is not a weight")
        if placement.is_replicate() and coordinate[dim] != 0:
            return None
    (chunk,) = tensor.__create_chunk_list__()  # where the local box sits (what DCP saves)
    local = tensor.to_local().detach().to("cpu", copy=True)
    if tuple(local.shape) != tuple(chunk.sizes):
        raise ValueError(f"weight {name}: the local shard is {list(local.shape)}, the placements {list(chunk.sizes)}")
    return WeightShard(name=name, order=order, shape=tuple(tensor.shape), offsets=tuple(chunk.offsets), tensor=local)
