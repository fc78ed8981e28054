"""`build_device_mesh`: a checked `ParallelLayout` as a torch `DeviceMesh` with one named dimension per axis.

The mesh has the layout's axes in its order (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``), sizes of 1
included, so every backend asks for a dimension by name whatever the layout. ``torch.distributed`` must be
initialised with the layout's world size (real ranks, or a fake process group to check a layout in one process).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from sharpen.trainer.layout import AXES, LayoutError, ParallelLayout


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
