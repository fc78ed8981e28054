"""The trainer's precision, chosen from the hardware: ``trainer.precision = "auto"`` resolved to float32 or bf16;
``"fp16"`` only when asked for, with dynamic loss scaling (`LossScaler`).

bf16 here means bfloat16 autocast for the forward and backward passes over float32 master weights and a float32
optimizer. It pays only where the device has bfloat16 arithmetic: on a CPU with AVX512-BF16 or AMX a bfloat16
matmul ran ~4.7x faster than float32 (AMD EPYC: ~950 against ~200 GFLOP/s), on one without those instructions
bfloat16 is emulated and slower than float32. So "auto" asks two things: does the device say it has bf16 (the
CPU's flags in /proc/cpuinfo; ``torch.cuda.is_bf16_supported`` without emulation on CUDA), and does a short matmul
probe on it confirm that bf16 is clearly faster (`MIN_BF16_SPEEDUP`)? Both yes: bf16; otherwise float32.

fp16 means float16 autocast over the same float32 master weights, with the loss multiplied by a dynamic scale before
the backward (float16's smallest normal number is 6e-5: small gradients of the activations would flush to zero
otherwise) and the gradients divided by it before the global norm; a non-finite norm skips the step as any
non-finite gradient does, and halves the scale. It is never chosen by "auto" (bf16 needs no scale and has
float32's range); it exists for hardware with float16 arithmetic and no bfloat16 (V100, T4, some CPUs) and for
users who ask for it. On a CPU torch runs float16 everywhere (natively with AVX512-FP16 or AMX-FP16, otherwise by
converting to float32 around each kernel: correct, slow); a device without a float16 rule is refused in one line.

Owns the choice (`choose_precision`, pure, with the cpuinfo reader and the probe passed in), the probe
(`measure_matmul_gflops`), the per-process cache of the choice (`resolve_precision`: the trainer and the
engine built in one process agree, and the probe runs once) and the dynamic loss scale (`LossScaler`); the
float32 LM head (`keep_lm_head_float32`) is `sharpen.lm_head`'s, shared with the hf engine. It does not apply the
choice: the backends autocast (`PrecisionChoice.autocast_dtype`), orchestration picks the engine's dtype from it
(`ModelConfig.engine_dtype`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from sharpen.lm_head import Float32Head, keep_lm_head_float32

__all__ = ["Float32Head", "keep_lm_head_float32"]  # re-exported: the backends take them from here

logger = logging.getLogger(__name__)

Precision = Literal["float32", "bf16", "fp16"]
RequestedPrecision = Literal["auto", "float32", "bf16", "fp16"]

AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"float32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The autocast dtype of each precision (None: no autocast)."""

MIN_BF16_SPEEDUP = 1.3
"""bf16 is chosen only when its measured matmul speed is at least this multiple of float32's. Autocast adds casts
and keeps some ops (softmax, norms, the loss) in float32, so a step gains less than a bare matmul; below ~1.3x the
gain is within the probe's noise on a shared machine (repeats vary 1.5x there, but the best-of-N times the probe
keeps vary far less) and not worth bf16's rounding."""

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 /proc/cpuinfo flags of native bfloat16 arithmetic: AVX512-BF16 (dot products) and AMX (tile matmuls)."""

CPU_FP16_FLAGS = ("avx512_fp16", "amx_fp16")
"""x86 /proc/cpuinfo flags of native float16 arithmetic (Sapphire Rapids and later). Without them torch still runs
float16 on the CPU (converting with F16C), so they are evidence of speed, not a condition."""

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
    def is_fp16(self) -> bool:
        return self.precision == "fp16"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype the backends autocast to (None: float32, no autocast)."""
        return AUTOCAST_DTYPES[self.precision]

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


