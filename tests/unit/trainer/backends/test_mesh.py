"""A checked layout becomes a DeviceMesh whose named dimensions hold the groups the layout computes, checked in one
process with torch's fake process group for 8-, 16- and 64-rank layouts."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from sharpen.trainer.backends.mesh import build_device_mesh
from sharpen.trainer.layout import AXES, LayoutError, ParallelLayout

LAYOUTS = [
    (ParallelLayout(tp=2, pp=2, dp_shard=2), 5),
    (ParallelLayout(tp=2, cp=2, dp_shard=2, dp_replicate=2), 13),
    (ParallelLayout(tp=4, pp=4, dp_shard=2, dp_replicate=2), 37),
]


@pytest.mark.parametrize(
    ("layout", "rank"), LAYOUTS, ids=lambda v: v.describe() if isinstance(v, ParallelLayout) else str(v)
)
def test_the_mesh_has_the_layouts_groups(layout: ParallelLayout, rank: int):
    dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=FakeStore())
    try:
        mesh = build_device_mesh(layout)
        assert mesh.mesh_dim_names == AXES
        assert tuple(mesh.shape) == layout.sizes
        for axis in AXES:
            group = mesh.get_group(axis)
            assert dist.get_process_group_ranks(group) == layout.group(axis, rank), axis
        assert tuple(mesh.get_coordinate() or ()) == tuple(layout.coordinates(rank)[axis] for axis in AXES)
    finally:
        dist.destroy_process_group()


def test_a_mesh_needs_the_layouts_world():
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        with pytest.raises(LayoutError, match=r"the layout \(dp_shard 2 x tp 2\) has 4 ranks, the process group 8"):
            build_device_mesh(ParallelLayout(tp=2, dp_shard=2))
    finally:
        dist.destroy_process_group()
