"""One cold execution, from its fresh sandbox to its cleanup: `Launch`.

A Launch is prepared, started once, finished once. Preparing makes the run dir, the work dir and the cgroup;
for bwrap it also spawns the whole sandbox, which sets itself up (namespaces, mounts, cgroups joined, uid
dropped) and then blocks right before the program. Starting writes the input files, stdin and the program's
argv, and lets it go. Finishing collects the output, decides the status, and guarantees that nothing outlives the
execution: every process is killed through the cgroup (which double-forked daemons cannot leave), the cgroup is
removed, the run dir deleted.

Preparing ahead is what makes a cold execution cheap: `Sandbox` prepares the next sandbox while the current
program runs, so namespace and mount setup, cgroup migration and the uid drop are off the critical path. A
prepared sandbox has run nothing and serves exactly one execution: it is as fresh as one made on the spot.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping

from sharpen.environments.sandbox.backends import (
    READY_MARKER,
    SANDBOX_ENV,
    SANDBOX_GID,
    SANDBOX_UID,
    command_file_text,
    with_prelude,
)
from sharpen.environments.sandbox.capture import DRAIN_SECONDS, Captured, collect
from sharpen.environments.sandbox.cgroups import JobCgroup
from sharpen.environments.sandbox.execution import ExecutionPlan, build_result, fill_memfd, memfd, write_files
from sharpen.environments.sandbox.result import ExecutionResult, ProcessOutcome

_names = itertools.count(1)


class Launch:
    """One execution's sandbox. Never raises for a failure of the sandbox: that becomes the result's status."""

    def __init__(self, plan: ExecutionPlan) -> None:
        self.plan = plan
        self.name = f"{os.getpid()}-{next(_names)}"
        self.run_dir = plan.runs_dir / self.name
        self.work_dir = self.run_dir / "work"
        self._command_file = self.run_dir / "command"
        self.cgroup: JobCgroup | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.error = ""
        self._stdin_fd: int | None = None
        self._go_fd: int | None = None
        self._started = time.monotonic()
        try:
            self._prepare()
        except OSError as error:  # the host refused something (cgroup, fork, memory): the sandbox's failure
            self.error = f"sandbox setup failed: {error}"

    def _prepare(self) -> None:
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
            )
        self._stdin_fd = memfd("stdin", b"")
        if self.plan.backend.can_prepare:
            self._command_file.write_text("exit 0\n")  # released without a program, the shim runs nothing
            self._command_file.chmod(0o644)
            self._spawn(None)

    def _spawn(self, argv: list[str] | None) -> None:
        """Start the backend's chain: blocked before the program (``argv`` None) or running ``argv`` at once."""
        backend, fds = self.plan.backend, []
        try:
            seccomp_fd = None
            if backend.seccomp_program is not None:
                seccomp_fd = memfd("seccomp", backend.seccomp_program)
                fds.append(seccomp_fd)
            limits = self.plan.limits
            if argv is None:
                block_fd, self._go_fd = os.pipe()
                fds.append(block_fd)
                command = backend.prepared_command(
                    work_dir=self.work_dir,
                    command_file=self._command_file,
                    limits=limits,
                    seccomp_fd=seccomp_fd,
                    block_fd=block_fd,
                )
            else:
                command = backend.command(argv, work_dir=self.work_dir, limits=limits, seccomp_fd=seccomp_fd)
            self.process = subprocess.Popen(
                with_prelude(command, self.cgroup.procs_files if self.cgroup is not None else []),
                stdin=self._stdin_fd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=SANDBOX_ENV,  # never the parent's: it may hold secrets
                cwd=backend.cwd(self.work_dir),
                pass_fds=fds,
                start_new_session=True,  # without a cgroup, the session is how the weak backend finds its processes
            )
        finally:
            for fd in fds:
                os.close(fd)

    def start(self, argv: list[str], *, files: Mapping[str, str | bytes], stdin: bytes) -> None:
        """Hand the program its files, stdin and argv, and let it run (the wall clock starts now)."""
        if not self.error:
            try:
                write_files(self.work_dir, files)
                assert self._stdin_fd is not None
                fill_memfd(self._stdin_fd, stdin)
                if self.process is None:
                    self._spawn(argv)
                else:
                    assert self._go_fd is not None
                    self._command_file.write_text(command_file_text(argv))
                    os.write(self._go_fd, b"go")  # a prepared sandbox that died meanwhile raises BrokenPipeError
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

    def _release(self) -> None:
        """Close the go pipe of a sandbox that will not start its program: one still setting itself up would
        otherwise block on it for good; released, it runs the command file's ``exit 0``."""
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
        exit_code: int | None = returncode if returncode >= 0 else None
        signal_number = -returncode if returncode < 0 else None
        if self.plan.backend.num_helper_processes and exit_code is not None and exit_code > 128:
            signal_number = exit_code - 128  # behind a pid namespace, a shell-style 128 + n
        if captured.is_timed_out or captured.is_output_overflow:
            exit_code = None  # we ended it: it did not exit
        outcome = ProcessOutcome(
            is_started=captured.stdout.is_marker_seen,
            exit_code=exit_code,
            signal=signal_number,
            is_timed_out=captured.is_timed_out,
            is_oom=self.cgroup is not None and self.cgroup.num_oom_kills() > 0,
            is_output_overflow=captured.is_output_overflow,
        )
        stderr = captured.stderr.data.decode(errors="replace").strip()
        if self.error:
            outcome.error = f"{self.error} ({stderr})" if stderr else self.error
        elif captured.is_stuck:
            outcome.error = "the output pipes stayed open after the program ended"
        elif not outcome.is_started and not captured.is_timed_out:
            outcome.error = f"the sandbox failed before the program started: {stderr or f'exit code {returncode}'}"
        return outcome

    def _cleanup(self) -> bool:
        """Close our descriptors, kill what is left, remove the cgroup and the run dir; False if a process
        survived."""
        self._release()
        if self._stdin_fd is not None:
            os.close(self._stdin_fd)
            self._stdin_fd = None
        is_clean = True
        if self.cgroup is not None:
            is_clean = self.cgroup.kill_all()
            self.cgroup.remove()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return is_clean
