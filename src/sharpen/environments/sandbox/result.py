"""What one execution in the sandbox returns, and how the raw facts of a finished process become a status.

This module owns the status vocabulary and the one function that decides a status. It runs nothing itself.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

IsolationLevel = Literal["strong", "medium", "weak"]


class SandboxUnavailable(RuntimeError):
    """No backend gives the isolation the configuration asks for (or the one named in it does not work here)."""


class ExecutionStatus(StrEnum):
    OK = "ok"
    """The program exited with code 0."""
    NONZERO_EXIT = "nonzero_exit"
    """The program exited with another code (exit_code says which)."""
    TIMEOUT = "timeout"
    """The wall-clock or the CPU-time limit ended it."""
    OOM = "oom"
    """The memory cgroup ran out and the kernel killed a process of the execution."""
    KILLED = "killed"
    """A signal ended it (signal says which), or the sandbox did because its output passed max_output_bytes."""
    SANDBOX_ERROR = "sandbox_error"
    """The sandbox failed (the program may not have run at all); says nothing about the program."""


@dataclass(kw_only=True, slots=True)
class ExecutionResult:
    """The outcome of one execution. ``stdout``/``stderr`` hold at most max_output_bytes each (UTF-8, undecodable
    bytes replaced)."""

    status: ExecutionStatus
    exit_code: int | None
    """The exit code; None when the program did not exit by itself. Behind a pid namespace (bwrap, unshare) a
    death by signal n reads as 128 + n, as in a shell."""
    stdout: str
    stderr: str
    wall_seconds: float
    is_output_truncated: bool
    backend: str
    signal: int | None = None
    """The signal that ended the program, when one did (decoded from 128 + n behind a pid namespace)."""
    detail: str = ""
    """Why the status is what it is, in words (the limit that was hit, the sandbox's error)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class IsolationReport:
    """What the chosen backend protects against; ``missing`` names each protection this host could not give."""

    backend: str
    level: IsolationLevel
    missing: tuple[str, ...] = field(default=())


@dataclass(kw_only=True, slots=True)
class ProcessOutcome:
    """Raw facts about a finished execution, gathered by a backend or a warm worker, before classification."""

    is_started: bool
    """The sandbox set itself up and handed over to the program (False: a sandbox failure)."""
    exit_code: int | None = None
    signal: int | None = None
    is_timed_out: bool = False
    is_oom: bool = False
    is_output_overflow: bool = False
    error: str = ""


def classify(outcome: ProcessOutcome, *, wall_seconds: float) -> tuple[ExecutionStatus, str]:
    """The status and its reason. The order matters: what the sandbox did (timeout, oom, output kill) explains a
    death by signal better than the signal itself."""
    if outcome.error or not outcome.is_started:
        return ExecutionStatus.SANDBOX_ERROR, outcome.error or "the sandbox did not start the program"
    if outcome.is_timed_out:
        return ExecutionStatus.TIMEOUT, f"wall-clock limit of {wall_seconds:g} s"
    if outcome.is_oom:
        return ExecutionStatus.OOM, "the memory cgroup ran out; the kernel killed a process"
    if outcome.is_output_overflow:
        return ExecutionStatus.KILLED, "output passed max_output_bytes"
    if outcome.signal == signal.SIGXCPU:
        return ExecutionStatus.TIMEOUT, "CPU-time limit (SIGXCPU)"
    if outcome.signal is not None:
        return ExecutionStatus.KILLED, f"ended by signal {signal.Signals(outcome.signal).name}"
    if outcome.exit_code == 0:
        return ExecutionStatus.OK, ""
    return ExecutionStatus.NONZERO_EXIT, f"exit code {outcome.exit_code}"