def cpu_bf16_flags(cpuinfo: str, *, wanted: tuple[str, ...] = CPU_BF16_FLAGS) -> list[str]:
    """The ``wanted`` flags (`CPU_BF16_FLAGS`, `CPU_FP16_FLAGS`) present in a /proc/cpuinfo text (the flags of its
    first processor)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            present = set(value.split())
            return [flag for flag in wanted if flag in present]
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


def device_fp16_support(device: torch.device, *, cpuinfo: str) -> tuple[bool, str]:
    """Whether ``device`` runs float16 autocast at all (a CPU always: natively or converting; CUDA always), and the
    evidence in words. A device without a rule here is refused rather than guessed."""
    if device.type == "cpu":
        flags = cpu_bf16_flags(cpuinfo, wanted=CPU_FP16_FLAGS)
        if flags:
            return True, f"CPU flags {', '.join(flags)}"
        return True, "no AVX512-FP16 or AMX-FP16 flag: float16 is converted to float32 around each kernel (slow)"
    if device.type == "cuda":
        return True, "CUDA device"
    return False, f"no float16 rule for device type {device.type!r}"


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
    if requested == "fp16":
        has_fp16, fp16_evidence = device_fp16_support(device, cpuinfo=cpuinfo)
        if not has_fp16:
            raise ValueError(f'trainer.precision = "fp16" cannot run here: {fp16_evidence}; use "bf16" or "float32"')
        return PrecisionChoice(
            precision="fp16",
            requested="fp16",
            device=device.type,
            is_bf16_capable=is_capable,
            reason=f"set by trainer.precision; {fp16_evidence}",
        )
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


INITIAL_LOSS_SCALE = 2.0**16
"""torch.amp.GradScaler's defaults, which Megatron and DeepSpeed share: start at 2^16, halve on an overflow, double
after `LOSS_SCALE_GROWTH_INTERVAL` finite steps in a row."""
LOSS_SCALE_BACKOFF = 0.5
LOSS_SCALE_GROWTH = 2.0
LOSS_SCALE_GROWTH_INTERVAL = 2000
MIN_LOSS_SCALE = 1.0
"""The scale never drops below 1: a run that overflows at scale 1 overflows in the forward pass, which no scale
fixes (the skips show it)."""
LOSS_SCALER_FILE = "loss_scaler.json"


class LossScaler:
    """Dynamic loss scaling for float16 autocast, on any backend: `scale` the loss before each backward,
    `unscale_` this rank's gradients (plain tensors or FSDP2 shards) before the global norm, then `update` with
    whether that norm was finite, which every rank computes the same, so every rank keeps the same scale. A step
    whose norm is not finite is skipped by the backend as any non-finite step is; here it halves the scale. The
    state (scale, finite steps since the last change) goes into the checkpoint, so a resumed run scales as the
    uninterrupted one would have."""

    def __init__(self, *, scale: float = INITIAL_LOSS_SCALE, growth_interval: int = LOSS_SCALE_GROWTH_INTERVAL):
        self.scale = scale
        self.growth_interval = growth_interval
        self.finite_steps = 0
        """Finite steps in a row since the scale last changed."""
        self.num_overflows = 0
        """Non-finite steps the scale answered by halving (it was above `MIN_LOSS_SCALE`) since this scaler was made:
        the expected cost of dynamic scaling, which the trainer reports apart from other non-finite updates (not
        checkpointed: a count for the metrics). A non-finite step at the floor is not one: no scale explains it."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Divide the gradients by the scale in place (an inf or NaN stays one, and the global norm sees it)."""
        for grad in grads:
            grad.mul_(1.0 / self.scale)

    def update(self, *, is_finite: bool) -> None:
        if not is_finite:
            self.num_overflows += self.scale > MIN_LOSS_SCALE
            self.scale = max(self.scale * LOSS_SCALE_BACKOFF, MIN_LOSS_SCALE)
            self.finite_steps = 0
            return
        self.finite_steps += 1
        if self.finite_steps >= self.growth_interval:
            self.scale *= LOSS_SCALE_GROWTH
            self.finite_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "finite_steps": self.finite_steps, "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scale = float(state["scale"])
        if not (math.isfinite(scale) and scale >= MIN_LOSS_SCALE):
            raise ValueError(f"loss scaler state has scale {scale}: it must be finite and at least {MIN_LOSS_SCALE}")
        self.scale = scale
        self.finite_steps = int(state["finite_steps"])
        self.growth_interval = int(state["growth_interval"])

    def save(self, folder: Path) -> None:
        (folder / LOSS_SCALER_FILE).write_text(json.dumps(self.state_dict()) + "\n")

    def load(self, folder: Path) -> None:
        path = folder / LOSS_SCALER_FILE
        if not path.is_file():
            raise ValueError(f"checkpoint {folder} has no {LOSS_SCALER_FILE}: it was not written by an fp16 run")
        self.load_state_dict(json.loads(path.read_text()))


def loss_scaler_for(choice: PrecisionChoice) -> LossScaler | None:
    """A `LossScaler` under fp16; None otherwise (bf16 has float32's range and needs none)."""
    return LossScaler() if choice.is_fp16 else None
