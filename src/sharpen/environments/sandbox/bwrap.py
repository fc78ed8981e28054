"""The bubblewrap backend: the strong one, and the home of warm workers.

Owns the bwrap command line. The sandbox gets its own user (uid 65534 inside and, since bwrap itself runs as
65534, outside too: the code is never real root), mount, pid, network (loopback only), IPC, UTS and cgroup
namespaces, a new terminal session, an empty environment plus a few fixed variables, and this filesystem:

    /usr (read-only) and the /bin, /lib... links into it     /proc        its own, of its own pid namespace
    /etc: ld.so.cache, localtime, alternatives (read-only),  /dev         null, zero, full, random, urandom
          and our own passwd, group, hosts                    /tmp         private tmpfs (size: memory_mb)
    /home/sandbox: the execution's work dir (the cwd)         extra_ro_binds, read-only

Nothing else of the host exists inside: not /work, not /root, not the project, not /etc/shadow. bwrap dies with
its parent and takes the namespace with it; a seccomp filter (`seccomp.py`) narrows the syscalls.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox.backends import (
    COMMAND_FILE_FLAG,
    SANDBOX_ENV,
    SANDBOX_GID,
    SANDBOX_HOME,
    SANDBOX_UID,
    Backend,
    Limits,
    drop_privileges,
    shim,
)
from sharpen.environments.sandbox.seccomp import seccomp_filter

_ETC_FILES = {
    "passwd": (
        f"root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:{SANDBOX_UID}:{SANDBOX_GID}::{SANDBOX_HOME}:/bin/sh\n"
    ),
    "group": f"root:x:0:\nsandbox:x:{SANDBOX_GID}:\n",
    "hosts": "127.0.0.1 localhost\n::1 localhost\n",
}
_HOST_ETC = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")
_DEVICES = ("null", "zero", "full", "random", "urandom")
_COMMAND_FILE = "/run/sandbox/command"


def write_etc_files(etc_dir: Path) -> None:
    """The sandbox's own /etc/passwd, group and hosts (the host's name its accounts; these do not)."""
    etc_dir.mkdir(mode=0o755)
    for name, text in _ETC_FILES.items():
        (etc_dir / name).write_text(text)
        (etc_dir / name).chmod(0o644)


class BwrapBackend(Backend):
    """bubblewrap, run as uid 65534; see the module docstring for what the sandbox sees."""

    name, level, num_helper_processes = "bwrap", "strong", 2  # bwrap's monitor and the shim as pid 1
    required_tools = ("bwrap",)
    can_prepare = True

    def __init__(self, config: SandboxConfig, *, etc_dir: Path) -> None:
        self._static_args = [
            shutil.which("bwrap") or "/usr/bin/bwrap",
            *("--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"),
            *("--unshare-cgroup-try", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID)),
            *("--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv"),
            *[arg for name, value in SANDBOX_ENV.items() for arg in ("--setenv", name, value)],
            *_filesystem_args(config, etc_dir),
            *("--chdir", SANDBOX_HOME),
        ]
        self.seccomp_program = seccomp_filter()

    def missing(self) -> list[str]:
        return [] if self.seccomp_program is not None else ["seccomp filter (unknown architecture)"]

    def prepared_command(
        self, *, work_dir: Path, command_file: Path, limits: Limits, seccomp_fd: int | None, block_fd: int
    ) -> list[str]:
        """A sandbox that sets itself up, then waits for a byte on ``block_fd`` before it starts the shim, which
        takes the program's argv from ``command_file`` (written, like the work dir's files, once it is known)."""
        mounts = ["--bind", str(work_dir), SANDBOX_HOME, "--ro-bind", str(command_file), _COMMAND_FILE]
        return [
            *drop_privileges(),
            *self.bwrap_args(mounts=mounts, seccomp_fd=seccomp_fd),
            *("--block-fd", str(block_fd)),
            "--",
            *shim([COMMAND_FILE_FLAG, _COMMAND_FILE], limits, is_init=True),
        ]

    def bwrap_args(self, *, mounts: list[str], seccomp_fd: int | None) -> list[str]:
        """The bwrap command without the program; ``mounts`` adds SANDBOX_HOME (a bind or a tmpfs) and anything
        else of this sandbox alone. The program runs as pid 1 (--as-pid-1) and must reap: bwrap's own reaper would
        outlive bwrap's monitor and be handed to the host's init as a zombie on every execution."""
        args = [*self._static_args, *mounts, "--remount-ro", "/"]  # after every mount: only /tmp, home writable
        if seccomp_fd is not None:
            args += ["--seccomp", str(seccomp_fd)]
        return [*args, "--as-pid-1"]


def _filesystem_args(config: SandboxConfig, etc_dir: Path) -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(top):  # merged /usr: keep the link, it points into /usr
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in _HOST_ETC:
        args += ["--ro-bind-try", path, path]
    for name in _ETC_FILES:
        args += ["--ro-bind", str(etc_dir / name), f"/etc/{name}"]
    args += ["--proc", "/proc"]
    for device in _DEVICES:
        args += ["--dev-bind", f"/dev/{device}", f"/dev/{device}"]
    for number, stream in enumerate(("stdin", "stdout", "stderr")):
        args += ["--symlink", f"/proc/self/fd/{number}", f"/dev/{stream}"]
    args += ["--symlink", "/proc/self/fd", "/dev/fd", "--symlink", "/tmp", "/dev/shm"]
    args += ["--size", str(config.memory_mb << 20), "--tmpfs", "/tmp"]
    for bind in config.extra_ro_binds:
        source, _, dest = bind.partition(":")
        args += ["--ro-bind", source, dest or source]
    return args
