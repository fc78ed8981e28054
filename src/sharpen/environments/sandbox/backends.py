"""The ways to start untrusted code, each as a command line: unshare and a plain process here, bubblewrap in
bwrap.py; and the two tiny shell scripts at the ends of every chain.

It starts nothing and reads no output (launch.py does), and decides nothing about results (result.py). Every
chain has the same shape::

    [prelude: join the cgroups]  [drop to uid 65534]  [namespaces]  [shim: rlimits, ready marker]  program

The prelude runs on the host as root and writes its own pid into the execution's cgroups before anything else
starts, so the program and all it forks are born inside them. The shim runs last, inside the sandbox: it sets
the rlimits on the program alone (not on bwrap), then writes a ready marker to stdout and runs the program.
Output that does not begin with the marker means the sandbox failed before the program ran (`sandbox_error`);
the program cannot forge a sandbox failure, since the marker is already written when it starts.
"""

from __future__ import annotations

import os
import shlex
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
COMMAND_FILE_FLAG = "--sharpen-command-file"
_SHIM = (
    'ulimit -c 0 && ulimit -S -t "$1" && ulimit -H -t "$2" && ulimit -v "$3" && ulimit -f "$4" && ulimit -n "$5" '
    f'|| exit 125; shift 5; if [ "$1" = {COMMAND_FILE_FLAG} ]; then . "$2" || exit 125; fi; '
    'printf "\\036sharpen-sandbox-ready\\036"; '
)
# With a command file (a prepared sandbox, started before its argv was known), sourcing the file sets "$@".
# As pid 1 of a pid namespace, the shim runs the program as its child instead of becoming it: the program keeps a
# normal process's signal semantics (pid 1 ignores signals it has no handler for), the shell reaps orphans, and
# when it exits the kernel kills and reaps what is left, so no process is ever handed to the host's init.
_SHIM_EXEC = _SHIM + 'exec "$@"'
_SHIM_INIT = _SHIM + '"$@"; status=$?; exit "$status"'
_PRELUDE = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
_SH = "/bin/sh"
_SETPRIV = "/usr/bin/setpriv"


@dataclass(kw_only=True, slots=True, frozen=True)
class Limits:
    """The rlimits the shim (or a warm worker) sets on the program."""

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

    def shim_args(self) -> list[str]:
        # dash's ulimit units: seconds, KiB for -v, 512-byte blocks for -f. The hard CPU limit one second above
        # the soft one lets SIGXCPU (a "timeout") arrive before SIGKILL.
        return [
            str(self.cpu_seconds),
            str(self.cpu_seconds + 1),
            str(self.address_space_bytes >> 10),
            str(self.file_size_bytes >> 9),
            str(self.max_open_files),
        ]


def shim(argv: list[str], limits: Limits, *, is_init: bool) -> list[str]:
    """The last link of a chain; ``is_init`` when it runs as pid 1 of the sandbox's pid namespace. ``argv`` may be
    [COMMAND_FILE_FLAG, path]: a file that, sourced, sets the program's argv (see `command_file_text`)."""
    return [_SH, "-c", _SHIM_INIT if is_init else _SHIM_EXEC, "sandbox", *limits.shim_args(), *argv]


def command_file_text(argv: list[str]) -> str:
    return "set -- " + " ".join(shlex.quote(arg) for arg in argv) + "\n"


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
    """One isolation mechanism: the launch chain after the prelude (``command`` or ``prepared_command``), the cwd
    to start it in, and what it cannot protect against (``missing``)."""

    name: str = ""
    level: IsolationLevel = "weak"
    num_helper_processes: int = 0
    """Processes of the chain that stay alive beside the program (they count in the pids cgroup)."""
    required_tools: tuple[str, ...] = ()
    seccomp_program: bytes | None = None
    """A compiled seccomp filter the launch chain installs (passed as a file descriptor), if the backend has one."""
    can_prepare: bool = False
    """The sandbox can be set up before the program is known, blocked just before it (see launch.py)."""

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

    def command(self, argv: list[str], *, work_dir: Path, limits: Limits, seccomp_fd: int | None) -> list[str]:
        """The chain that runs ``argv`` at once (backends that cannot prepare)."""
        raise NotImplementedError

    def prepared_command(
        self, *, work_dir: Path, command_file: Path, limits: Limits, seccomp_fd: int | None, block_fd: int
    ) -> list[str]:
        """The chain that sets the sandbox up and waits on ``block_fd`` (backends that can prepare)."""
        raise NotImplementedError

    def cwd(self, work_dir: Path) -> str:
        return "/"


class ProcessBackend(Backend):
    """A plain child process with rlimits, as uid 65534 when we are root. Weak: no namespaces at all."""

    name, level = "process", "weak"

    def missing(self) -> list[str]:
        return [
            "network isolation: the host's network, its loopback included, is reachable",
            "filesystem isolation: world-readable host files are readable, world-writable places writable",
            "process isolation: processes of the sandbox uid (other executions) can be seen and signalled",
        ]

    def command(self, argv: list[str], *, work_dir: Path, limits: Limits, seccomp_fd: int | None) -> list[str]:
        return [*drop_privileges(die_with_parent=True), *shim(argv, limits, is_init=False)]

    def cwd(self, work_dir: Path) -> str:
        return str(work_dir)


# Run as root inside unshare's new mount namespace: hide the host's writable and personal places behind private
# tmpfs mounts, bind the work dir (reached through the cwd, since its own path may be hidden) at SANDBOX_HOME.
_UNSHARE_SETUP = (
    'cd "$2" || exit 125; for dir in /tmp /var/tmp /dev/shm /run /home /root; do '
    '[ ! -d "$dir" ] || [ -L "$dir" ] || mount -t tmpfs -o "mode=1777,size=$1" sandbox "$dir" || exit 125; done; '
    f"mkdir -p {SANDBOX_HOME} && mount --no-canonicalize --bind /proc/self/cwd {SANDBOX_HOME} && "
    f'cd {SANDBOX_HOME} || exit 125; shift 2; exec "$@"'
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

    def command(self, argv: list[str], *, work_dir: Path, limits: Limits, seccomp_fd: int | None) -> list[str]:
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
            *[_SH, "-c", _UNSHARE_SETUP, "setup", str(self._tmpfs_bytes), str(work_dir)],
            *drop_privileges(),
            *shim(argv, limits, is_init=True),
        ]
