"""Freed memory stays in the trainer's process on a CPU device, up to a bound (``trainer.reuse_cpu_memory_mb``).

A train step allocates the same large tensors every time: activations, the logits of each chunk ([tokens, vocab]),
the embedding's dense gradient ([vocab, hidden]). glibc's malloc serves every block above its mmap threshold (at
most 32 MiB) with a fresh mmap and returns it to the kernel on free, so each step the kernel zero-fills those pages
again on first touch: measured here (SmolLM2-135M, the demo's step under bf16 autocast, 2 threads) ~40% of the step.
`FreedMemory.keep` tells glibc (``mallopt``) to serve large blocks from its heap and never to trim it on its own, so a
freed block is reused by the next step's allocation of its size.

Blocks of changing sizes fragment a heap that is never trimmed: free holes that no later block fits. Measured with
batches of varying lengths, the process's RSS then grew ~60 MiB per step with no sign of stopping. So after each
optimizer step `FreedMemory.bound` compares the process's RSS with the largest it was after the first
`WARM_UP_STEPS` steps (the steps' working set, optimizer state included) and, more than the budget above it, gives
the heap's free pages back (``malloc_trim``): the RSS stays within that working set plus the budget (and one step's
growth), and the step after a trim faults in again only what it needs.

Process-wide by nature: from `keep` on, every library in the process allocates this way. Other C libraries than
glibc are left as they are (`keep` returns None).
"""

from __future__ import annotations

import ctypes
import os
import platform

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h: free memory at the heap's top beyond this goes back to the kernel
_M_MMAP_MAX = -4  # the number of blocks served by mmap at once (0: none, every block comes from the heap)
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int
WARM_UP_STEPS = 3  # steps whose RSS sets the working set (the first allocates the optimizer's state)


class FreedMemory:
    """glibc's heap keeping freed memory, the process's RSS bounded at its working set plus ``budget_bytes``."""

    def __init__(self, libc: ctypes.CDLL, budget_bytes: int) -> None:
        self._libc = libc
        self.budget_bytes = budget_bytes
        self.working_set: int = 0  # the largest RSS after the warm-up steps
        self.num_steps = 0
        self.num_trims = 0

    @classmethod
    def keep(cls, budget_mb: int) -> FreedMemory | None:
        """Make freed memory stay in this process for reuse; None where the C library is not glibc (nothing
        changed) or ``budget_mb`` is 0 (off)."""
        if budget_mb <= 0 or platform.libc_ver()[0] != "glibc":
            return None
        libc = ctypes.CDLL(None)  # this process's own symbols: the glibc it runs on
        if libc.mallopt(_M_MMAP_MAX, 0) != 1 or libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) != 1:
            return None
        return cls(libc, budget_mb * 2**20)

    def bound(self) -> bool:
        """After a step: give the heap's free pages back to the kernel if the RSS is more than the budget above the
        working set; True if it did. The first `WARM_UP_STEPS` calls measure the working set."""
        rss = resident_bytes()
        self.num_steps += 1
        if self.num_steps <= WARM_UP_STEPS:
            self.working_set = max(self.working_set, rss)
            return False
        if rss <= self.working_set + self.budget_bytes:
            return False
        self._libc.malloc_trim(0)
        self.num_trims += 1
        return True


def resident_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
