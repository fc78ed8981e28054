"""The init of every sandbox: pid 1 of a warm worker's long-lived bwrap sandbox, forking one child per job, and
(``"once"`` in its settings) of a cold execution's sandbox, running exactly one.

It runs inside the sandbox under the system Python with the standard library only: warm.py and launch.py pass
this file's text to ``python -c``; sharpen never imports it. Trusted code sharing a sandbox with untrusted jobs,
so it keeps what jobs could abuse out of their reach:

- It is pid 1 of the namespace, and the kernel drops signals to pid 1 that it has no handler for, sent from
  inside the namespace: a job cannot kill or interrupt it (its SIGINT handler is removed for that reason).
- It is not dumpable: jobs of the same uid cannot open /proc/1/mem or /proc/1/fd, nor ptrace it (the seccomp
  filter denies ptrace anyway). The control socket is closed in each job before any job code runs.
- It never reads a job's files, code, stdin or output: they travel in descriptors from the host straight to the
  job (a memfd of files and code, a memfd of stdin, the host's two output pipes). A job forked from it finds none
  of another job's data in its memory (only earlier jobs' argv, which the requests carry).
- It waits for the job with waitpid and reports the real wait status (exit code, or the signal: any number) on a
  channel no job holds, so an ``exit(137)`` can never read as a SIGKILL. It reaps orphans as they end.
- After each job, ``kill(-1, SIGKILL)`` from pid 1 kills every other process of the namespace (the job's tree,
  background children, double-forked daemons), then it reaps them, empties /home/sandbox and /tmp and puts the
  two directories back as they were (mode, extended attributes, access and modification times). A job that left
  what it cannot undo (an entry it cannot remove, a socket still alive in the kernel) makes it reply "not clean",
  and the host replaces the worker.

Once mode (a cold execution, launch.py): it blocks on a "go" pipe until the host has written the job's files and
stdin (the sandbox is prepared before the program is known), reads the argv from that pipe (end-of-file without
one: released unused, it exits), runs the job as above on its own stdin, stdout and stderr, writes the reply to
a status pipe and exits, and the kernel ends the namespace. With ``"exec"`` (the weak backend, no pid namespace:
it is not pid 1 and a job could signal it) it becomes the program instead, and the host reads the status itself.

Protocol on the control socket (SOCK_SEQPACKET, JSON): it sends {"ready": true} once; the host sends {"id",
"argv"} with four descriptors and receives {"id", "exit_code", "timed_out", "clean"} (exit_code negative: killed
by that signal); {"abort": id} ends a job.
"""

from __future__ import annotations

import ctypes
import os
import resource
import select
import signal
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import socket

# json, socket, traceback and types are imported where a warm worker needs them: a cold execution's init starts
# once per execution, and every import is CPU time of each one (json and base64 alone cost ~5 ms of CPU here). The
# host's settings, argv and payload are Python literals and length-prefixed bytes instead; the status reply is
# written as JSON text by hand.

_PR_SET_DUMPABLE = 4
_SOCKET_COUNTS = ("/proc/net/sockstat", "/proc/net/sockstat6")
"""Per-network-namespace socket counts (cheap, unlike /proc/net/tcp, which walks the host's whole hash table)."""
_wakeup: list[int] = []
"""The read end of the pipe SIGCHLD writes to (signal.set_wakeup_fd): a child ended, reap."""


def main() -> None:
    settings = eval(sys.argv[1], {"__builtins__": {}})  # a dict literal the host wrote (repr): trusted data
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    wakeup_read, wakeup_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, lambda number, frame: None)
    signal.set_wakeup_fd(wakeup_write)
    _wakeup.append(wakeup_read)
    if settings.get("once"):
        _run_once(settings)
        return
    import json
    import socket
    import traceback  # noqa: F401  (loaded once here, for every Python job's fork: see _run_python)
    import types  # noqa: F401

    control = socket.socket(fileno=settings["fd"])
    settings["dirs"] = {path: _snapshot(path) for path in (settings["home"], "/tmp")}
    control.send(b'{"ready": true}')
    while True:
        message, fds, _, _ = socket.recv_fds(control, 1 << 16, 4)
        if not message:
            return  # the host closed the socket: the worker ends, and with it the namespace
        request = json.loads(message)
        if "abort" in request:  # for a job that has already ended
            continue
        reply = _run_job(request, fds, control, settings)
        _kill_all()
        reply["clean"] = _reset(settings["dirs"]) and not _sockets_left()
        control.send(json.dumps(reply).encode())


