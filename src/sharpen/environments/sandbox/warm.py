"""The host side of a warm worker: start one long-lived bwrap sandbox, hand it jobs, read their output.

Owns the worker's process, cgroup and control socket, and turning a job's reply into an ExecutionResult. What
runs inside, and what it protects, is in warm_controller.py; what warm mode gives and does not give is in the
package docstring. A worker runs one job at a time; `SandboxPool` keeps several.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import socket
import subprocess
import time
from collections.abc import Mapping

from sharpen.environments.sandbox.backends import (
    INIT_SOURCE,
    READY_MARKER,
    SANDBOX_ENV,
    SANDBOX_HOME,
    drop_privileges,
    with_prelude,
)
from sharpen.environments.sandbox.bwrap import BwrapBackend
from sharpen.environments.sandbox.capture import DRAIN_SECONDS, collect
from sharpen.environments.sandbox.cgroups import JobCgroup
from sharpen.environments.sandbox.execution import build_result, memfd, pack_files
from sharpen.environments.sandbox.result import ExecutionResult, ProcessOutcome, SandboxUnavailable
from sharpen.environments.sandbox.sandbox import PYTHON_FLAGS, Sandbox

CONTROLLER_SOURCE = INIT_SOURCE
START_SECONDS = 10.0
_GRACE_SECONDS = 2.0
"""The controller enforces the wall clock; the host steps in (and ends the worker) this much later."""


class WarmWorker:
    """One warm sandbox. ``is_broken`` says it must be closed and replaced (it died, or could not clean up)."""

    def __init__(self, sandbox: Sandbox, *, name: str) -> None:
        if not isinstance(sandbox.backend, BwrapBackend):
            raise SandboxUnavailable(f"warm workers need the bwrap backend, this host has {sandbox.backend.name!r}")
        config = sandbox.config
        self._sandbox = sandbox
        self._job_ids = itertools.count(1)
        self.is_broken = False
        self._cgroup: JobCgroup | None = None
        if sandbox.cgroup_dirs:
            self._cgroup = JobCgroup(
                sandbox.cgroup_dirs,
                f"warm-{name}",
                max_pids=config.max_processes + 2,  # bwrap's monitor and the controller
                memory_bytes=config.memory_mb << 20,
                cpu_fraction=config.cpu_fraction,
            )
        self._control, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = sandbox.state_dir / f"warm-{name}.log"
        fds = [worker_end.fileno()]  # then what bwrap reads (see BwrapBackend.bwrap_args)
        try:
            self._process = self._start(sandbox.backend, fds, name=name)
        except BaseException:
            self._control.close()
            if self._cgroup is not None:
                self._cgroup.remove()
            raise
        finally:
            worker_end.close()
            for fd in fds[1:]:
                os.close(fd)
        self._wait_ready()

    @property
    def is_alive(self) -> bool:
        return self._process.poll() is None

    def _start(self, backend: BwrapBackend, fds: list[int], *, name: str) -> subprocess.Popen[bytes]:
        config, limits = self._sandbox.config, self._sandbox.limits
        settings = {
            "fd": fds[0],
            "home": SANDBOX_HOME,
            "marker": READY_MARKER.decode("latin-1"),
            "wall_seconds": config.wall_seconds,
            **limits.settings(),
        }
        bwrap = backend.bwrap_args(fds)
        program = [config.python_executable, *PYTHON_FLAGS, "-c", CONTROLLER_SOURCE, repr(settings)]
        command = [*drop_privileges(), *bwrap, "--", *program]
        with self._log.open("wb") as log:
            return subprocess.Popen(
                with_prelude(command, self._cgroup.procs_files if self._cgroup is not None else []),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=SANDBOX_ENV,
                cwd="/",
                pass_fds=fds,
                start_new_session=True,
            )

    def _wait_ready(self) -> None:
        readable, _, _ = select.select([self._control], [], [], START_SECONDS)
        message = self._control.recv(1 << 16) if readable else b""
        if message != b'{"ready": true}':
            self.close()
            log = self._log.read_text(errors="replace").strip()
            raise SandboxUnavailable(f"a warm worker did not start: {log or 'no message within the start timeout'}")

    def run(
        self, argv: list[str] | None, *, code: str | None, files: Mapping[str, str | bytes], stdin: bytes
    ) -> ExecutionResult:
        """Run one job: ``argv`` executed, or (argv None) ``code`` run as main.py by the worker's interpreter."""
        started = time.monotonic()
        job_id = next(self._job_ids)
        oom_before = self._cgroup.num_oom_kills() if self._cgroup is not None else 0
        stdout_read, stdout_write = os.pipe()
        stderr_read, stderr_write = os.pipe()
        sent = [memfd("job", pack_files(files, code=code)), memfd("stdin", stdin), stdout_write, stderr_write]
        reply: dict[str, object] = {}
        try:
            header = json.dumps({"id": job_id, "argv": argv}).encode()
            socket.send_fds(self._control, [header], sent)
        finally:
            for fd in sent:
                os.close(fd)
        try:
            captured = collect(
                stdout_fd=stdout_read,
                stderr_fd=stderr_read,
                exit_fd=self._control.fileno(),
                deadline=time.monotonic() + self._sandbox.config.wall_seconds + _GRACE_SECONDS,
                max_bytes=self._sandbox.config.max_output_bytes,
                marker=READY_MARKER,
                on_exit=lambda: reply.update(self._receive(job_id)),
                on_deadline=self._kill,
                on_overflow=lambda: self._abort(job_id),
            )
        finally:
            os.close(stdout_read)
            os.close(stderr_read)
        outcome = self._outcome(
            reply, captured.stdout.is_marker_seen, is_timed_out=captured.is_timed_out, oom_before=oom_before
        )
        outcome.is_output_overflow = captured.is_output_overflow
        if captured.is_stuck:  # the job's processes are dead: descriptors it left in flight (SCM_RIGHTS) hold them
            self.is_broken = True
            outcome.error = outcome.error or "the job's output stayed open after it ended (descriptors in flight)"
        return build_result(
            outcome,
            captured,
            backend=self._sandbox.backend.name,
            wall_limit=self._sandbox.config.wall_seconds,
            wall_seconds=time.monotonic() - started,
        )

    def _abort(self, job_id: int) -> None:
        self._control.send(json.dumps({"abort": job_id}).encode())

    def _receive(self, job_id: int) -> dict[str, object]:
        message = self._control.recv(1 << 16)
        reply = json.loads(message) if message else {}
        if not isinstance(reply, dict) or reply.get("id") != job_id:
            return {}  # the worker died (or is not making sense): the job's fate is unknown
        return reply

    def _outcome(
        self, reply: dict[str, object], is_started: bool, *, is_timed_out: bool, oom_before: int
    ) -> ProcessOutcome:
        is_oom = self._cgroup is not None and self._cgroup.num_oom_kills() > oom_before
        if not reply:  # the worker died: by our hand at the deadline, by the oom killer, or of its own
            self.is_broken = True
            error = "" if is_oom or is_timed_out else "the warm worker died during the job"
            return ProcessOutcome(is_started=is_started, is_timed_out=is_timed_out, is_oom=is_oom, error=error)
        if reply.get("clean") is not True:
            self.is_broken = True  # leftovers of this job could reach the next one
        exit_code = reply.get("exit_code")
        exit_code = exit_code if isinstance(exit_code, int) else None
        return ProcessOutcome(
            is_started=is_started,
            exit_code=exit_code if exit_code is None or exit_code >= 0 else None,
            signal=-exit_code if exit_code is not None and exit_code < 0 else None,
            is_timed_out=reply.get("timed_out") is True or is_timed_out,
            is_oom=is_oom,
        )

    def _kill(self) -> None:
        """End the worker: its controller first, so that bwrap's monitor reaps it instead of the host's init."""
        self.is_broken = True
        if self._cgroup is not None:
            self._cgroup.kill_all(spare=self._process.pid)
        try:
            self._process.wait(timeout=DRAIN_SECONDS)
        except subprocess.TimeoutExpired:
            self._process.kill()

    def close(self) -> None:
        self._control.close()  # the controller exits on end-of-file, and its namespace with it
        try:
            self._process.wait(timeout=DRAIN_SECONDS)
        except subprocess.TimeoutExpired:
            self._kill()
            self._process.wait()
        if self._cgroup is not None:
            self._cgroup.kill_all()
            self._cgroup.remove()
