"""The bubblewrap backend: the strong one, and the home of warm workers.

Owns the bwrap command line. The sandbox gets its own user (uid 65534 inside and, since bwrap itself runs as
65534, outside too: the code is never real root), mount, pid, network (loopback only), IPC, UTS and cgroup
namespaces, a new terminal session, an empty environment plus a few fixed variables, and this filesystem:

    /usr (read-only) and the /bin, /lib... links into it     /proc        its own, of its own pid namespace
    /etc: ld.so.cache, localtime, alternatives (read-only),  /dev         null, zero, full, random, urandom
          and our own passwd, group, hosts                    /tmp         private tmpfs (size: memory_mb)
    /home/sandbox: private tmpfs (size: memory_mb), the cwd   extra_ro_binds, read-only

Nothing else of the host exists inside: not /work, not /root, not the project, not /etc/shadow, and no host
directory of ours: the home is a tmpfs of this sandbox alone (the init unpacks the files into it), our /etc files
are copied in from memory (--ro-bind-data), so neither statfs nor /proc/self/mountinfo shows a host path, a host
pid or another execution's usage. bwrap dies with its parent and takes the namespace with it; a seccomp filter
(`seccomp.py`) narrows the syscalls.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox.backends import (
    SANDBOX_ENV,
    SANDBOX_GID,
    SANDBOX_HOME,
    SANDBOX_UID,
    Backend,
    drop_privileges,
)
from sharpen.environments.sandbox.execution import memfd
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


class BwrapBackend(Backend):
    """bubblewrap, run as uid 65534; see the module docstring for what the sandbox sees."""

    name, level, num_helper_processes = "bwrap", "strong", 2  # bwrap's monitor and the init as pid 1
    required_tools = ("bwrap",)

    def __init__(self, config: SandboxConfig) -> None:
        self._home_bytes = config.memory_mb << 20
        self._static_args = [
            shutil.which("bwrap") or "/usr/bin/bwrap",
            *("--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"),
            *("--unshare-cgroup-try", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID)),
            *("--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv"),
            *[arg for name, value in SANDBOX_ENV.items() for arg in ("--setenv", name, value)],
            *_filesystem_args(config),
        ]
        self.seccomp_program = seccomp_filter()

    def missing(self) -> list[str]:
        return [] if self.seccomp_program is not None else ["seccomp filter (unknown architecture)"]

    def command(self, init: list[str], *, work_dir: Path | None, fds: list[int]) -> list[str]:
        return [*drop_privileges(), *self.bwrap_args(fds), "--", *init]

    def bwrap_args(self, fds: list[int]) -> list[str]:
        """The bwrap command without the program, its home a fresh tmpfs; the descriptors it reads (our /etc
        files, the seccomp program) are appended to ``fds``, for the caller to pass and then close. The program
        runs as pid 1 (--as-pid-1) and must reap: bwrap's own reaper would outlive bwrap's monitor and be handed
        to the host's init as a zombie on every execution."""
        args = list(self._static_args)
        for name, text in _ETC_FILES.items():
            fds.append(memfd(name, text.encode()))
            args += ["--perms", "0644", "--ro-bind-data", str(fds[-1]), f"/etc/{name}"]
        args += ["--size", str(self._home_bytes), "--tmpfs", SANDBOX_HOME, "--chdir", SANDBOX_HOME]
        args += ["--remount-ro", "/"]  # after every mount: only /tmp and the home are writable
        if self.seccomp_program is not None:
            fds.append(memfd("seccomp", self.seccomp_program))
            args += ["--seccomp", str(fds[-1])]
        return [*args, "--as-pid-1"]


def _filesystem_args(config: SandboxConfig) -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(top):  # merged /usr: keep the link, it points into /usr
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in _HOST_ETC:
        args += ["--ro-bind-try", path, path]
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
