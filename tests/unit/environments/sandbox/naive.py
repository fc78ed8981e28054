"""The unprotected path the red-team attacks are shown real against: a bare subprocess as the test's own user
(root in CI), in a host directory, with the host's environment, network, /proc and filesystems, no seccomp, no
cgroups, no rlimits, and the sandbox's status rules from before the hardening (the program's exit code behind a
shell as pid 1, 128 + n read as signal n, a signal named by ``signal.Signals``, output held open after the exit a
sandbox error). Between the steps of an attack it does what the old warm reset did: empties the home and the temp
dir, and leaves the directories themselves as the job made them.

Its only bounds are the attacks' own, and the wall clock: nothing here must run an attack that could harm the
host (see ``Attack.no_naive``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from sharpen.environments.sandbox.capture import Captured, collect

_WALL_SECONDS = 10.0
_MAX_BYTES = 8 << 20
_SHELL_SHIM = '"$@"; exit $?'  # the old init: a shell that runs the program as its child


@dataclass(kw_only=True, slots=True)
class NaiveResult:
    status: str
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    detail: str = ""


def run_naive(steps: tuple[str, ...], *, stdin: str, base: Path, sleep_token: str) -> NaiveResult:
    """Run ``steps`` one after another in one host directory under ``base`` (beside other executions' dirs)."""
    home, tmp = base / f"exec-{len(list(base.iterdir()))}", base / "tmp"
    home.mkdir()
    tmp.mkdir(exist_ok=True)
    (base / "other-execution").mkdir(exist_ok=True)
    try:
        result = NaiveResult(status="not run")
        for step in steps:
            _empty(home)
            _empty(tmp)
            (home / "main.py").write_text(step)
            result = _run_one(home, tmp, stdin)
        return result
    finally:
        _kill_sleepers(sleep_token)
        for directory in (home, tmp):
            with contextlib.suppress(OSError):
                os.chmod(directory, 0o755)
        shutil.rmtree(home, ignore_errors=True)


def _run_one(home: Path, tmp: Path, stdin: str) -> NaiveResult:
    command = ["/bin/sh", "-c", _SHELL_SHIM, "sh", "/usr/bin/python3", "-E", "-s", "-S", "-B", "main.py"]
    process = subprocess.Popen(
        command,
        cwd=home,
        env={**os.environ, "TMPDIR": str(tmp)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    process.stdin.write(stdin.encode())
    process.stdin.close()
    pidfd = os.pidfd_open(process.pid)

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    try:
        captured = collect(
            stdout_fd=process.stdout.fileno(),
            stderr_fd=process.stderr.fileno(),
            exit_fd=pidfd,
            deadline=time.monotonic() + _WALL_SECONDS,
            max_bytes=_MAX_BYTES,
            marker=b"",
            on_exit=lambda: None,  # reaped below
            on_deadline=kill,
            on_overflow=lambda: None,
        )
    finally:
        kill()
        process.wait()
        os.close(pidfd)
        process.stdout.close()
        process.stderr.close()
    return _old_rules(process.returncode, captured)


def _old_rules(returncode: int, captured: Captured) -> NaiveResult:
    """The sandbox's classification before the hardening, on the facts it had."""
    stdout, stderr = (stream.data.decode(errors="replace") for stream in (captured.stdout, captured.stderr))
    exit_code = returncode if returncode >= 0 else None
    signal_number = -returncode if returncode < 0 else None
    if exit_code is not None and exit_code > 128:
        signal_number = exit_code - 128  # behind a pid namespace, a shell-style 128 + n
    result = NaiveResult(status="", exit_code=exit_code, signal=signal_number, stdout=stdout, stderr=stderr)
    if captured.is_timed_out:
        result.status = "timeout"
    elif captured.is_stuck:
        result.status, result.detail = "sandbox_error", "the output pipes stayed open after the program ended"
    elif signal_number == signal.SIGXCPU:
        result.status = "timeout"
    elif signal_number is not None:
        try:
            result.status, result.detail = "killed", f"ended by signal {signal.Signals(signal_number).name}"
        except ValueError as error:  # the host-side runner would have crashed here
            result.status, result.detail = "crashed", str(error)
    else:
        result.status = "ok" if exit_code == 0 else "nonzero_exit"
    return result


def _empty(directory: Path) -> None:
    """The old reset: remove what is inside; the directory's own mode, attributes and times stay."""
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _kill_sleepers(token: str) -> None:
    """Daemons the attacks left on the host (they exec ``sleep <token>``)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\0" + token.encode() + b"\0":
                os.kill(int(pid), signal.SIGKILL)
