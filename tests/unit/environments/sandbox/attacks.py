"""The red-team suite's attacks on the sandbox, as data: what a policy's program would try, and two verdicts on
its result, ``is_defended`` (what the sandbox must make of it) and ``is_real`` (what the attack achieves on the
naive path, `naive.py`: a bare subprocess as the test's own user with the sandbox's old status rules), so that
every defence is shown to matter. An attack with ``is_real`` None has no naive counterpart; ``no_naive`` says why.

Every program reads the host facts an attacker would hunt for from stdin, as JSON (``H``): the test process's
pid, a host file, a host loopback port, a token. Programs that leave state for a later job come as ``steps``: the
verdicts judge the last step, which runs after the earlier ones on the same warm worker (or, naively, in the
same directory after the old reset: its contents emptied).
"""

from __future__ import annotations

import errno
import platform
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from sharpen.environments.sandbox.backends import READY_MARKER


class Outcome(Protocol):
    """What both paths return (ExecutionResult, NaiveResult)."""

    @property
    def status(self) -> str: ...
    @property
    def exit_code(self) -> int | None: ...
    @property
    def signal(self) -> int | None: ...
    @property
    def stdout(self) -> str: ...
    @property
    def stderr(self) -> str: ...
    @property
    def detail(self) -> str: ...


Verdict = Callable[[Outcome], bool]
_HEADER = "import json, os, sys\nH = json.loads(sys.stdin.read() or '{}')\n"
IS_X86_64 = platform.machine() == "x86_64"


@dataclass(kw_only=True, frozen=True)
class Attack:
    name: str
    steps: tuple[str, ...]
    """Python programs run one after another (main.py each); the last one is judged."""
    is_defended: Verdict
    is_real: Verdict | None
    no_naive: str = ""
    is_warm: bool = True
    """Also run against warm workers (all but the attacks on the cold init itself)."""
    files: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert (self.is_real is None) == bool(self.no_naive), self.name


def _program(code: str) -> str:
    return _HEADER + textwrap.dedent(code)


def _lines(result: Outcome) -> list[str]:
    return result.stdout.splitlines()


def _prints(text: str) -> Verdict:
    return lambda result: result.stdout == text


def _status(status: str, *, exit_code: int | None = None, signal: int | None = None) -> Verdict:
    def verdict(result: Outcome) -> bool:
        if exit_code is not None and result.exit_code != exit_code:
            return False
        return result.status == status and (signal is None or result.signal == signal)

    return verdict


# ------------------------------------------------------------------------------------------------ seccomp, one each

_SYSCALL = """
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
number = {numbers}[platform.machine()]
result = libc.syscall(number, {args})
print(ctypes.get_errno() if result == -1 else 0)
"""


def _syscall(name: str, x86_64: int, aarch64: int, args: str, *, denied_with: int = errno.EPERM) -> Attack:
    """Call one syscall with arguments that make it harmless (and, unfiltered, fail with an error other than EPERM
    or succeed as a no-op): the filter must answer ``denied_with`` first."""
    numbers = {"x86_64": x86_64, "aarch64": aarch64}
    code = _program(_SYSCALL.format(numbers=numbers, args=args))
    return Attack(
        name=f"seccomp_{name}",
        steps=(code,),
        is_defended=_prints(f"{denied_with}\n"),
        is_real=lambda result: result.status == "ok" and result.stdout not in ("", f"{denied_with}\n"),
    )


