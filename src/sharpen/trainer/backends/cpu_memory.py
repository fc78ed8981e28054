"""Freed memory stays in the trainer process's heap on a CPU device (``trainer.reuse_cpu_memory``).

A train step allocates the same large tensors every time: activations, the logits of each chunk ([tokens, vocab]),
the embedding's dense gradient ([vocab, hidden]). glibc's malloc serves every block above its mmap threshold with a
fresh mmap and returns it to the kernel on free, so each step the kernel zero-fills those pages again on first touch:
measured here (SmolLM2-135M, the demo's step under bf16 autocast, 2 threads) that was ~2.4 s of system time per step
and 3.4-4.5 s steps against 2.4 s with the memory kept (`benchmarks/limit.py`), at the same peak RSS (4.8 vs 5.0 GB).
`keep_freed_memory` tells glibc (``mallopt``) to serve large blocks from the heap and never to trim it, so a freed
block is reused by the next step's allocation of its size. The process's RSS then stays at its high-water mark
until exit instead of shrinking between steps. Other C libraries are left as they are (the call says so).

Process-wide by nature: it changes how this process allocates from the call on, for every library in it.
"""

from __future__ import annotations

import ctypes
import platform

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h: free memory at the heap's top beyond this goes back to the kernel
_M_MMAP_MAX = -4  # the number of blocks served by mmap at once (0: none, every block comes from the heap)
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Make freed memory stay in this process for reuse; True where the C library is glibc and took the settings."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # this process's own symbols: the glibc it runs on
    return libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