def _run_once(settings: dict) -> None:
    """One cold execution: wait for the host's go (the argv), run the job, report its status, exit."""
    for fd in (settings["go_fd"], settings["payload_fd"], settings.get("status_fd")):
        if fd is not None:
            os.set_inheritable(fd, False)  # the program never holds them
    chunks = []
    while chunk := os.read(settings["go_fd"], 1 << 16):
        chunks.append(chunk)
    if not chunks:
        return  # released without a program
    request = {"id": 0, "argv": eval(b"".join(chunks).decode(), {"__builtins__": {}})}  # the host's repr of a list
    fds = [settings["payload_fd"], os.dup(0), os.dup(1), os.dup(2)]
    if settings.get("exec"):
        _job(request, fds, None, settings)  # never returns
    reply = _run_job(request, fds, None, settings)
    exit_code = "null" if reply["exit_code"] is None else str(int(reply["exit_code"]))
    timed_out = "true" if reply["timed_out"] else "false"
    os.write(settings["status_fd"], f'{{"id": 0, "exit_code": {exit_code}, "timed_out": {timed_out}}}'.encode())
    os._exit(0)  # and the kernel kills what is left of the namespace


def _run_job(request: dict, fds: list[int], control: socket.socket | None, settings: dict) -> dict:
    pid = os.fork()
    if pid == 0:
        _job(request, fds, control, settings)
    for fd in fds:
        os.close(fd)
    deadline = time.monotonic() + settings["wall_seconds"]
    status, is_timed_out, is_aborted = None, False, False
    watched = [_wakeup[0]] + ([control] if control is not None else [])
    while status is None and not is_aborted:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            is_timed_out = True
            break
        readable, _, _ = select.select(watched, [], [], remaining)
        if control is not None and control in readable:
            message = control.recv(1 << 16)
            if not message:
                _kill_all()
                os._exit(0)
            import json  # a warm worker only: it imported json at start

            is_aborted = json.loads(message).get("abort") == request["id"]
        status = _reap(pid)
    exit_code = None if status is None else os.waitstatus_to_exitcode(status)
    return {"id": request["id"], "exit_code": exit_code, "timed_out": is_timed_out}


def _reap(job_pid: int) -> int | None:
    """Reap every child that has ended (orphans come to pid 1 too); the job's wait status once it has ended."""
    try:
        while os.read(_wakeup[0], 1 << 12):
            pass
    except BlockingIOError:
        pass
    status = None
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == job_pid:
            status = wait_status


def _kill_all() -> None:
    """Kill and reap every process of the namespace but this one (kill(-1) spares the caller). Only as pid 1 of
    a pid namespace: anywhere else kill(-1) would reach every process of the uid."""
    assert os.getpid() == 1
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break


def _snapshot(directory: str) -> tuple[int, int, int]:
    """What a job may change about a directory itself and `_reset` puts back: mode, atime, mtime."""
    info = os.stat(directory)
    return info.st_mode, info.st_atime_ns, info.st_mtime_ns


def _reset(dirs: dict[str, tuple[int, int, int]]) -> bool:
    """Empty each directory and put it back as `_snapshot` saw it, without extended attributes; False if any
    of it did not hold (the host then replaces this worker)."""
    try:
        for directory, (mode, atime_ns, mtime_ns) in dirs.items():
            if not _empty(directory):
                return False
            for name in os.listxattr(directory):
                os.removexattr(directory, name)
            os.chmod(directory, mode)
            os.utime(directory, ns=(atime_ns, mtime_ns))
            if _snapshot(directory) != (mode, atime_ns, mtime_ns) or os.listxattr(directory):
                return False
    except OSError:
        return False
    return True


def _sockets_left() -> bool:
    """A socket of the sandbox's network namespace outlived every process: one kept in flight (SCM_RIGHTS) by a
    descriptor cycle, or a TCP connection in TIME_WAIT. Either is state a later job could find."""
    with open("/proc/net/unix") as file:
        if len(file.readlines()) > 1:  # a header line, then one line per socket
            return True
    for path in _SOCKET_COUNTS:
        with open(path) as file:
            for line in file:  # "TCP: inuse 0 orphan 0 tw 0 alloc 1 mem 0": alloc and mem are not sockets
                words = line.split()
                counts = dict(zip(words[1::2], words[2::2], strict=False))
                if any(counts.get(key, "0") != "0" for key in ("used", "inuse", "orphan", "tw")):
                    return True
    return False


