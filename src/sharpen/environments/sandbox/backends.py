"""The ways to start untrusted code, each as a command line: unshare and a plain process here, bubblewrap in
bwrap.py; the prelude at the front of every chain and the init at its end.

It starts nothing and reads no output (launch.py does), and decides nothing about results (result.py). Every
chain has the same shape::

    [prelude: join the cgroups]  [drop to uid 65534]  [namespaces]  init (warm_controller.py, once mode)

The prelude runs on the host as root and writes its own pid into the execution's cgroups before anything else
starts, so the program and all it forks are born inside them. The init runs last, inside the sandbox, as pid 1
of its pid namespace: it waits for the host's go, unpacks the files into the private home, sets the rlimits on
the program alone, writes a ready marker to stdout, runs the program and reports its real wait status on a pipe
that only it holds. Output that does not begin with the marker means the sandbox failed before the program ran
(`sandbox_error`); the program cannot forge a sandbox failure, since the marker is already written when it
starts, nor its own status, since it never holds the status pipe.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox.result import IsolationLevel

SANDBOX_UID = SANDBOX_GID = 65534  # nobody: owns no host file
SANDBOX_HOME = "/home/sandbox"
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": SANDBOX_HOME,
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
}
READY_MARKER = b"\x1esharpen-sandbox-ready\x1e"
INIT_SOURCE = (Path(__file__).parent / "warm_controller.py").read_text()
INIT_FLAGS = ("-I", "-S", "-B")
"""The init's interpreter flags: no environment, user or site directories, no bytecode files."""
_PRELUDE = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
_SH = "/bin/sh"
_SETPRIV = "/usr/bin/setpriv"


@dataclass(kw_only=True, slots=True, frozen=True)
class Limits:
    """The rlimits the init (or a warm worker) sets on the program."""

    cpu_seconds: int
    address_space_bytes: int
    file_size_bytes: int
    max_open_files: int

    @classmethod
    def from_config(cls, config: SandboxConfig, *, has_memory_cgroup: bool) -> Limits:
        # With a memory cgroup holding resident memory, RLIMIT_AS is only a backstop against huge single
        # allocations, so it sits above the cgroup limit and the cgroup (which can tell "oom") trips first.
        factor = 2 if has_memory_cgroup else 1
        return cls(
            cpu_seconds=config.cpu_seconds,
            address_space_bytes=factor * config.memory_mb << 20,
            file_size_bytes=config.file_size_mb << 20,
            max_open_files=config.max_open_files,
        )

    def settings(self) -> dict[str, int]:
        """The limits as the init's settings name them."""
        return {
            "cpu_seconds": self.cpu_seconds,
            "address_space_bytes": self.address_space_bytes,
            "file_size_bytes": self.file_size_bytes,
            "max_open_files": self.max_open_files,
        }


def init_command(python: str, settings: dict[str, object]) -> list[str]:
    """The init (warm_controller.py) run by ``python`` with ``settings`` (a dict of plain literals, passed as its
    ``repr``: the init reads it without importing json)."""
    return [python, *INIT_FLAGS, "-c", INIT_SOURCE, repr(settings)]


def with_prelude(command: list[str], procs_files: list[str]) -> list[str]:
    """``command`` started by a prelude that first moves itself into the cgroups of ``procs_files``."""
    if not procs_files:
        return command
    return [_SH, "-c", _PRELUDE, "prelude", *procs_files, "--", *command]


def drop_privileges(*, die_with_parent: bool = False) -> list[str]:
    """setpriv to uid/gid 65534 with no groups and no way back, when we are root (else we cannot, and need not)."""
    if os.geteuid() != 0:
        return []
    command = [_SETPRIV, f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_GID}", "--clear-groups", "--no-new-privs"]
    if die_with_parent:
        command.append("--pdeathsig=KILL")
    return [*command, "--"]


