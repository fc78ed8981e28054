"""The trainer's precision, chosen from the hardware: ``trainer.precision = "auto"`` resolved to float32 or bf16.

bf16 here means bfloat16 autocast for the forward and backward passes over float32 master weights and a float32
optimizer. It pays only where the device has bfloat16 arithmetic: on a CPU with AVX512-BF16 or AMX a bfloat16
matmul ran ~4.7x faster than float32 (AMD EPYC: ~950 against ~200 GFLOP/s), on one without those instructions
bfloat16 is emulated and slower than float32. So "auto" asks two things: does the device say it has bf16 (the
CPU's flags in /proc/cpuinfo; ``torch.cuda.is_bf16_supported`` without emulation on CUDA), and does a short matmul
probe on it confirm that bf16 is clearly faster (`MIN_BF16_SPEEDUP`)? Both yes: bf16; otherwise float32.

Owns the choice (`choose_precision`, pure, with the cpuinfo reader and the probe passed in), the probe
(`measure_matmul_gflops`) and the per-process cache of the choice (`resolve_precision`: the trainer and the
engine built in one process agree, and the probe runs once). It does not apply the choice: the backends autocast,
orchestration picks the engine's dtype from it (`ModelConfig.engine_dtype`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)

Precision = Literal["float32", "bf16"]
RequestedPrecision = Literal["auto", "float32", "bf16"]

MIN_BF16_SPEEDUP = 1.3
"""bf16 is chosen only when its measured matmul speed is at least this multiple of float32's. Autocast adds casts
and keeps some ops (softmax, norms, the loss) in float32, so a step gains less than a bare matmul; below ~1.3x the
gain is within the probe's noise on a shared machine (repeats vary 1.5x there, but the best-of-N times the probe
keeps vary far less) and not worth bf16's rounding."""

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 /proc/cpuinfo flags of native bfloat16 arithmetic: AVX512-BF16 (dot products) and AMX (tile matmuls)."""

PROBE_SIZE = {"cpu": 1024, "cuda": 4096}
"""Side of the square probe matmuls per device type: large enough that the matmul, not the call, is timed (a
1024-wide float32 matmul takes ~10 ms on a 2-core CPU; a GPU needs 4096 to leave its launch latency behind)."""

PROBE_BUDGET_S = 0.1
"""Time per dtype after which the probe stops repeating (it always runs `PROBE_MIN_REPEATS`)."""

PROBE_MIN_REPEATS = 3
PROBE_MAX_REPEATS = 20

Measure = Callable[[torch.dtype, torch.device], float]
"""``measure(dtype, device) -> GFLOP/s`` of a matmul in that dtype on that device."""


@dataclass(kw_only=True, frozen=True, slots=True)
class PrecisionChoice:
    """What ``trainer.precision`` resolved to on this device, and why."""

    precision: Precision
    requested: RequestedPrecision
    device: str
    """The device type probed (``cpu``, ``cuda``, ...)."""
    is_bf16_capable: bool
    """Whether the device reports native bfloat16 arithmetic (CPU flags; CUDA's own check)."""
    float32_gflops: float | None = None
    """Measured matmul speed in float32 (None: not probed, the choice needed no measurement)."""
    bf16_gflops: float | None = None
    reason: str

    @property
    def is_bf16(self) -> bool:
        return self.precision == "bf16"

    @property
    def bf16_speedup(self) -> float | None:
        """bf16 GFLOP/s over float32 GFLOP/s (None: not probed)."""
        if self.float32_gflops is None or self.bf16_gflops is None:
            return None
        return self.bf16_gflops / self.float32_gflops

    def metrics(self) -> dict[str, float]:
        """``precision/*`` numbers for a run's metrics: the choice and the probe's speeds (0 where not probed)."""
        return {
            "precision/is_bf16": float(self.is_bf16),
            "precision/float32_gflops": self.float32_gflops or 0.0,
            "precision/bf16_gflops": self.bf16_gflops or 0.0,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line for the log: the choice, what was measured, and why."""
        speeds = ""
        if self.float32_gflops is not None and self.bf16_gflops is not None:
            speeds = f"; matmul float32 {self.float32_gflops:.0f} GFLOP/s, bf16 {self.bf16_gflops:.0f} GFLOP/s"
        return f"trainer precision {self.precision} on {self.device} ({self.requested}: {self.reason}{speeds})"


def read_cpuinfo() -> str:
    """The text of /proc/cpuinfo ('' where there is none: macOS, Windows)."""
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.is_file() else ""


def cpu_bf16_flags(cpuinfo: str) -> list[str]:
    """The `CPU_BF16_FLAGS` present in a /proc/cpuinfo text (the flags of its first processor)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            present = set(value.split())
            return [flag for flag in CPU_BF16_FLAGS if flag in present]
    return []


@contextlib.contextmanager
def _intra_op_threads(num_threads: int | None) -> Iterator[None]:
    """Run with ``num_threads`` torch threads (None: as they are), restoring the previous count afterwards."""
    if num_threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_gflops(dtype: torch.dtype, device: torch.device, *, size: int | None = None) -> float:
    """GFLOP/s of a ``size`` x ``size`` matmul in ``dtype`` on ``device``: the best of a few timed repeats after
    one warm-up (the best, not the mean, so that a moment of another process's load does not decide)."""
    size = size or PROBE_SIZE.get(device.type, 1024)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up: kernel selection, packing buffers
    _synchronize(device)
    best = float("inf")
    started = time.perf_counter()
    for repeat in range(PROBE_MAX_REPEATS):
        if repeat >= PROBE_MIN_REPEATS and time.perf_counter() - started > PROBE_BUDGET_S:
            break
        begin = time.perf_counter()
        torch.matmul(a, b)
        _synchronize(device)
        best = min(best, time.perf_counter() - begin)
    return 2 * size**3 / max(best, 1e-9) / 1e9


def device_bf16_support(device: torch.device, *, cpuinfo: str) -> tuple[bool, str]:
    """Whether ``device`` reports native bfloat16 arithmetic, and the evidence in words."""
    if device.type == "cpu":
        flags = cpu_bf16_flags(cpuinfo)
        if flags:
            return True, f"CPU flags {', '.join(flags)}"
        return False, "no AVX512-BF16 or AMX flag in /proc/cpuinfo"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, "CUDA device with native bf16"
        return False, "CUDA device without native bf16"
    return False, f"no bf16 rule for device type {device.type!r}"


def choose_precision(
    requested: RequestedPrecision,
    device: torch.device,
    *,
    cpuinfo: str,
    measure: Measure = measure_matmul_gflops,
) -> PrecisionChoice:
    """Resolve ``requested`` on ``device``. An explicit value is kept as it is (not probed); "auto" is bf16 only when
    the device reports bf16 arithmetic and ``measure`` finds bf16 matmuls at least `MIN_BF16_SPEEDUP` times faster
    than float32."""
    is_capable, evidence = device_bf16_support(device, cpuinfo=cpuinfo)
    if requested != "auto":
        return PrecisionChoice(
            precision=requested,
            requested=requested,
            device=device.type,
            is_bf16_capable=is_capable,
            reason="set by trainer.precision",
        )
    if not is_capable:
        return PrecisionChoice(
            precision="float32", requested="auto", device=device.type, is_bf16_capable=False, reason=evidence
        )
    float32_gflops = measure(torch.float32, device)
    bf16_gflops = measure(torch.bfloat16, device)
    speedup = bf16_gflops / float32_gflops
    is_fast = speedup >= MIN_BF16_SPEEDUP
    verdict = "at least" if is_fast else "below"
    return PrecisionChoice(
        precision="bf16" if is_fast else "float32",
        requested="auto",
        device=device.type,
        is_bf16_capable=True,
        float32_gflops=float32_gflops,
        bf16_gflops=bf16_gflops,
        reason=f"{evidence}; bf16 {speedup:.2f}x float32, {verdict} {MIN_BF16_SPEEDUP}x",
    )


_CHOICES: dict[tuple[str, str, int | None], PrecisionChoice] = {}
"""This process's choices by (requested, device, threads): the probe runs once per process and device."""


def resolve_precision(
    requested: RequestedPrecision, device: torch.device, *, num_threads: int | None = None
) -> PrecisionChoice:
    """`choose_precision` on this machine (its /proc/cpuinfo, the real probe run with ``num_threads`` torch
    threads, the trainer's), once per process: the trainer, the reference policy, the critic and an engine built
    in the same process all get the same answer. The first resolution of "auto" is logged at INFO."""
    key = (requested, str(device), num_threads)
    choice = _CHOICES.get(key)
    if choice is None:
        cpuinfo = read_cpuinfo() if device.type == "cpu" else ""
        with _intra_op_threads(num_threads):
            choice = choose_precision(requested, device, cpuinfo=cpuinfo)
        _CHOICES[key] = choice
        if requested == "auto":
            logger.info(choice.describe())
    return choice