def _empty(directory: str) -> bool:
    """Remove everything in ``directory`` (a job may have left read-only dirs: chmod first). False if it cannot."""

    def remove(path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
            for name in os.listdir(path):
                remove(os.path.join(path, name))
            os.rmdir(path)
        else:
            os.unlink(path)

    try:
        for name in os.listdir(directory):
            remove(os.path.join(directory, name))
    except (OSError, RecursionError):
        return False  # the host then replaces this worker
    return True


def _job(request: dict, fds: list[int], control: socket.socket | None, settings: dict) -> None:
    """The forked child: set up the job, write the ready marker, run it. Never returns."""
    try:
        if control is not None:
            control.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        payload_fd, stdin_fd, stdout_fd, stderr_fd = fds
        with open(payload_fd, "rb") as payload_file:
            payload = _unpack(payload_file.read())
        os.chdir(settings["home"])
        for name, data in payload["files"].items():
            os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
            with open(name, "wb") as file:
                file.write(data)
        for target, fd in ((0, stdin_fd), (1, stdout_fd), (2, stderr_fd)):
            os.dup2(fd, target)
        os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        _set_limits(settings)
        os.write(1, settings["marker"].encode("latin-1"))
    except BaseException:
        os._exit(125)  # no marker: the host reports a sandbox error
    if request["argv"]:
        for number in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them; a program expects the defaults
            signal.signal(number, signal.SIG_DFL)
        try:
            os.execvp(request["argv"][0], request["argv"])
        except OSError as error:
            os.write(2, f"{request['argv'][0]}: {error.strerror}\n".encode())
            os._exit(127)
    _run_python(payload["code"], settings["home"])


def _unpack(data: bytes) -> dict:
    """The host's payload (execution.pack_files): {"files": {name: bytes}, "code": str or None}."""
    view, files = memoryview(data), {}
    count, at = int.from_bytes(view[:4], "big"), 4
    for _ in range(count):
        size = int.from_bytes(view[at : at + 4], "big")
        name = bytes(view[at + 4 : at + 4 + size]).decode()
        at += 4 + size
        size = int.from_bytes(view[at : at + 8], "big")
        files[name] = bytes(view[at + 8 : at + 8 + size])
        at += 8 + size
    has_code, size = view[at], int.from_bytes(view[at + 1 : at + 9], "big")
    code = bytes(view[at + 9 : at + 9 + size]).decode() if has_code else None
    return {"files": files, "code": code}


def _set_limits(settings: dict) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (settings["cpu_seconds"], settings["cpu_seconds"] + 1))
    for limit, key in (
        (resource.RLIMIT_AS, "address_space_bytes"),
        (resource.RLIMIT_FSIZE, "file_size_bytes"),
        (resource.RLIMIT_NOFILE, "max_open_files"),
    ):
        resource.setrlimit(limit, (settings[key], settings[key]))


def _run_python(code: str, home: str) -> None:
    """Run ``code`` as ``python main.py`` would, in this already-started interpreter, then exit like it."""
    import traceback
    import types

    path = os.path.join(home, "main.py")
    module = types.ModuleType("__main__")
    module.__file__ = path
    sys.modules["__main__"] = module
    sys.argv = ["main.py"]
    sys.path[0] = home
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        exec(compile(code, path, "exec"), module.__dict__)
        status = 0
    except SystemExit as exit_request:
        status = _exit_status(exit_request)
    except BaseException as error:
        traceback.print_exception(type(error), error, error.__traceback__.tb_next if error.__traceback__ else None)
        status = 1
    os._exit(_finish(status))


def _exit_status(exit_request: SystemExit) -> int:
    if exit_request.code is None:
        return 0
    if isinstance(exit_request.code, int):
        return exit_request.code & 0xFF
    print(exit_request.code, file=sys.stderr)
    return 1


def _finish(status: int) -> int:
    """What the interpreter does at exit: join non-daemon threads, run atexit handlers, flush the streams."""
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = 120
    return status


if __name__ == "__main__":
    main()
