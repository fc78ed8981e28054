"""Helpers of the sandbox tests: small limits, skip marks, and the check that an execution left nothing behind
on the host (processes of the sandbox under test, job cgroups, work dirs)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox import Sandbox
from sharpen.environments.sandbox.backends import SANDBOX_UID
from sharpen.environments.sandbox.cgroups import PREFIX

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


def cgroup_names(sandbox: Sandbox) -> frozenset[str]:
    """The names of ``sandbox``'s parent groups (one per controller, unique to it: owner pid and a random id); read
    them before closing it, which removes them."""
    return frozenset(controller_dir.path.name for controller_dir in sandbox.cgroup_dirs)


def sandbox_processes(names: frozenset[str], *, include_zombies: bool = True) -> list[int]:
    """Host pids of the sandbox uid that belong to the executions under test: in a cgroup below one of ``names``
    (every execution is born in its job group, daemons included), or, outside every Sandbox's cgroups, descended
    from this test process (a sandbox without cgroups). Processes of another Sandbox, in this process or in another
    test or training run on the same host, are in neither, so they do not count; none of ours should outlive an
    execution."""
    statuses: dict[int, dict[str, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            lines = Path(f"/proc/{entry}/status").read_text().splitlines()
        except OSError:
            continue  # it exited while we looked
        statuses[int(entry)] = dict(line.split(":", 1) for line in lines)
    descendants = _descendants(os.getpid(), {pid: int(status["PPid"]) for pid, status in statuses.items()})
    pids = []
    for pid, status in statuses.items():
        is_zombie = status["State"].split()[0] == "Z"
        if int(status["Uid"].split()[0]) != SANDBOX_UID or (is_zombie and not include_zombies):
            continue
        groups = _sandbox_groups(pid)
        if groups & names or (not groups and pid in descendants):
            pids.append(pid)
    return pids


def _descendants(root: int, parents: dict[int, int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def _sandbox_groups(pid: int) -> set[str]:
    """The Sandbox parent groups (named f"{PREFIX}...") on the paths of /proc/PID/cgroup ("ID:CONTROLLERS:PATH")."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return set()
    return {part for line in lines for part in line.split(":", 2)[2].split("/") if part.startswith(PREFIX)}


def assert_nothing_left(sandbox: Sandbox, *, allowed_pids: tuple[int, ...] = ()) -> None:
    """No process of ``sandbox``'s executions (not even a zombie handed to init), no job cgroup, no work dir: what
    an execution must leave behind."""
    left = set(sandbox_processes(cgroup_names(sandbox))) - set(allowed_pids)
    assert not left, [Path(f"/proc/{pid}/status").read_text().splitlines()[:7] for pid in left]
    for controller_dir in sandbox.cgroup_dirs:
        assert [p.name for p in controller_dir.path.iterdir() if p.is_dir()] == []
    assert list((sandbox.state_dir / "runs").iterdir()) == []
