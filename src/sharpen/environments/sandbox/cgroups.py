"""Per-execution cgroups: a process-count limit, a memory limit that can tell "oom", a CPU-bandwidth limit, and
killing a whole job.

Owns finding the pids, memory and cpu controllers (cgroup v1 or v2, per controller, at run time), one parent group per
Sandbox, and one child group per execution (or per warm worker), removed afterwards. It does not start processes:
a backend's launcher writes its own pid into ``procs_files`` before it executes anything untrusted, so that every
descendant, including double-forked daemons, is born inside the group.

v1 groups nest under our own group of each controller (the host's limits on us still hold); v2 groups go under
the root of the visible hierarchy, because v2 forbids enabling controllers below a group that holds processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CONTROLLERS = ("pids", "memory", "cpu")
_CPU_PERIOD_US = 100_000
PREFIX = "sharpen-sandbox-"
"""Names of what a Sandbox leaves on the host while it lives: f"{PREFIX}{owner pid}-{unique}"."""


def owned_name(unique: str) -> str:
    return f"{PREFIX}{os.getpid()}-{unique}"


def is_orphaned(name: str) -> bool:
    """A name made by ``owned_name`` in a process that no longer exists (it was killed before it could clean up)."""
    owner = name.removeprefix(PREFIX).split("-", 1)[0]
    if not name.startswith(PREFIX) or not owner.isdigit():
        return False
    try:
        os.kill(int(owner), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, someone else's
    return False


@dataclass(kw_only=True, slots=True, frozen=True)
class ControllerDir:
    controller: str
    version: int
    path: Path
    """The group under which this Sandbox's job groups are made."""


def find_controller_dirs(mountinfo: str, own_cgroups: str) -> dict[str, tuple[int, Path]]:
    """Where each controller's hierarchy holds our process: {controller: (version, directory)}.

    ``mountinfo`` is /proc/self/mountinfo, ``own_cgroups`` is /proc/self/cgroup. A controller bound to a v1
    hierarchy is found there; otherwise it counts as v2 if the v2 root lists it in cgroup.controllers (checked
    by the caller, since only the caller can read that file).
    """
    v1_mounts: dict[str, tuple[str, str]] = {}  # controller -> (mount point, mount root)
    v2_mount: tuple[str, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        separator = fields.index("-")
        fstype, options = fields[separator + 1], fields[separator + 3].split(",")
        mount_root, mount_point = fields[3], fields[4]
        if fstype == "cgroup":
            for controller in CONTROLLERS:
                if controller in options:
                    v1_mounts[controller] = (mount_point, mount_root)
        elif fstype == "cgroup2":
            v2_mount = (mount_point, mount_root)
    own_v1: dict[str, str] = {}
    for line in own_cgroups.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            own_v1[controller] = path
    found: dict[str, tuple[int, Path]] = {}
    for controller in CONTROLLERS:
        if controller in v1_mounts and controller in own_v1:
            mount_point, mount_root = v1_mounts[controller]
            found[controller] = (1, _join(mount_point, mount_root, own_v1[controller]))
        elif v2_mount is not None:
            # The root of the visible v2 hierarchy, not our own group: see the module docstring.
            found[controller] = (2, Path(v2_mount[0]))
    return found


def _join(mount_point: str, mount_root: str, path: str) -> Path:
    if mount_root != "/" and path.startswith(mount_root):
        path = path[len(mount_root) :]
    return Path(mount_point) / path.lstrip("/")


def open_controller_dirs(name: str) -> list[ControllerDir]:
    """Make this Sandbox's parent group (``name``, from owned_name) in every controller we may write; an empty list
    when none. Groups orphaned by killed processes are removed on the way."""
    found = find_controller_dirs(Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text())
    dirs: list[ControllerDir] = []
    for controller, (version, parent) in found.items():
        if version == 2:
            controllers_file = parent / "cgroup.controllers"
            if not controllers_file.is_file() or controller not in controllers_file.read_text().split():
                continue
        _sweep_orphans(parent)
        path = parent / name
        try:
            path.mkdir(exist_ok=True)
            if version == 2:
                _enable_v2_controller(parent, controller)
                _enable_v2_controller(path, controller)
        except OSError:
            # Not ours to write (no root, a read-only /sys): the report names the protection as missing.
            _remove_dir(path)
            continue
        dirs.append(ControllerDir(controller=controller, version=version, path=path))
    return dirs


def _sweep_orphans(parent: Path) -> None:
    """Remove the (empty) groups of Sandboxes whose process was killed; bwrap and setpriv's parent-death signal
    have already ended their executions."""
    for group in parent.glob(f"{PREFIX}*"):
        if group.is_dir() and is_orphaned(group.name):
            for job in group.iterdir():
                if job.is_dir():
                    with contextlib.suppress(OSError):  # still busy: left for a later sweep
                        job.rmdir()
            with contextlib.suppress(OSError):
                group.rmdir()


def _enable_v2_controller(group: Path, controller: str) -> None:
    control = group / "cgroup.subtree_control"
    if controller not in control.read_text().split():
        control.write_text(f"+{controller}")


def close_controller_dirs(dirs: list[ControllerDir]) -> None:
    for directory in {d.path for d in dirs}:
        _remove_dir(directory)


def _remove_dir(path: Path) -> None:
    # rmdir is the only way to remove a cgroup; it fails while processes are still leaving, so retry briefly.
    for _ in range(200):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005)