_PID = "__import__('os').getpid()"
SECCOMP_ATTACKS = [
    _syscall("process_vm_readv", 310, 270, f"{_PID}, 0, 0, 0, 0, 0"),  # read another process's memory
    _syscall("process_vm_writev", 311, 271, f"{_PID}, 0, 0, 0, 0, 0"),
    _syscall("ptrace", 101, 117, "2, 999999999, 0, 0"),  # PTRACE_PEEKDATA
    _syscall("pidfd_getfd", 438, 438, "-1, 0, 0"),  # steal another process's descriptor
    _syscall("process_madvise", 440, 440, "-1, 0, 0, 0, 0"),
    _syscall("kcmp", 312, 272, f"{_PID}, {_PID}, 99, 0, 0"),
    _syscall("syslog", 103, 116, "99, 0, 0"),  # the kernel log
    _syscall("perf_event_open", 298, 241, "0, 0, -1, -1, 0"),
    _syscall("bpf", 321, 280, "999, 0, 0"),
    _syscall("userfaultfd", 323, 282, "0xffff"),
    _syscall("add_key", 248, 217, "0, 0, 0, 0, 0"),
    _syscall("request_key", 249, 218, "0, 0, 0, 0"),
    _syscall("keyctl", 250, 219, "9999, 0, 0, 0, 0"),
    _syscall("io_uring_setup", 425, 425, "0, 0"),
    _syscall("unshare", 272, 97, "0"),
    _syscall("setns", 308, 268, "-1, 0"),
    _syscall("shmget", 29, 194, "0, 0, 0"),
    _syscall("msgctl", 71, 187, "-1, 2, 0"),
    _syscall("semctl", 66, 191, "-1, 0, 2, 0"),
    _syscall("mq_open", 240, 180, "0, 0, 0, 0"),
    _syscall("name_to_handle_at", 303, 264, "-1, 0, 0, 0, 0"),
    _syscall("open_by_handle_at", 304, 265, "-1, 0, 0"),
    _syscall("mount", 165, 40, "0, 0, 0, 0, 0"),
    _syscall("umount2", 166, 39, "0, 0"),
    _syscall("pivot_root", 155, 41, "0, 0"),
    _syscall("fsopen", 430, 430, "0, 0"),
    _syscall("open_tree", 428, 428, "-1, 0, 0"),
    _syscall("move_mount", 429, 429, "-1, 0, -1, 0, 0"),
    _syscall("fspick", 433, 433, "-1, 0, 0"),
    _syscall("mount_setattr", 442, 442, "-1, 0, 0, 0, 0"),
    _syscall("clone_newuser", 56, 220, "0x10000000 | 0x200, 0, 0, 0, 0"),  # CLONE_NEWUSER|CLONE_FS: EINVAL unfiltered
    _syscall("clone3", 435, 435, "0, 0", denied_with=errno.ENOSYS),  # flags unreadable: libc falls back to clone
]
if IS_X86_64:  # the x32 ABI (getpid with the x32 bit): a second syscall table the filter does not list
    SECCOMP_ATTACKS.append(_syscall("x32_abi", 0x40000000 | 39, 0, ""))

# -------------------------------------------------------------------------------------------- forging the status

_RT_SIGNAL = "import os, signal\nos.kill(os.getpid(), signal.SIGRTMIN + {offset})"
STATUS_ATTACKS = [
    Attack(  # a shell-style 128 + 9: the old rules read it as a SIGKILL
        name="exit_137_reads_as_sigkill",
        steps=(_program("sys.exit(137)"),),
        is_defended=_status("nonzero_exit", exit_code=137),
        is_real=lambda result: result.status == "killed" and result.signal == 9,
    ),
    Attack(  # 128 + SIGXCPU: the old rules made it a "timeout", which rewards may treat apart
        name="exit_152_reads_as_cpu_timeout",
        steps=(_program("os._exit(152)"),),
        is_defended=_status("nonzero_exit", exit_code=152),
        is_real=lambda result: result.status == "timeout",
    ),
    Attack(  # 128 + SIGRTMIN+5: the old rules crashed the runner (signal.Signals(39) raises)
        name="exit_into_a_realtime_signal_crashes_the_runner",
        steps=(_program("os._exit(167)"),),
        is_defended=_status("nonzero_exit", exit_code=167),
        is_real=lambda result: result.status == "crashed",
    ),
    Attack(
        name="death_by_realtime_signal",
        steps=(_program(_RT_SIGNAL.format(offset=5)),),
        is_defended=lambda result: result.status == "killed" and "SIGRTMIN+5" in result.detail,
        is_real=lambda result: result.status == "crashed",
    ),
    Attack(
        name="death_by_an_unnamed_realtime_signal",
        steps=(_program("import os, signal\nos.kill(os.getpid(), signal.SIGRTMAX - 1)"),),
        is_defended=lambda result: result.status == "killed" and "SIGRTMIN+" in result.detail,
        is_real=lambda result: result.status == "crashed",
    ),
    Attack(
        name="fake_ready_marker_and_sandbox_error_text",
        steps=(
            _program(f"""
                sys.stdout.buffer.write({READY_MARKER!r})
                print("bwrap: setting up uid map: Permission denied", file=sys.stderr)
                sys.exit(125)
            """),
        ),
        is_defended=_status("nonzero_exit", exit_code=125),
        is_real=None,
        no_naive="the old rules already judged the marker before the program ran; kept as a regression",
    ),
]

