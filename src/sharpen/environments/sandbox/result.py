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
    """A signal ended it (signal says which), or the sandbox did because its output passed max_output_bytes, or
    it left what the sandbox could not clean up normally (detail says what)."""
    SANDBOX_ERROR = "sandbox_error"
    """The sandbox failed before the program started (or the host refused it something): says nothing about the
    program, which never ran. Nothing a program does can lead to this status (see `classify`)."""


@dataclass(kw_only=True, slots=True)
class ExecutionResult:
    """The outcome of one execution. ``stdout``/``stderr`` hold at most max_output_bytes each (UTF-8, undecodable
    bytes replaced)."""

    status: ExecutionStatus
    exit_code: int | None
    """The exit code the program passed to exit; None when it did not exit by itself (a signal, or the sandbox
    ended it). Taken from the real wait status, so exit(137) is code 137, never a signal."""
    stdout: str
    stderr: str
    wall_seconds: float
    is_output_truncated: bool
    backend: str
    signal: int | None = None
    """The signal that ended the program, when one did (any number, real-time signals included)."""
    detail: str = ""
    """Why the status is what it is, in words (the limit that was hit, the sandbox's error)."""
    is_program_started: bool = False
    """The sandbox handed over to the program (its ready marker was seen). False only with ``sandbox_error``:
    whatever happens once the program has started is the program's outcome, never the sandbox's."""


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
    """What went wrong outside the program's own exit: the sandbox's fault before it started, the program's
    after (see `classify`)."""


def signal_name(number: int) -> str:
    """SIGSEGV, SIGRTMIN+3, or "signal 99" for a number this platform does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        if signal.SIGRTMIN <= number <= signal.SIGRTMAX:
            return f"SIGRTMIN+{number - signal.SIGRTMIN}"
        return f"signal {number}"


def classify(outcome: ProcessOutcome, *, wall_seconds: float) -> tuple[ExecutionStatus, str]:
    """The status and its reason. The order matters: what the sandbox did (timeout, oom, output kill) explains a
    death by signal better than the signal itself.

    ``sandbox_error`` only before the program started: once it has, every fault (descriptors it kept in flight
    holding the output open, a sandbox helper it got killed, processes that would not die) is its own failure,
    ``killed``, so that no program can turn its outcome into an abstention."""
    if not outcome.is_started:
        return ExecutionStatus.SANDBOX_ERROR, outcome.error or "the sandbox did not start the program"
    if outcome.is_timed_out:
        return ExecutionStatus.TIMEOUT, f"wall-clock limit of {wall_seconds:g} s"
    if outcome.is_oom:
        return ExecutionStatus.OOM, "the memory cgroup ran out; the kernel killed a process"
    if outcome.is_output_overflow:
        return ExecutionStatus.KILLED, "output passed max_output_bytes"
    if outcome.error:
        return ExecutionStatus.KILLED, outcome.error
    if outcome.signal == signal.SIGXCPU:
        return ExecutionStatus.TIMEOUT, "CPU-time limit (SIGXCPU)"
    if outcome.signal is not None:
        return ExecutionStatus.KILLED, f"ended by signal {signal_name(outcome.signal)}"
    if outcome.exit_code == 0:
        return ExecutionStatus.OK, ""
    return ExecutionStatus.NONZERO_EXIT, f"exit code {outcome.exit_code}"
