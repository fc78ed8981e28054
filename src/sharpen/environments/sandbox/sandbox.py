"""`Sandbox`: run untrusted programs, or Python code, one fresh sandbox per execution ("cold").

Owns the resources one Sandbox holds for its lifetime (a state dir with the sandbox's /etc files and the run
dirs, a parent cgroup per controller, the chosen backend, the sandboxes prepared ahead) and their release in
`close`. Each `run` is independent and thread-safe; `SandboxPool` (pool.py) adds bounded concurrency, asyncio and
warm workers.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import TypeVar

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox.backends import Backend, Limits, ProcessBackend, UnshareBackend
from sharpen.environments.sandbox.bwrap import BwrapBackend
from sharpen.environments.sandbox.cgroups import (
    PREFIX,
    ControllerDir,
    close_controller_dirs,
    is_orphaned,
    open_controller_dirs,
    owned_name,
)
from sharpen.environments.sandbox.execution import ExecutionPlan, check_file_names
from sharpen.environments.sandbox.launch import Launch
from sharpen.environments.sandbox.probe import PROBE_ARGV, host_gaps, select_backend
from sharpen.environments.sandbox.result import ExecutionResult, IsolationReport
from sharpen.environments.sandbox.session import SandboxSession

T = TypeVar("T")
NO_FILES: Mapping[str, str | bytes] = MappingProxyType({})
PYTHON_FLAGS = ("-E", "-s", "-S", "-B")
"""No PYTHON* variables, no user or site directories, no bytecode files. Not -I: its -P would drop the script's
directory from sys.path, and code commonly imports its sibling files (a solution and its tests)."""


class Sandbox:
    """Runs programs in a fresh sandbox each: ``run(argv)`` or ``run_python(code)``, with ``files`` written into
    the work dir (the cwd) and ``stdin`` fed to the program. Probes the backends at construction (see probe.py)
    and raises SandboxUnavailable when none gives what the config accepts; ``report`` tells what it got.

    Thread-safe; not fork-safe (create it in the process that uses it). Close it (or use ``with``): it holds a
    prepared sandbox, a thread, cgroups and a state dir until then."""

    report: IsolationReport
    """The chosen backend, its isolation level, and each protection this host could not give."""
    backend: Backend

    def __init__(self, config: SandboxConfig) -> None:
        if config.backend == "remote":
            raise ValueError('sandbox.backend = "remote" runs on replicas: build a RemoteSandbox (remote.py) for it')
        self.config = config
        self.cgroup_dirs: list[ControllerDir] = []
        self._prepared: list[Launch] = []
        self._prepared_sessions: list[Launch] = []
        self._lock = threading.Lock()
        self._is_closed = False
        # The thread that starts every sandbox meant to outlive the call that made it (prepared ones, warm
        # workers): --die-with-parent kills a sandbox when the *thread* that started it ends, so that thread must
        # live as long as the Sandbox. It also sets up the next sandbox while the caller's thread waits in poll.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawner")
        work_root = _work_root(config)
        for orphan in Path(work_root).glob(f"{PREFIX}*"):  # left by a Sandbox whose process was killed
            if is_orphaned(orphan.name):
                shutil.rmtree(orphan, ignore_errors=True)
        self.state_dir = Path(tempfile.mkdtemp(prefix=owned_name(""), dir=work_root))
        try:
            self.state_dir.chmod(0o711)  # the weak backend's uid must traverse it to reach its work dir, nothing more
            (self.state_dir / "runs").mkdir(mode=0o711)
            self.cgroup_dirs = open_controller_dirs(owned_name(uuid.uuid4().hex[:12]))
            controllers = {d.controller for d in self.cgroup_dirs}
            self.limits = Limits.from_config(config, has_memory_cgroup="memory" in controllers)
            candidates = [
                BwrapBackend(config),
                UnshareBackend(config),
                ProcessBackend(),
            ]
            gaps = host_gaps(
                has_pids_cgroup="pids" in controllers,
                has_memory_cgroup="memory" in controllers,
                has_cpu_cgroup="cpu" in controllers,
            )
            self.backend, self.report = select_backend(config, candidates, self._probe, host_missing=gaps)
        except BaseException:
            self.close()
            raise
        self._plan = self.plan_for(self.backend)

    def plan_for(self, backend: Backend) -> ExecutionPlan:
        return ExecutionPlan(
            backend=backend,
            limits=self.limits,
            cgroup_dirs=self.cgroup_dirs,
            runs_dir=self.state_dir / "runs",
            cpu_fraction=self.config.cpu_fraction,
            python_executable=self.config.python_executable,
            wall_seconds=self.config.wall_seconds,
            max_processes=self.config.max_processes,
            memory_bytes=self.config.memory_mb << 20,
            max_output_bytes=self.config.max_output_bytes,
        )

    def _probe(self, backend: Backend) -> ExecutionResult:
        launch = Launch(self.plan_for(backend))
        launch.start(PROBE_ARGV, files=NO_FILES, stdin=b"")
        return launch.finish()

    def run(
        self, argv: Sequence[str], *, files: Mapping[str, str | bytes] = NO_FILES, stdin: str | bytes = ""
    ) -> ExecutionResult:
        """Run ``argv`` (searched on the sandbox's PATH) with ``files`` in its fresh work dir."""
        if not argv:
            raise ValueError("argv is empty: give the program to run")
        check_file_names(files)
        with self._lock:
            launch = self._prepared.pop() if self._prepared else None
        launch = launch or Launch(self._plan)
        try:
            launch.start(list(argv), files=files, stdin=stdin.encode() if isinstance(stdin, str) else stdin)
        except BaseException:  # not a sandbox failure (those are results) but e.g. a file of the wrong type
            launch.discard()
            raise
        if self.config.prepare_ahead and self.backend.can_prepare:
            self._spawner.submit(self._prepare_one)  # the next execution's sandbox, while this program runs
        return launch.finish()

    def _prepare_one(self, *, is_session: bool = False) -> None:
        prepared = self._prepared_sessions if is_session else self._prepared
        with self._lock:
            if self._is_closed or len(prepared) >= self.config.max_concurrency:
                return
        launch = Launch(self._plan, is_session=is_session)
        with self._lock:
            prepared.append(launch)

    def open_session(self, argv: Sequence[str], *, files: Mapping[str, str | bytes] = NO_FILES) -> SandboxSession:
        """Start ``argv`` in a fresh sandbox, as `run` does, and return a session to exchange lines with it on its
        stdin and stdout while it runs (see session.py); its result comes from ``session.close()``."""
        if not argv:
            raise ValueError("argv is empty: give the program to run")
        check_file_names(files)
        with self._lock:
            launch = self._prepared_sessions.pop() if self._prepared_sessions else None
        launch = launch or Launch(self._plan, is_session=True)
        try:
            launch.start(list(argv), files=files, stdin=b"")
        except BaseException:
            launch.discard()
            raise
        if self.config.prepare_ahead and self.backend.can_prepare:
            self._spawner.submit(self._prepare_one, is_session=True)
        return SandboxSession(launch)

    def open_python_session(self, code: str, *, files: Mapping[str, str | bytes] = NO_FILES) -> SandboxSession:
        """`open_session` of ``code`` run as ``main.py`` by the system Python, like `run_python`."""
        if "main.py" in files:
            raise ValueError("files may not contain 'main.py': open_python_session writes the code there")
        argv = [self.config.python_executable, *PYTHON_FLAGS, "main.py"]
        return self.open_session(argv, files={**files, "main.py": code})

    def in_spawner_thread(self, start: Callable[[], T]) -> T:
        """Run ``start``, which starts a long-lived sandbox, in the Sandbox's spawner thread (see __init__)."""
        return self._spawner.submit(start).result()

    def run_python(
        self, code: str, *, files: Mapping[str, str | bytes] = NO_FILES, stdin: str | bytes = ""
    ) -> ExecutionResult:
        """Run ``code`` as ``main.py`` with the system Python (config.python_executable), not the project's."""
        if "main.py" in files:
            raise ValueError("files may not contain 'main.py': run_python writes the code there")
        argv = [self.config.python_executable, *PYTHON_FLAGS, "main.py"]
        return self.run(argv, files={**files, "main.py": code}, stdin=stdin)

    def close(self) -> None:
        """Remove the prepared sandboxes, the cgroups and the state dir. Runs in other threads must have ended."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
        self._spawner.submit(self._discard_prepared).result()  # while their parent thread still lives
        self._spawner.shutdown(wait=True)
        close_controller_dirs(self.cgroup_dirs)
        self.cgroup_dirs = []
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def _discard_prepared(self) -> None:
        for launch in [*self._prepared, *self._prepared_sessions]:
            launch.discard()
        self._prepared, self._prepared_sessions = [], []

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _work_root(config: SandboxConfig) -> str:
    if config.work_root is not None:
        return config.work_root
    # tmpfs: what the code writes is charged to its memory cgroup and can never fill a disk
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
