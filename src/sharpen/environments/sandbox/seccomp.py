"""A seccomp filter for the bwrap backend, compiled to classic BPF here (no libseccomp needed).

Namespaces already deny what needs a capability; this filter shrinks what an unprivileged process may still ask
the kernel for, and closes the channels through which jobs could reach each other or the host:
kernel keyrings (a process possesses its parent's session keyring), SysV and POSIX message IPC, reaching into
another process (ptrace, process_vm_readv/writev, pidfd_getfd, process_madvise, kcmp), the kernel log (syslog),
bpf, perf_event_open, userfaultfd, io_uring, file handles (name_to_handle_at, open_by_handle_at), the mount API,
new user namespaces (unshare, clone with CLONE_NEWUSER), and any syscall entered through another ABI (x32, or the
32-bit one on x86_64). Most of these already need a capability the sandbox lacks or a same-uid process that a
pid namespace hides; the filter holds where that is not enough (the jobs of one warm worker share a pid
namespace) and against kernel bugs behind them. Denied calls fail with EPERM; clone3 fails with ENOSYS, since
its flags cannot be inspected and libc then falls back to clone.

It owns the syscall tables of the architectures it knows (x86_64, aarch64); elsewhere there is no filter and the
isolation report says so.
"""

from __future__ import annotations

import errno
import platform
import struct

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_CLONE_NEWUSER = 0x10000000
_X32_SYSCALL_BIT = 0x40000000

# name: (x86_64, aarch64)
_DENIED_SYSCALLS = {
    "add_key": (248, 217),
    "request_key": (249, 218),
    "keyctl": (250, 219),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438),
    "process_madvise": (440, 440),
    "kcmp": (312, 272),
    "syslog": (103, 116),
    "name_to_handle_at": (303, 264),
    "open_by_handle_at": (304, 265),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "unshare": (272, 97),
    "setns": (308, 268),
    "shmget": (29, 194),
    "shmat": (30, 196),
    "shmctl": (31, 195),
    "semget": (64, 190),
    "semctl": (66, 191),
    "semop": (65, 193),
    "semtimedop": (220, 192),
    "msgget": (68, 186),
    "msgsnd": (69, 189),
    "msgrcv": (70, 188),
    "msgctl": (71, 187),
    "mq_open": (240, 180),
}
_CLONE = (56, 220)
_CLONE3 = (435, 435)

# classic BPF opcodes and seccomp return values
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_ERRNO, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_OFFSET_NR, _OFFSET_ARCH, _OFFSET_ARG0 = 0, 4, 16


def _instruction(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """The filter program for ``machine`` (default: this host), or None for an architecture it does not know."""
    machine = machine or platform.machine()
    if machine not in _AUDIT_ARCH:
        return None
    column = 0 if machine == "x86_64" else 1
    denied = sorted({numbers[column] for numbers in _DENIED_SYSCALLS.values()})
    # Layout: arch check, x32 check, one jump per denied syscall, clone and clone3, allow; then the clone flag
    # check and the two error returns. Jump offsets count instructions to skip, so they are computed backwards
    # from the fixed tail: [allow][ld arg0][jset NEWUSER][allow][deny][enosys].
    program = [
        _instruction(_LD_W_ABS, _OFFSET_ARCH),
        _instruction(_JEQ_K, _AUDIT_ARCH[machine], jt=1),
        _instruction(_RET_K, _RET_KILL_PROCESS),
        _instruction(_LD_W_ABS, _OFFSET_NR),
    ]
    num_checks = 1 + len(denied) + 2  # x32 check, denied syscalls, clone, clone3
    for index in range(num_checks):
        remaining = num_checks - index - 1  # checks after this one
        to_allow = remaining  # the allow after the last check
        to_clone_check, to_deny, to_enosys = to_allow + 1, to_allow + 4, to_allow + 5
        if index == 0:
            program.append(_instruction(_JGE_K, _X32_SYSCALL_BIT, jt=to_deny))
        elif index <= len(denied):
            program.append(_instruction(_JEQ_K, denied[index - 1], jt=to_deny))
        elif index == len(denied) + 1:
            program.append(_instruction(_JEQ_K, _CLONE[column], jt=to_clone_check))
        else:
            program.append(_instruction(_JEQ_K, _CLONE3[column], jt=to_enosys))
    program += [
        _instruction(_RET_K, _RET_ALLOW),
        _instruction(_LD_W_ABS, _OFFSET_ARG0),  # clone's flags (low 32 bits, little-endian)
        _instruction(_JSET_K, _CLONE_NEWUSER, jt=1),
        _instruction(_RET_K, _RET_ALLOW),
        _instruction(_RET_K, _RET_ERRNO | errno.EPERM),
        _instruction(_RET_K, _RET_ERRNO | errno.ENOSYS),
    ]
    return b"".join(program)