# ----------------------------------------------------------------------------------------- forcing an abstention

_CYCLE = """
import socket
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
socket.send_fds(b, [b"x"], [a.fileno(), {fds}])  # a's queue holds a itself and the output pipes
socket.send_fds(a, [b"x"], [b.fileno()])
print("in flight", flush=True)
"""


def _is_the_programs_own(result: Outcome) -> bool:
    """Killed for holding its output open past its end, or ok where the kernel freed the cycle within the drain:
    either way the program's outcome, never the sandbox's."""
    is_held = result.status == "killed" and "in flight" in result.detail
    return is_held or (result.status == "ok" and result.stdout == "in flight\n")


CPU_FRACTION = 0.3
"""The red-team sandboxes' cpu_fraction."""
_CPU_BOUND = CPU_FRACTION * 1.3 + 0.1
ABSTENTION_ATTACKS = [
    Attack(  # descriptors in flight (SCM_RIGHTS) outlive every process and keep the output pipes open
        name="fd_cycle_holds_stdout_and_stderr_open",
        steps=(_program(_CYCLE.format(fds="1, 2")),),
        is_defended=lambda result: _is_the_programs_own(result),
        is_real=None,
        no_naive=(
            "outside a sandbox the kernel collects such a cycle at once; against the old sandbox (before this suite) "
            "it returned sandbox_error after a 2 s drain, and daemon_holds_stdout_open shows that old rule"
        ),
    ),
    Attack(
        name="fd_cycle_holds_stderr_open",
        steps=(_program(_CYCLE.format(fds="2")),),
        is_defended=lambda result: _is_the_programs_own(result),
        is_real=None,
        no_naive=(
            "outside a sandbox the kernel collects such a cycle at once; against the old sandbox (before this suite) "
            "it returned sandbox_error after a 2 s drain, and daemon_holds_stdout_open shows that old rule"
        ),
    ),
    Attack(  # a daemon that keeps the output open after the program exited
        name="daemon_holds_stdout_open",
        steps=(
            _program("""
                if os.fork() == 0:
                    os.setsid()
                    if os.fork() == 0:
                        os.execvp("sleep", ["sleep", H["sleep"]])
                    os._exit(0)
                print("bye")
            """),
        ),
        is_defended=_status("ok"),
        is_real=_status("sandbox_error"),
    ),
    Attack(
        name="kill_the_init_from_inside",
        steps=(
            _program("""
                import signal
                for number in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGSTOP):
                    os.kill(os.getppid(), number)
                print("sent")
            """),
        ),
        is_defended=lambda result: result.status == "ok" and result.stdout == "sent\n",
        is_real=None,
        no_naive="bare, the program's parent is the test runner: signalling it would kill the test",
    ),
    Attack(
        name="fill_every_pid_then_exit",
        steps=(
            _program("""
                import time
                while True:
                    try:
                        if os.fork() == 0:
                            time.sleep(30)
                            os._exit(0)
                    except OSError:
                        break
                print("full")
            """),
        ),
        is_defended=_status("ok"),
        is_real=None,
        no_naive="bare, nothing bounds the forks: it would exhaust the host",
    ),
]