class Backend:
    """One isolation mechanism: the launch chain after the prelude (``command``), the cwd to start it in, and
    what it cannot protect against (``missing``)."""

    name: str = ""
    level: IsolationLevel = "weak"
    num_helper_processes: int = 0
    """Processes of the chain that stay alive beside the program (they count in the pids cgroup)."""
    required_tools: tuple[str, ...] = ()
    seccomp_program: bytes | None = None
    """A compiled seccomp filter the launch chain installs (passed as a file descriptor), if the backend has one."""
    can_prepare: bool = True
    """The sandbox can be set up before the program is known, its init waiting for it (every backend can)."""
    has_pid_namespace: bool = True
    """The init is pid 1 of its own pid namespace: it reports the program's status and its exit ends every process
    of the execution. Without one the init becomes the program, whose exit status the host reads itself."""
    has_private_home: bool = True
    """SANDBOX_HOME is a tmpfs of this execution alone; without one, the home is a host directory."""

    def missing(self) -> list[str]:
        """Protections this backend never gives, in words."""
        return []

    def unavailable_reason(self) -> str | None:
        if os.geteuid() == 0 and not Path(_SETPRIV).is_file():
            return f"{_SETPRIV} (util-linux) is not installed"
        for tool in self.required_tools:
            if shutil.which(tool) is None:
                return f"{tool} is not installed"
        return None

    def command(self, init: list[str], *, work_dir: Path | None, fds: list[int]) -> list[str]:
        """The chain that sets the sandbox up and starts ``init`` in it. ``work_dir`` is the host home of a
        backend without a private one. Descriptors the chain needs (a seccomp program, file contents) are
        appended to ``fds``: the caller passes them to the chain and closes them."""
        raise NotImplementedError

    def cwd(self, work_dir: Path | None) -> str:
        return "/"

    def home(self, work_dir: Path | None) -> str:
        """Where the init unpacks the files and runs the program, as the sandbox sees it."""
        return SANDBOX_HOME


class ProcessBackend(Backend):
    """A plain child process with rlimits, as uid 65534 when we are root. Weak: no namespaces at all."""

    name, level = "process", "weak"
    has_pid_namespace = has_private_home = False

    def missing(self) -> list[str]:
        return [
            "network isolation: the host's network, its loopback included, is reachable",
            "filesystem isolation: world-readable host files are readable, world-writable places writable",
            "process isolation: processes of the sandbox uid (other executions) can be seen and signalled",
        ]

    def command(self, init: list[str], *, work_dir: Path | None, fds: list[int]) -> list[str]:
        return [*drop_privileges(die_with_parent=True), *init]

    def cwd(self, work_dir: Path | None) -> str:
        assert work_dir is not None
        return str(work_dir)

    def home(self, work_dir: Path | None) -> str:
        return self.cwd(work_dir)


# Run as root inside unshare's new mount namespace: hide the host's writable and personal places behind private
# tmpfs mounts, and make the home a tmpfs of its own, owned by the sandbox uid.
_UNSHARE_SETUP = (
    "for dir in /tmp /var/tmp /dev/shm /run /home /root; do "
    '[ ! -d "$dir" ] || [ -L "$dir" ] || mount -t tmpfs -o "mode=1777,size=$1" sandbox "$dir" || exit 125; done; '
    f"mkdir -p {SANDBOX_HOME} && "
    f'mount -t tmpfs -o "mode=0755,uid={SANDBOX_UID},gid={SANDBOX_GID},size=$1" sandbox {SANDBOX_HOME} && '
    f'cd {SANDBOX_HOME} || exit 125; shift; exec "$@"'
)


class UnshareBackend(Backend):
    """util-linux unshare: own mount, pid, network, IPC and UTS namespaces, private /tmp, /run, /home, /root,
    uid 65534. Medium: the rest of the host filesystem stays visible, protected only by file permissions."""

    name, level, num_helper_processes = "unshare", "medium", 1
    required_tools = ("unshare", "mount")

    def __init__(self, config: SandboxConfig) -> None:
        self._tmpfs_bytes = config.memory_mb << 20

    def missing(self) -> list[str]:
        return [
            "filesystem isolation: world-readable host files (outside /tmp, /run, /home, /root) are readable",
            "seccomp filter",
        ]

    def unavailable_reason(self) -> str | None:
        if os.geteuid() != 0:
            return "unshare needs root here (mount namespaces, tmpfs mounts)"
        return super().unavailable_reason()

    def command(self, init: list[str], *, work_dir: Path | None, fds: list[int]) -> list[str]:
        return [
            _SETPRIV,
            "--pdeathsig=KILL",  # unshare dies with us; its --kill-child then ends the namespace
            "--",
            "unshare",
            "--mount",
            "--net",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "--ipc",
            "--uts",
            "--",
            *[_SH, "-c", _UNSHARE_SETUP, "setup", str(self._tmpfs_bytes)],
            *drop_privileges(),
            *init,
        ]