class JobCgroup:
    """The group of one execution (or one warm worker): limits, membership, oom count, kill, removal."""

    def __init__(
        self, dirs: list[ControllerDir], job_name: str, *, max_pids: int, memory_bytes: int, cpu_fraction: float
    ) -> None:
        self._paths: dict[str, Path] = {d.controller: d.path / job_name for d in dirs}
        self._version = {d.controller: d.version for d in dirs}
        for path in dict.fromkeys(self._paths.values()):
            path.mkdir()
        if "pids" in self._paths:
            (self._paths["pids"] / "pids.max").write_text(str(max_pids))
        if "memory" in self._paths:
            self._limit_memory(self._paths["memory"], memory_bytes)
        if "cpu" in self._paths:
            self._limit_cpu(self._paths["cpu"], cpu_fraction)

    def _limit_memory(self, path: Path, memory_bytes: int) -> None:
        if self._version["memory"] == 1:
            (path / "memory.limit_in_bytes").write_text(str(memory_bytes))
            swap_limit = path / "memory.memsw.limit_in_bytes"  # absent without swap accounting
            if swap_limit.exists():
                swap_limit.write_text(str(memory_bytes))
        else:
            (path / "memory.max").write_text(str(memory_bytes))
            swap_limit = path / "memory.swap.max"
            if swap_limit.exists():
                swap_limit.write_text("0")

    def _limit_cpu(self, path: Path, cpu_fraction: float) -> None:
        # CFS bandwidth: at most quota microseconds of CPU per period, summed over every thread of the job.
        quota = max(1000, round(cpu_fraction * _CPU_PERIOD_US))
        if self._version["cpu"] == 1:
            (path / "cpu.cfs_period_us").write_text(str(_CPU_PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (path / "cpu.max").write_text(f"{quota} {_CPU_PERIOD_US}")

    @property
    def has_pids_limit(self) -> bool:
        return "pids" in self._paths

    @property
    def has_memory_limit(self) -> bool:
        return "memory" in self._paths

    @property
    def procs_files(self) -> list[str]:
        """The cgroup.procs files a launcher writes its pid into (one per distinct group)."""
        return [str(path / "cgroup.procs") for path in dict.fromkeys(self._paths.values())]

    def pids(self) -> list[int]:
        path = next(iter(self._paths.values()))
        return [int(line) for line in (path / "cgroup.procs").read_text().split()]

    def num_oom_kills(self) -> int:
        if "memory" not in self._paths:
            return 0
        events = "memory.oom_control" if self._version["memory"] == 1 else "memory.events"
        for line in (self._paths["memory"] / events).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def kill_all(self, *, spare: int | None = None, timeout: float = 5.0) -> bool:
        """SIGKILL every process in the group (but ``spare``) until none is left; False if that took longer than
        ``timeout``. Spare the parent of a pid namespace's first process, so that it reaps that process instead of
        handing its zombie to the host's init."""
        kill_file = next(iter(self._paths.values())) / "cgroup.kill"  # v2 (Linux >= 5.14): atomic, race-free
        if spare is None and kill_file.exists():
            kill_file.write_text("1")
        deadline = time.monotonic() + timeout
        while pids := [pid for pid in self.pids() if pid != spare]:
            self._kill_members(pids)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def _kill_members(self, pids: list[int]) -> None:
        # pid_max can be as small as 32768 and a fork bomb cycles pids fast. Pin each process with a pidfd, then
        # signal only those still listed as members: a pid recycled by a foreign process is never killed.
        pidfds: dict[int, int] = {}
        for pid in pids:
            try:
                pidfds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
        try:
            members = set(self.pids())
            for pid, pidfd in pidfds.items():
                if pid in members:
                    with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        finally:
            for pidfd in pidfds.values():
                os.close(pidfd)

    def remove(self) -> None:
        for path in dict.fromkeys(self._paths.values()):
            _remove_dir(path)