# ---------------------------------------------------------------------------- state left for the next warm job

_HOME_STATE = "import stat\ninfo = os.stat('{path}')\n"
WARM_STATE_ATTACKS = [
    Attack(
        name="home_mode_left_closed",
        steps=(_program("os.chmod('.', 0)"), _program("print(oct(os.stat('.').st_mode & 0o7777))")),
        is_defended=lambda result: result.stdout in ("0o755\n", "0o700\n"),
        is_real=_prints("0o0\n"),
    ),
    Attack(
        name="home_mode_left_open",
        steps=(_program("os.chmod('.', 0o777)"), _program("print(oct(os.stat('.').st_mode & 0o7777))")),
        is_defended=lambda result: result.stdout in ("0o755\n", "0o700\n"),
        is_real=_prints("0o777\n"),
    ),
    Attack(
        name="tmp_mode_changed",
        steps=(
            _program("T = os.environ.get('TMPDIR', '/tmp')\nos.chmod(T, 0o1777)"),
            _program("T = os.environ.get('TMPDIR', '/tmp')\nprint(oct(os.stat(T).st_mode & 0o7777))"),
        ),
        is_defended=lambda result: result.stdout != "0o1777\n" and result.status == "ok",
        is_real=_prints("0o1777\n"),
    ),
    Attack(
        name="home_xattr_message",
        steps=(
            _program("os.setxattr('.', 'user.note', b'answer=42')"),
            _program("print([os.getxattr('.', n) for n in os.listxattr('.')])"),
        ),
        is_defended=_prints("[]\n"),
        is_real=_prints("[b'answer=42']\n"),
    ),
    Attack(
        name="tmp_xattr_message",
        steps=(
            _program("T = os.environ.get('TMPDIR', '/tmp')\nos.setxattr(T, 'user.note', b'42')"),
            _program(
                "T = os.environ.get('TMPDIR', '/tmp')\nt = T\nprint([os.getxattr(t, n) for n in os.listxattr(t)])"
            ),
        ),
        is_defended=_prints("[]\n"),
        is_real=_prints("[b'42']\n"),
    ),
    Attack(  # a number hidden in a timestamp that emptying an empty directory does not touch
        name="tmp_mtime_message",
        steps=(
            _program("T = os.environ.get('TMPDIR', '/tmp')\nos.utime(T, (4343, 4343))"),
            _program("T = os.environ.get('TMPDIR', '/tmp')\nprint(int(os.stat(T).st_mtime))"),
        ),
        is_defended=lambda result: result.status == "ok" and result.stdout != "4343\n",
        is_real=_prints("4343\n"),
    ),
    Attack(  # a listening socket kept alive in flight, found by name by the next job: a channel between jobs
        name="abstract_socket_left_in_flight",
        steps=(
            _program("""
                import socket
                name = "\\0sharpen-note-" + H["token"]
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                listener.bind(name)
                listener.listen()
                a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
                socket.send_fds(b, [b"x"], [a.fileno(), listener.fileno()])
                socket.send_fds(a, [b"x"], [b.fileno()])
            """),
            _program("""
                import socket
                client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    client.connect("\\0sharpen-note-" + H["token"])
                    print("found")
                except OSError:
                    print("gone")
            """),
        ),
        is_defended=_prints("gone\n"),
        is_real=_prints("found\n"),
    ),
    Attack(  # TIME_WAIT entries outlive the processes: the next job reads the port as a message
        name="tcp_time_wait_port_message",
        steps=(
            _program("""
                import socket
                server = socket.create_server(("127.0.0.1", 0))
                client = socket.create_connection(server.getsockname())
                peer, _ = server.accept()
                client.close()
                peer.close()
                print(server.getsockname()[1])
            """),
            _program("""
                ports = set()
                for line in open("/proc/net/tcp").readlines()[1:]:
                    fields = line.split()
                    ports |= {int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)}
                print(sorted(ports))
            """),
        ),
        is_defended=_prints("[]\n"),
        is_real=lambda result: result.status == "ok" and result.stdout not in ("", "[]\n"),
    ),
]

