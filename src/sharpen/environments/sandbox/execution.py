"""What every execution shares, cold or warm: the fixed plan, checks and packing of the input files (the init
unpacks them inside the sandbox), in-memory files for stdin, and turning the facts of a finished execution into
an ExecutionResult.

The life of one cold execution is in launch.py, of a warm job in warm.py; this module runs nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from sharpen.environments.sandbox.backends import Backend, Limits
from sharpen.environments.sandbox.capture import Captured
from sharpen.environments.sandbox.cgroups import ControllerDir
from sharpen.environments.sandbox.result import ExecutionResult, ProcessOutcome, classify


@dataclass(kw_only=True, slots=True, frozen=True)
class ExecutionPlan:
    """Everything about how to execute that stays fixed for a Sandbox."""

    backend: Backend
    limits: Limits
    cgroup_dirs: list[ControllerDir]
    runs_dir: Path
    """Where a backend without a private home gets its host work dirs."""
    wall_seconds: float
    max_processes: int
    memory_bytes: int
    max_output_bytes: int
    cpu_fraction: float
    python_executable: str
    """The interpreter of the sandbox's init (and of run_python)."""


def check_file_names(files: Mapping[str, str | bytes]) -> None:
    """Raise ValueError for a name that would not land inside the work dir."""
    for name in files:
        path = PurePosixPath(name)
        if not name or "\0" in name or path.is_absolute() or ".." in path.parts or str(path) in ("", "."):
            raise ValueError(f"file name {name!r} must be a relative path inside the work dir (no '..')")


def pack_files(files: Mapping[str, str | bytes], *, code: str | None = None) -> bytes:
    """The payload the init reads from a memfd: the files to write into the home (names checked by
    `check_file_names`; inside the sandbox none can reach further than its own tmpfs anyway) and, for a warm
    worker's Python job, the code. Length-prefixed bytes (the init parses them with no import: every module it
    imports is CPU time of every cold execution): a 4-byte count, then per file a 4-byte name length, the UTF-8
    name, an 8-byte data length and the data; then a code flag byte, an 8-byte length and the UTF-8 code."""
    parts = [len(files).to_bytes(4, "big")]
    for name, data in files.items():
        raw_name, raw_data = name.encode(), _bytes(data)
        parts += [len(raw_name).to_bytes(4, "big"), raw_name, len(raw_data).to_bytes(8, "big"), raw_data]
    raw_code = b"" if code is None else code.encode()
    parts += [b"\x00" if code is None else b"\x01", len(raw_code).to_bytes(8, "big"), raw_code]
    return b"".join(parts)


def _bytes(data: str | bytes) -> bytes:
    return data.encode() if isinstance(data, str) else data


def memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, positioned at its start (stdin, a seccomp program)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    fill_memfd(fd, data)
    return fd


def fill_memfd(fd: int, data: bytes) -> None:
    """Replace the content of ``fd`` and rewind it (the rewind is seen by every holder of the descriptor)."""
    os.ftruncate(fd, 0)
    with open(fd, "wb", closefd=False) as file:
        file.write(data)
    os.lseek(fd, 0, os.SEEK_SET)


def build_result(
    outcome: ProcessOutcome, captured: Captured | None, *, backend: str, wall_limit: float, wall_seconds: float
) -> ExecutionResult:
    status, detail = classify(outcome, wall_seconds=wall_limit)
    streams = (captured.stdout, captured.stderr) if captured is not None else ()
    stdout, stderr = (stream.data.decode(errors="replace") for stream in streams) if streams else ("", "")
    return ExecutionResult(
        status=status,
        exit_code=outcome.exit_code,
        signal=outcome.signal,
        stdout=stdout,
        stderr=stderr,
        wall_seconds=wall_seconds,
        is_output_truncated=any(stream.is_truncated for stream in streams),
        backend=backend,
        detail=detail,
        is_program_started=outcome.is_started,
    )
