"""Helpers of the sandbox tests: small limits, skip marks, and the check that an execution left nothing behind
on the host (processes of the sandbox uid, job cgroups, work dirs)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox import Sandbox
from sharpen.environments.sandbox.backends import SANDBOX_UID

IS_ROOT = os.geteuid() == 0
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make system-deps)")
needs_root = pytest.mark.skipif(not IS_ROOT, reason="cgroups and uid 65534 need root (CI runs as root)")

SHORT_WALL_SECONDS = 2.0
"""The wall clock of the sandboxes whose tests expect a timeout; the others get a generous one, so that a busy
machine (2 cores, shared) never turns a quick execution into a timeout."""
SMALL_LIMITS = {
    "wall_seconds": 10.0,
    "cpu_seconds": 1,
    "memory_mb": 128,
    "file_size_mb": 1,
    "max_open_files": 32,
    "max_processes": 16,
    "max_output_bytes": 4096,
    "prepare_ahead": False,  # so that "nothing left" means nothing; test_sandbox_prepares_ahead covers it
}


def sandbox_config(**overrides: object) -> SandboxConfig:
    return SandboxConfig.model_validate({**SMALL_LIMITS, **overrides})


def sandbox_uid_processes(*, include_zombies: bool = True) -> list[int]:
    """Host pids running as the sandbox uid (none should outlive an execution)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{entry}/status").read_text().splitlines())
        except OSError:
            continue  # it exited while we looked
        is_zombie = status["State"].split()[0] == "Z"
        if int(status["Uid"].split()[0]) == SANDBOX_UID and (include_zombies or not is_zombie):
            pids.append(int(entry))
    return pids


def assert_nothing_left(sandbox: Sandbox, *, allowed_pids: tuple[int, ...] = ()) -> None:
    """No process of the sandbox uid (not even a zombie handed to init), no job cgroup, no work dir: what an
    execution must leave behind."""
    left = set(sandbox_uid_processes()) - set(allowed_pids)
    assert not left, [Path(f"/proc/{pid}/status").read_text().splitlines()[:7] for pid in left]
    for controller_dir in sandbox.cgroup_dirs:
        assert [p.name for p in controller_dir.path.iterdir() if p.is_dir()] == []
    assert list((sandbox.state_dir / "runs").iterdir()) == []