# ------------------------------------------------------------------------------------ the host and its secrets

HOST_ATTACKS = [
    Attack(
        name="read_etc_shadow",
        steps=(_program("print(len(open('/etc/shadow').read()) > 0)"),),
        is_defended=lambda result: result.status == "nonzero_exit" and "FileNotFoundError" in result.stderr,
        is_real=_prints("True\n"),
    ),
    Attack(
        name="read_a_host_file_by_path",
        steps=(_program("print(open(H['canary']).read())"),),
        is_defended=lambda result: result.status == "nonzero_exit" and "FileNotFoundError" in result.stderr,
        is_real=lambda result: result.stdout.startswith("canary-"),
    ),
    Attack(
        name="symlink_to_a_host_file",
        steps=(_program("os.symlink(H['canary'], 'link')\nprint(open('link').read())"),),
        is_defended=lambda result: result.status == "nonzero_exit" and "FileNotFoundError" in result.stderr,
        is_real=lambda result: result.stdout.startswith("canary-"),
    ),
    Attack(
        name="list_root_home",
        steps=(_program("print(len(os.listdir('/root')) >= 0)"),),
        is_defended=lambda result: result.status == "nonzero_exit",
        is_real=_prints("True\n"),
    ),
    Attack(
        name="write_to_a_host_path",
        steps=(_program("open(H['canary'] + '.escaped', 'w').write('x')\nprint('written')"),),
        is_defended=lambda result: result.status == "nonzero_exit" and "written" not in result.stdout,
        is_real=_prints("written\n"),
    ),
    Attack(
        name="secret_in_the_environment",
        steps=(_program("print('SHARPEN_TEST_SECRET' in os.environ)"),),
        is_defended=_prints("False\n"),
        is_real=_prints("True\n"),
    ),
    Attack(
        name="secret_in_the_parent_environ",
        steps=(_program("print(b'SHARPEN_TEST_SECRET' in open(f'/proc/{os.getppid()}/environ', 'rb').read())"),),
        is_defended=lambda result: result.status == "nonzero_exit" and "PermissionError" in result.stderr,
        is_real=_prints("True\n"),
    ),
    Attack(
        name="host_loopback_listener",
        steps=(
            _program("""
                import socket
                socket.create_connection(("127.0.0.1", H["port"]), timeout=1)
                print("connected")
            """),
        ),
        is_defended=lambda result: result.status == "nonzero_exit" and "ConnectionRefusedError" in result.stderr,
        is_real=_prints("connected\n"),
    ),
    Attack(
        name="network_interfaces",
        steps=(_program("import socket\nprint([name for _, name in socket.if_nameindex()])"),),
        is_defended=_prints("['lo']\n"),
        is_real=lambda result: result.status == "ok" and result.stdout != "['lo']\n",
    ),
    Attack(
        name="host_name",
        steps=(_program("print(os.uname().nodename)"),),
        is_defended=_prints("sandbox\n"),
        is_real=lambda result: result.status == "ok" and result.stdout != "sandbox\n",
    ),
]

# -------------------------------------------------------------------------------------- processes and /proc

