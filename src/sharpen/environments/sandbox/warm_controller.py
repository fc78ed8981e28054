"""The controller of a warm worker: pid 1 of one long-lived bwrap sandbox, forking one child per job.

It runs inside the sandbox under the system Python with the standard library only: warm.py passes this file's
text to ``python -c``; sharpen never imports it. Trusted code sharing a sandbox with untrusted jobs, so it keeps
what jobs could abuse out of their reach:

- It is pid 1 of the namespace, and the kernel drops signals to pid 1 that it has no handler for, sent from
  inside the namespace: a job cannot kill or interrupt it (its SIGINT handler is removed for that reason).
- It is not dumpable: jobs of the same uid cannot open /proc/1/mem or /proc/1/fd, nor ptrace it (the seccomp
  filter denies ptrace anyway). The control socket is closed in each job before any job code runs.
- It never reads a job's files, code, stdin or output: they travel in descriptors from the host straight to the
  job (a memfd of files and code, a memfd of stdin, the host's two output pipes). A job forked from it finds none
  of another job's data in its memory (only earlier jobs' argv, which the requests carry).
- After each job, ``kill(-1, SIGKILL)`` from pid 1 kills every other process of the namespace (the job's tree,
  background children, double-forked daemons), then it reaps them and empties /home/sandbox and /tmp.

Protocol on the control socket (SOCK_SEQPACKET, JSON): it sends {"ready": true} once; the host sends {"id",
"argv"} with four descriptors and receives {"id", "exit_code", "timed_out", "clean"}; {"abort": id} ends a job.
"""

import base64
import ctypes
import json
import os
import resource
import select
import signal
import socket
import sys
import time
import traceback
import types

_PR_SET_DUMPABLE = 4


def main() -> None:
    settings = json.loads(sys.argv[1])
    control = socket.socket(fileno=settings["fd"])
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    control.send(b'{"ready": true}')
    while True:
        message, fds, _, _ = socket.recv_fds(control, 1 << 16, 4)
        if not message:
            return  # the host closed the socket: the worker ends, and with it the namespace
        request = json.loads(message)
        if "abort" in request:  # for a job that has already ended
            continue
        reply = _run_job(request, fds, control, settings)
        control.send(json.dumps(reply).encode())


def _run_job(request: dict, fds: list[int], control: socket.socket, settings: dict) -> dict:
    pid = os.fork()
    if pid == 0:
        _job(request, fds, control, settings)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    deadline = time.monotonic() + settings["wall_seconds"]
    status, is_timed_out, is_aborted = None, False, False
    while status is None and not is_aborted:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            is_timed_out = True
            break
        readable, _, _ = select.select([pidfd, control], [], [], remaining)
        if control in readable:
            message = control.recv(1 << 16)
            if not message:
                _kill_all()
                os._exit(0)
            is_aborted = json.loads(message).get("abort") == request["id"]
        if pidfd in readable:
            status = os.waitpid(pid, 0)[1]
    os.close(pidfd)
    _kill_all()
    is_clean = _empty(settings["home"]) and _empty("/tmp")
    exit_code = None if status is None else os.waitstatus_to_exitcode(status)
    return {"id": request["id"], "exit_code": exit_code, "timed_out": is_timed_out, "clean": is_clean}


def _kill_all() -> None:
    """Kill and reap every process of the namespace but this one (kill(-1) spares the caller)."""
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


def _job(request: dict, fds: list[int], control: socket.socket, settings: dict) -> None:
    """The forked child: set up the job, write the ready marker, run it. Never returns."""
    try:
        control.close()
        payload_fd, stdin_fd, stdout_fd, stderr_fd = fds
        with open(payload_fd, "rb") as payload_file:
            payload = json.loads(payload_file.read())
        os.chdir(settings["home"])
        for name, data in payload["files"].items():
            os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
            with open(name, "wb") as file:
                file.write(base64.b64decode(data))
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
