"""Running a repository snapshot's own pytest suite in the sandbox, and what came of it: which tests passed,
which failed and the short line pytest gives for each failure. Here, below both its users, so that the task
builder (`sharpen.tasks`) and the repository environment's grader run a suite the same way.

Owns the driver that runs inside the sandbox (pytest from the host's interpreter, bound read-only by
`pytest_ro_binds`; the snapshot written into the execution's private, writable home, so the snapshot on the host
is never touched) and the parsing of its one result line. The package's own pytest ``addopts`` are cleared (they
often name plugins the sandbox does not have), cache files are not written, and ``PYTHONHASHSEED=0`` keeps set and
dict orders of strings, and so the failure messages, the same from run to run. Deciding what a result means for a
task is the caller's job (the builder's, the repository environment's).

Trust: the code under test runs in the driver's process, as in any pytest run. The result line carries a fresh
nonce, given on stdin, so output that the package's code prints (at import, at exit) is not read as the result; but
code written to tamper with the driver or pytest in its own process (read the nonce from memory, patch pytest's
reports) is not stopped. For a builder's unmodified package that is moot; for a policy's edits it is the known
limit of grading by the package's own tests in process (as SWE-style graders have it).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox import ExecutionResult, ExecutionStatus, Sandbox
from sharpen.rewards.code_tests import PYTEST_PATH, pytest_ro_binds

DRIVER_NAME = "_sharpen_run_tests.py"
RESULT_MARKER = "@@sharpen-test-result@@ "
MAX_MESSAGE_CHARS = 300
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")

_DRIVER = """
import json, os, sys
marker = {marker!r} + sys.stdin.readline().strip() + " "
sys.path.insert(0, {pytest_path!r})
if os.path.isdir("src"):
    sys.path.insert(0, os.path.abspath("src"))
import pytest


class Collector:
    def __init__(self):
        self.passed, self.failed = [], {{}}

    def pytest_runtest_logreport(self, report):
        if report.failed and report.nodeid not in self.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            self.failed[report.nodeid] = crash.message if crash is not None else str(report.longrepr)
        elif report.passed and report.when == "call":
            self.passed.append(report.nodeid)

    def pytest_collectreport(self, report):
        if report.failed:
            self.failed[report.nodeid or "<collection>"] = str(report.longrepr).strip().splitlines()[-1:]


collector = Collector()
args = ["-q", "-p", "no:cacheprovider", "-o", "addopts=", "--tb=short", *{options!r}]
code = pytest.main(args, plugins=[collector])
sys.stdout.flush()
result = {{"exit_code": int(code), "passed": collector.passed, "failed": collector.failed}}
print(marker + json.dumps(result))
"""


@dataclass(kw_only=True, slots=True, frozen=True)
class SuiteResult:
    """One run of a suite. ``is_complete``: pytest ran to its end and reported (no timeout, crash or sandbox
    fault); only then do ``passed`` and ``failed`` mean anything."""

    is_complete: bool
    exit_code: int | None
    passed: tuple[str, ...]
    failed: dict[str, str]
    """Failing test node id -> pytest's short failure line (the exception's message, addresses blanked)."""
    wall_seconds: float
    detail: str
    """Why it is not complete (the sandbox's status and the end of the output)."""


def suite_sandbox_config(*, wall_seconds: float, max_concurrency: int) -> SandboxConfig:
    """The sandbox for test suites: pytest bound in, a suite's time limit, room for pytest's own memory."""
    return SandboxConfig(
        extra_ro_binds=pytest_ro_binds(),
        wall_seconds=wall_seconds,
        cpu_seconds=max(1, int(wall_seconds) + 1),
        memory_mb=1024,
        max_open_files=256,
        max_concurrency=max_concurrency,
    )


def run_suite(
    sandbox: Sandbox, files: Mapping[str, bytes], *, deselect: Sequence[str] = (), ignore: Sequence[str] = ()
) -> SuiteResult:
    """Run pytest at the snapshot's root in a fresh sandbox; ``deselect``: node ids not to run; ``ignore``: test
    files or folders not to collect."""
    execution = suite_execution(sandbox.config.python_executable, files, deselect=deselect, ignore=ignore)
    return read_suite_result(sandbox.run(execution.argv, files=execution.files, stdin=execution.stdin), execution)


@dataclass(kw_only=True, slots=True, frozen=True)
class SuiteExecution:
    """One suite run to start: ``argv`` in a sandbox with ``files`` and ``stdin``; its result line begins with
    ``marker``, which holds a fresh nonce given on stdin, so that a line the code under test prints is not taken for
    it (code that reads the driver's memory can still forge it: see the module docstring)."""

    argv: list[str]
    files: dict[str, str | bytes]
    stdin: str
    marker: str


def suite_execution(
    python: str, files: Mapping[str, bytes], *, deselect: Sequence[str] = (), ignore: Sequence[str] = ()
) -> SuiteExecution:
    """One suite run, for a caller that runs it itself (e.g. on a `SandboxPool`); `read_suite_result` reads what
    came of it."""
    if DRIVER_NAME in files:
        raise ValueError(f"the snapshot may not contain {DRIVER_NAME!r}: the test driver is written there")
    driver = _DRIVER.format(
        pytest_path=PYTEST_PATH,
        options=[*(f"--deselect={node}" for node in deselect), *(f"--ignore={path}" for path in ignore)],
        marker=RESULT_MARKER,
    )
    argv = ["/usr/bin/env", "PYTHONHASHSEED=0", python, "-s", "-S", "-B", DRIVER_NAME]
    nonce = secrets.token_hex(16)
    return SuiteExecution(
        argv=argv, files={**files, DRIVER_NAME: driver}, stdin=nonce + "\n", marker=f"{RESULT_MARKER}{nonce} "
    )


def read_suite_result(result: ExecutionResult, execution: SuiteExecution) -> SuiteResult:
    marker = execution.marker
    line = next((line for line in reversed(result.stdout.splitlines()) if line.startswith(marker)), None)
    if line is None or result.status not in (ExecutionStatus.OK, ExecutionStatus.NONZERO_EXIT):
        tail = (result.stdout + result.stderr).strip().splitlines()[-3:]
        detail = f"{result.status}: {result.detail}; output ends: {' | '.join(tail)}"
        return SuiteResult(
            is_complete=False, exit_code=None, passed=(), failed={}, wall_seconds=result.wall_seconds, detail=detail
        )
    report = json.loads(line.removeprefix(marker))
    failed = {node: _short(message) for node, message in report["failed"].items()}
    return SuiteResult(
        is_complete=True,
        exit_code=report["exit_code"],
        passed=tuple(report["passed"]),
        failed=failed,
        wall_seconds=result.wall_seconds,
        detail="",
    )


def _short(message: str | list[str]) -> str:
    """A failure line fit for a problem statement: its first lines, object addresses blanked (they change from
    run to run), at most MAX_MESSAGE_CHARS."""
    text = "\n".join(message) if isinstance(message, list) else message
    lines = [line.rstrip() for line in text.strip().splitlines()[:4]]
    short = _ADDRESS.sub("0x...", "\n".join(lines))
    return short if len(short) <= MAX_MESSAGE_CHARS else short[: MAX_MESSAGE_CHARS - 3] + "..."