PROC_ATTACKS = [
    Attack(
        name="signal_a_host_process",
        steps=(_program("os.kill(H['host_pid'], 0)\nprint('reachable')"),),  # signal 0: a permission check only
        is_defended=lambda result: result.status == "nonzero_exit" and "ProcessLookupError" in result.stderr,
        is_real=_prints("reachable\n"),
    ),
    Attack(
        name="host_process_cwd",
        steps=(_program("print(len(os.listdir(f\"/proc/{H['host_pid']}/cwd\")) > 0)"),),
        is_defended=lambda result: result.status == "nonzero_exit" and "FileNotFoundError" in result.stderr,
        is_real=_prints("True\n"),
    ),
    Attack(
        name="proc_lists_host_processes",
        steps=(_program("print(H['host_pid'] in [int(p) for p in os.listdir('/proc') if p.isdigit()])"),),
        is_defended=_prints("False\n"),
        is_real=_prints("True\n"),
    ),
    Attack(
        name="proc_1_is_not_the_sandbox",
        steps=(_program("print(b'The init of every sandbox' in open('/proc/1/cmdline', 'rb').read())"),),
        is_defended=_prints("True\n"),
        is_real=_prints("False\n"),
    ),
    Attack(
        name="mountinfo_shows_host_paths",
        steps=(
            _program("""
                text = open("/proc/self/mountinfo").read()
                print([word for word in ("/dev/shm", "sharpen", "/work", "/root", str(H["host_pid"])) if word in text])
            """),
        ),
        is_defended=_prints("[]\n"),
        is_real=lambda result: result.status == "ok" and result.stdout != "[]\n",
    ),
    Attack(
        name="proc_mounts_show_host_filesystems",
        steps=(
            _program("""
                own = ("/", "/usr", "/proc", "/tmp", "/home/sandbox")
                points = {line.split()[1] for line in open("/proc/mounts")}
                print(sorted(p for p in points if p not in own and not p.startswith(("/dev/", "/etc/"))))
            """),
        ),
        is_defended=_prints("[]\n"),
        is_real=lambda result: result.status == "ok" and result.stdout != "[]\n",
    ),
    Attack(  # statfs of the home told the host's /dev/shm size and usage (and other executions' files)
        name="statfs_of_home_is_shared",
        steps=(
            _program("s = os.statvfs('.')\nprint(s.f_blocks * s.f_frsize == 128 << 20, s.f_blocks - s.f_bfree < 8)"),
        ),
        is_defended=_prints("True True\n"),
        is_real=lambda result: result.status == "ok" and result.stdout != "True True\n",
    ),
    Attack(
        name="sibling_work_dirs",
        steps=(_program("print(sorted(os.listdir('..')))"),),
        is_defended=_prints("['sandbox']\n"),
        is_real=lambda result: result.status == "ok" and result.stdout != "['sandbox']\n",
    ),
    Attack(
        name="read_the_parents_memory",
        steps=(_program("open(f'/proc/{os.getppid()}/mem', 'rb')\nprint('opened')"),),
        is_defended=lambda result: result.status == "nonzero_exit" and "PermissionError" in result.stderr,
        is_real=_prints("opened\n"),
    ),
    Attack(
        name="list_the_parents_descriptors",
        steps=(_program("print(len(os.listdir(f'/proc/{os.getppid()}/fd')) > 0)"),),
        is_defended=lambda result: result.status == "nonzero_exit" and "PermissionError" in result.stderr,
        is_real=_prints("True\n"),
    ),
]

# ------------------------------------------------------------------------------------------------- resources

