"""One cold execution, from its fresh sandbox to its cleanup: `Launch`.

A Launch is prepared, started once, finished once. Preparing makes the cgroup and spawns the whole sandbox,
which sets itself up (namespaces, mounts, its private home, cgroups joined, uid dropped) and starts its init,
which then blocks on a "go" pipe. Starting fills the in-memory files the init reads (the input files, stdin) and
writes the program's argv into the go pipe. Finishing collects the output, reads the program's real wait status
from the init's status pipe (never from an exit code, which the program chooses), decides the status, and
guarantees that nothing outlives the execution: every process is killed through the cgroup (which double-forked
daemons cannot leave), the cgroup is removed. Nothing of the execution is on a host filesystem (only the weak
backend, which has no mount namespace, gets a host work dir, removed afterwards).

Preparing ahead is what makes a cold execution cheap: `Sandbox` prepares the next sandbox while the current
program runs, so namespace and mount setup, cgroup migration, the uid drop and the init's interpreter start are
off the critical path. A prepared sandbox has run nothing and serves exactly one execution: it is as fresh as one
made on the spot.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from sharpen.environments.sandbox.backends import (
    READY_MARKER,
    SANDBOX_ENV,
    SANDBOX_GID,
    SANDBOX_UID,
    init_command,
    with_prelude,
)
from sharpen.environments.sandbox.capture import DRAIN_SECONDS, Captured, collect
from sharpen.environments.sandbox.cgroups import JobCgroup
from sharpen.environments.sandbox.execution import ExecutionPlan, build_result, fill_memfd, memfd, pack_files
from sharpen.environments.sandbox.result import ExecutionResult, ProcessOutcome

_names = itertools.count(1)


class Launch:
    """One execution's sandbox. Never raises for a failure of the sandbox: that becomes the result's status.

    ``is_session``: the program's stdin is a pipe whose write end the host keeps (``stdin_write_fd``) instead of
    an in-memory file filled at start, and ``on_stdout`` (set before `finish`) sees its stdout as it arrives."""

    def __init__(self, plan: ExecutionPlan, *, is_session: bool = False) -> None:
        self.plan = plan
        self.is_session = is_session
        self.stdin_write_fd: int | None = None
        self.on_stdout: Callable[[bytes], None] | None = None
        self.name = f"{os.getpid()}-{next(_names)}"
        self.run_dir = plan.runs_dir / self.name
        self.work_dir: Path | None = None if plan.backend.has_private_home else self.run_dir / "work"
        self.cgroup: JobCgroup | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.error = ""
        self._stdin_fd: int | None = None
        self._payload_fd: int | None = None
        self._go_fd: int | None = None
        self._status_fd: int | None = None
        self._started = time.monotonic()
        try:
            self._prepare()
        except OSError as error:  # the host refused something (cgroup, fork, memory): the sandbox's failure
            self.error = f"sandbox setup failed: {error}"

    def _prepare(self) -> None:
        if self.work_dir is not None:  # the weak backend's home on the host
            self.run_dir.mkdir(mode=0o711)  # root's; the sandbox uid may only traverse it
            self.work_dir.mkdir(mode=0o700)
            if os.geteuid() == 0:
                os.chown(self.work_dir, SANDBOX_UID, SANDBOX_GID)
        if self.plan.cgroup_dirs:
            self.cgroup = JobCgroup(
                self.plan.cgroup_dirs,
                self.name,
                max_pids=self.plan.max_processes + self.plan.backend.num_helper_processes,
                memory_bytes=self.plan.memory_bytes,
                cpu_fraction=self.plan.cpu_fraction,
            )
        if self.is_session:
            self._stdin_fd, self.stdin_write_fd = os.pipe()
        else:
            self._stdin_fd = memfd("stdin", b"")
        self._payload_fd = memfd("files", b"")
        self._spawn()

    def _spawn(self) -> None:
        """Start the backend's chain; its init blocks on the go pipe until `start` (or `_release`)."""
        backend, fds = self.plan.backend, []  # fds: passed to the chain, then closed here
        try:
            go_fd, self._go_fd = os.pipe()
            fds.append(go_fd)
            settings: dict[str, object] = {
                "once": True,
                "go_fd": go_fd,
                "payload_fd": self._payload_fd,
                "home": backend.home(self.work_dir),
                "marker": READY_MARKER.decode("latin-1"),
                "wall_seconds": self.plan.wall_seconds,
                **self.plan.limits.settings(),
            }
            if backend.has_pid_namespace:
                self._status_fd, status_fd = os.pipe()
                fds.append(status_fd)
                settings["status_fd"] = status_fd
            else:
                settings["exec"] = True  # no pid namespace to be pid 1 of: the init becomes the program
            init = init_command(self.plan.python_executable, settings)
            command = backend.command(init, work_dir=self.work_dir, fds=fds)
            assert self._payload_fd is not None
            self.process = subprocess.Popen(
                with_prelude(command, self.cgroup.procs_files if self.cgroup is not None else []),
                stdin=self._stdin_fd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=SANDBOX_ENV,  # never the parent's: it may hold secrets
                cwd=backend.cwd(self.work_dir),
                pass_fds=[*fds, self._payload_fd],
                start_new_session=True,  # without a cgroup, the session is how the weak backend finds its processes
            )
            if self.is_session and self._stdin_fd is not None:
                os.close(self._stdin_fd)  # only the program reads it: a write to a dead program then fails at once
                self._stdin_fd = None
        finally:
            for fd in fds:
                os.close(fd)

    def start(self, argv: list[str], *, files: Mapping[str, str | bytes], stdin: bytes) -> None:
        """Hand the program its files, stdin and argv, and let it run (the wall clock starts now)."""
        if not self.error:
            try:
                assert self._payload_fd is not None and self._go_fd is not None
                fill_memfd(self._payload_fd, pack_files(files))
                if not self.is_session:
                    assert self._stdin_fd is not None
                    fill_memfd(self._stdin_fd, stdin)
                go_fd, self._go_fd = self._go_fd, None
                with open(go_fd, "wb") as go:  # a sandbox that died meanwhile raises BrokenPipeError
                    go.write(repr([str(arg) for arg in argv]).encode())  # a list literal, read with no import
            except OSError as error:
                self.error = f"sandbox start failed: {error}"
                self._release()
                self._kill()
        self._started = time.monotonic()

    def finish(self) -> ExecutionResult:
        """Wait for the program (up to the wall clock), then clean up everything and return the result."""
        outcome, captured = ProcessOutcome(is_started=False, error=self.error), None
        try:
            if self.process is not None:
                outcome, captured = self._collect(self.process)
        finally:
            if not self._cleanup():
                outcome.error = "processes of the execution could not be killed"
        return build_result(
            outcome,
            captured,
            backend=self.plan.backend.name,
            wall_limit=self.plan.wall_seconds,
            wall_seconds=time.monotonic() - self._started,
        )

    def discard(self) -> None:
        """Clean up a prepared launch that will never start."""
        self._release()
        if self.process is not None:
            deadline = time.monotonic() + DRAIN_SECONDS
            while self.process.poll() is None and time.monotonic() < deadline:
                self._kill()  # again while the chain is still joining its cgroups or setting up
                time.sleep(0.005)
            self.process.kill()
            self.process.communicate()
        self._cleanup()

    def kill(self) -> None:
        """End the running program now, from any thread (`finish` then returns its result)."""
        if self.process is not None:
            with contextlib.suppress(OSError):  # its cgroup already removed: the execution has just ended anyway
                self._kill()

    def _release(self) -> None:
        """Close the go pipe of a sandbox that will not start its program: its init would otherwise wait on it for
        good; released (end-of-file without an argv), it exits having run nothing."""
        if self._go_fd is not None:
            os.close(self._go_fd)
            self._go_fd = None

    def _kill(self) -> None:
        # Behind a pid namespace our child is a monitor (bwrap, unshare) that reaps the namespace's first process:
        # kill everything else and let it exit, or that process's zombie would be handed to the host's init.
        monitor = self.process.pid if self.process and self.plan.backend.num_helper_processes else None
        if self.cgroup is not None:
            self.cgroup.kill_all(spare=monitor)
        elif self.process is not None:  # a pid namespace dies with its first process; the weak backend has its session
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(self.process.pid, signal.SIGKILL)
        if self.process is not None and monitor is None:
            self.process.kill()

    def _collect(self, process: subprocess.Popen[bytes]) -> tuple[ProcessOutcome, Captured]:
        assert process.stdout is not None and process.stderr is not None
        pidfd = os.pidfd_open(process.pid)

        def on_exit() -> None:
            process.wait()
            self._kill()  # what the program left behind: background children, daemons

        try:
            captured = collect(
                stdout_fd=process.stdout.fileno(),
                stderr_fd=process.stderr.fileno(),
                exit_fd=pidfd,
                deadline=self._started + self.plan.wall_seconds,
                max_bytes=self.plan.max_output_bytes,
                marker=READY_MARKER,
                on_exit=on_exit,
                on_deadline=self._kill,
                on_overflow=self._kill,
                on_stdout=self.on_stdout,
            )
        finally:
            self._kill()
            try:
                process.wait(timeout=DRAIN_SECONDS)
            except subprocess.TimeoutExpired:  # a monitor that does not exit once its namespace is dead
                process.kill()
                process.wait()
            os.close(pidfd)
            process.stdout.close()
            process.stderr.close()
        return self._outcome(process.returncode, captured), captured

    def _outcome(self, returncode: int, captured: Captured) -> ProcessOutcome:
        """The facts of the ended execution. Behind a pid namespace the program's status is the init's report
        (the real wait status: exit(137) is code 137, a SIGKILL is signal 9); our child's own exit code is a
        monitor's, which folds a signal n into 128 + n."""
        reply = self._read_status() if self.plan.backend.has_pid_namespace else {"exit_code": returncode}
        code = reply.get("exit_code") if reply is not None else None
        is_timed_out = captured.is_timed_out or (reply is not None and reply.get("timed_out") is True)
        exit_code = code if isinstance(code, int) and code >= 0 and not is_timed_out else None
        signal_number = -code if isinstance(code, int) and code < 0 else None
        if captured.is_output_overflow:
            exit_code = None  # we ended it: it did not exit
        outcome = ProcessOutcome(
            is_started=captured.stdout.is_marker_seen,
            exit_code=exit_code,
            signal=signal_number,
            is_timed_out=is_timed_out,
            is_oom=self.cgroup is not None and self.cgroup.num_oom_kills() > 0,
            is_output_overflow=captured.is_output_overflow,
        )
        stderr = captured.stderr.data.decode(errors="replace").strip()
        if self.error:
            outcome.error = f"{self.error} ({stderr})" if stderr else self.error
        elif not outcome.is_started:
            outcome.error = f"the sandbox failed before the program started: {stderr or f'exit code {returncode}'}"
        elif captured.is_stuck:  # every process is dead: descriptors it left in flight (SCM_RIGHTS) hold them
            outcome.error = "the program's output stayed open after every process of it ended (descriptors in flight)"
        elif reply is None and not (is_timed_out or outcome.is_oom or outcome.is_output_overflow):
            outcome.error = "the program's status is unknown: the sandbox's init ended without reporting it"
        return outcome

    def _read_status(self) -> dict[str, object] | None:
        """The init's report (see warm_controller.py), or None when it wrote none (it was killed: at the wall
        clock, by the oom killer, or with the whole sandbox)."""
        if self._status_fd is None:
            return None
        os.set_blocking(self._status_fd, False)
        try:
            data = os.read(self._status_fd, 1 << 16)
        except BlockingIOError:
            data = b""
        finally:
            os.close(self._status_fd)
            self._status_fd = None
        try:
            reply = json.loads(data)
        except ValueError:
            return None
        return reply if isinstance(reply, dict) else None

    def _cleanup(self) -> bool:
        """Close our descriptors, kill what is left, remove the cgroup and the run dir; False if a process
        survived."""
        self._release()
        for fd in (self._stdin_fd, self.stdin_write_fd, self._payload_fd, self._status_fd):
            if fd is not None:
                os.close(fd)
        self._stdin_fd = self.stdin_write_fd = self._payload_fd = self._status_fd = None
        is_clean = True
        if self.cgroup is not None:
            is_clean = self.cgroup.kill_all()
            self.cgroup.remove()
        if self.work_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return is_clean
