"""`SandboxPool`: sandboxed executions for asyncio callers, at most ``max_concurrency`` at a time, cold or warm.

Owns the thread pool that runs blocking executions off the event loop, and (warm mode) the set of warm workers:
each job takes an idle worker, and a worker that died or could not clean up after its job is closed and replaced
before the next job uses its slot. It holds one `Sandbox` for the probe, the report and the shared resources.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import queue
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox.execution import check_file_names
from sharpen.environments.sandbox.result import (
    ExecutionResult,
    ExecutionStatus,
    IsolationReport,
    SandboxUnavailable,
)
from sharpen.environments.sandbox.sandbox import NO_FILES, PYTHON_FLAGS, Sandbox
from sharpen.environments.sandbox.warm import WarmWorker


class SandboxPool:
    """``await pool.run(argv, ...)`` / ``await pool.run_python(code, ...)``, the same results as `Sandbox`; with
    ``config.warm_workers``, jobs run in long-lived workers (see the package docstring for what that shares)."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.sandbox = Sandbox(config)
        self.report: IsolationReport = self.sandbox.report
        self._executor = ThreadPoolExecutor(max_workers=config.max_concurrency, thread_name_prefix="sandbox")
        self._slots: queue.SimpleQueue[WarmWorker | None] | None = None
        self._workers: list[WarmWorker] = []
        self._worker_names = itertools.count()
        if config.warm_workers:
            self._slots = queue.SimpleQueue()
            try:
                for _ in range(config.max_concurrency):
                    self._slots.put(self._start_worker())
            except BaseException:
                self.close()
                raise

    async def run(
        self, argv: Sequence[str], *, files: Mapping[str, str | bytes] = NO_FILES, stdin: str | bytes = ""
    ) -> ExecutionResult:
        if not argv:
            raise ValueError("argv is empty: give the program to run")
        return await self._submit(list(argv), None, files, stdin)

    async def run_python(
        self, code: str, *, files: Mapping[str, str | bytes] = NO_FILES, stdin: str | bytes = ""
    ) -> ExecutionResult:
        if "main.py" in files:
            raise ValueError("files may not contain 'main.py': run_python writes the code there")
        return await self._submit(None, code, {**files, "main.py": code}, stdin)

    async def _submit(
        self, argv: list[str] | None, code: str | None, files: Mapping[str, str | bytes], stdin: str | bytes
    ) -> ExecutionResult:
        check_file_names(files)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        job = functools.partial(self._run_blocking, argv, code, files, data)
        return await asyncio.get_running_loop().run_in_executor(self._executor, job)

    def _run_blocking(
        self, argv: list[str] | None, code: str | None, files: Mapping[str, str | bytes], stdin: bytes
    ) -> ExecutionResult:
        if self._slots is None:
            command = argv or [self.config.python_executable, *PYTHON_FLAGS, "main.py"]
            return self.sandbox.run(command, files=files, stdin=stdin)
        worker = self._slots.get()  # never blocks long: there are as many slots as executor threads
        try:
            # A job that never started on a worker that then broke may owe that to an earlier job of the worker:
            # it runs once more, on a fresh worker, so that no job can hand a later one a sandbox_error.
            for _ in range(2):
                if worker is None or worker.is_broken or not worker.is_alive:
                    if worker is not None:
                        worker.close()
                        self._workers.remove(worker)
                        worker = None  # the slot stays empty if no new worker starts
                    worker = self._start_worker()
                result = worker.run(argv, code=code, files=files, stdin=stdin)
                if result.is_program_started or not worker.is_broken:
                    break
            return result
        except (SandboxUnavailable, OSError) as error:  # no worker could start, or it died between jobs
            if worker is not None:
                worker.is_broken = True
            return ExecutionResult(
                status=ExecutionStatus.SANDBOX_ERROR,
                exit_code=None,
                stdout="",
                stderr="",
                wall_seconds=0.0,
                is_output_truncated=False,
                backend=self.sandbox.backend.name,
                detail=str(error),
            )
        finally:
            self._slots.put(worker)

    def _start_worker(self) -> WarmWorker:
        name = str(next(self._worker_names))
        worker = self.sandbox.in_spawner_thread(lambda: WarmWorker(self.sandbox, name=name))
        self._workers.append(worker)
        return worker

    def close(self) -> None:
        """Wait for running jobs, then stop the workers and release the sandbox's resources."""
        self._executor.shutdown(wait=True)
        for worker in self._workers:
            worker.close()
        self._workers = []
        self.sandbox.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> SandboxPool:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)