RESOURCE_ATTACKS = [
    Attack(  # bounded here so that the naive path survives it; the pids cgroup stops it at max_processes
        name="more_processes_than_allowed",
        steps=(
            _program("""
                import time
                children = 0
                for _ in range(40):
                    try:
                        pid = os.fork()
                    except OSError:
                        break
                    if pid == 0:
                        time.sleep(2)
                        os._exit(0)
                    children += 1
                print(children)
            """),
        ),
        is_defended=lambda result: result.status == "ok" and int(result.stdout) < 16,
        is_real=_prints("40\n"),
    ),
    Attack(
        name="memory_beyond_the_limit",
        steps=(_program("chunks = [bytearray(16 << 20) for _ in range(16)]\nprint('allocated')"),),
        is_defended=lambda result: result.status in ("oom", "nonzero_exit") and "allocated" not in result.stdout,
        is_real=_prints("allocated\n"),
    ),
    Attack(  # threads spinning for one wall second: the cpu cgroup holds the job to cpu_fraction of a core
        name="starve_the_host_cpu",
        steps=(
            _program("""
                import threading, time
                def spin():
                    end = time.monotonic() + 1.0
                    while time.monotonic() < end:
                        pass
                threads = [threading.Thread(target=spin) for _ in range(2)]
                start = time.monotonic()
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                print(round(time.process_time() / (time.monotonic() - start), 2))
            """),
        ),
        is_defended=lambda result: result.status == "ok" and float(result.stdout) <= _CPU_BOUND,
        is_real=lambda result: result.status == "ok" and float(result.stdout) > _CPU_BOUND,
    ),
    Attack(
        name="cpu_time_beyond_the_limit",
        steps=(
            _program("""
                import time
                end = time.process_time() + 1.5
                while time.process_time() < end:
                    pass
                print("done")
            """),
        ),
        is_defended=lambda result: result.status == "timeout" and "CPU-time" in result.detail,
        is_real=_prints("done\n"),
    ),
    Attack(
        name="descriptor_exhaustion",
        steps=(
            _program("""
                files = []
                try:
                    for _ in range(200):
                        files.append(open("/dev/null"))
                except OSError:
                    pass
                print(len(files))
            """),
        ),
        is_defended=lambda result: result.status == "ok" and int(result.stdout) < 32,
        is_real=_prints("200\n"),
    ),
    Attack(
        name="huge_output",
        steps=(_program("sys.stdout.write('x' * (1 << 20))"),),
        is_defended=lambda result: result.status == "killed" and len(result.stdout) == 4096,
        is_real=lambda result: len(result.stdout) == 1 << 20,
    ),
    Attack(
        name="huge_stderr",
        steps=(_program("sys.stderr.write('x' * (1 << 20))"),),
        is_defended=lambda result: result.status == "killed" and len(result.stderr) == 4096,
        is_real=lambda result: len(result.stderr) == 1 << 20,
    ),
    Attack(
        name="huge_file",
        steps=(_program("open('big', 'wb').write(b'x' * (4 << 20))\nprint('written')"),),
        is_defended=lambda result: result.status == "nonzero_exit" and "File too large" in result.stderr,
        is_real=_prints("written\n"),
    ),
    Attack(  # many files under the size limit: the private home (its own tmpfs, charged to the job) runs out
        name="fill_the_home_filesystem",
        steps=(
            _program("""
                for number in range(160):
                    open(f"f{number}", "wb").write(b"x" * ((1 << 20) - 1))
                print("filled")
            """),
        ),
        is_defended=lambda result: result.status in ("oom", "nonzero_exit") and "filled" not in result.stdout,
        is_real=_prints("filled\n"),
    ),
    Attack(  # a double-forked, setsid daemon that ignores every catchable signal; it writes its pid for the check
        name="daemon_survives_the_job",
        steps=(
            _program("""
                import signal, time
                if os.fork() == 0:
                    os.setsid()
                    if os.fork() == 0:
                        for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                            signal.signal(number, signal.SIG_IGN)
                        devnull = os.open("/dev/null", os.O_RDWR)
                        for fd in (0, 1, 2):
                            os.dup2(devnull, fd)
                        os.execvp("sleep", ["sleep", H["sleep"]])  # ignored signals stay ignored
                    os._exit(0)
                time.sleep(0.2)
                print("started")
            """),
            _program("""
                found = []
                for pid in filter(str.isdigit, os.listdir("/proc")):
                    try:
                        if H["sleep"].encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                            found.append(pid)
                    except OSError:
                        pass
                print(len(found))
            """),
        ),
        is_defended=_prints("0\n"),
        is_real=_prints("1\n"),
    ),
]

ATTACKS = [
    *SECCOMP_ATTACKS,
    *STATUS_ATTACKS,
    *ABSTENTION_ATTACKS,
    *WARM_STATE_ATTACKS,
    *HOST_ATTACKS,
    *PROC_ATTACKS,
    *RESOURCE_ATTACKS,
]
