"""The GPU kinds a scenario may name, with the two figures the cost model needs: peak dense bf16 FLOP/s and
memory bandwidth, plus memory size.

It owns only this table. It does not know what a workload costs (costs.py) or how fast a real kernel runs: the
scenario's efficiencies (MFU, fraction of memory bandwidth) turn peaks into achieved rates.

Sources (vendor datasheets, dense figures, i.e. without 2:4 sparsity; SXM form factor):
- H100 SXM: NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOP/s with sparsity (989 dense), 3.35 TB/s, 80 GB.
- H800 SXM: the export variant of H100 SXM with the same compute and HBM3 (3.35 TB/s, 80 GB); NVLink cut to
  400 GB/s, which the scenario's network section carries, not this table.
- H200 SXM: NVIDIA H200 datasheet: the H100's compute, 4.8 TB/s, 141 GB.
- A100 SXM 80 GB / 40 GB: NVIDIA A100 datasheet: BF16 312 TFLOP/s dense, 2,039 GB/s / 1,555 GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True, frozen=True)
class GpuKind:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: float


GIB = 2**30
GPU_KINDS: dict[str, GpuKind] = {
    kind.name: kind
    for kind in (
        GpuKind(name="H100", peak_flops=989e12, memory_bandwidth=3.35e12, memory_bytes=80e9),
        GpuKind(name="H800", peak_flops=989e12, memory_bandwidth=3.35e12, memory_bytes=80e9),
        GpuKind(name="H200", peak_flops=989e12, memory_bandwidth=4.8e12, memory_bytes=141e9),
        GpuKind(name="A100-80GB", peak_flops=312e12, memory_bandwidth=2.039e12, memory_bytes=80e9),
        GpuKind(name="A100-40GB", peak_flops=312e12, memory_bandwidth=1.555e12, memory_bytes=40e9),
    )
}
