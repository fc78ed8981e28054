"""Running a snapshot's own pytest suite in the sandbox, and what came of it: which tests passed, which failed
and the short line pytest gives for each failure.

Owns the driver that runs inside the sandbox (pytest from the host's interpreter, bound read-only by
`pytest_ro_binds`; the snapshot written into the execution's private, writable home, so the snapshot on the host
is never touched) and the parsing of its one result line. The package's own pytest ``addopts`` are cleared (they
often name plugins the sandbox does not have), cache files are not written, and ``PYTHONHASHSEED=0`` keeps set and
dict orders of strings, and so the failure messages, the same from run to run. Deciding what a result means for a
task is build.py's job.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox import ExecutionStatus, Sandbox
from sharpen.rewards.code_tests import PYTEST_PATH, pytest_ro_binds
from sharpen.tasks.sources import Snapshot

DRIVER_NAME = "_sharpen_run_tests.py"
RESULT_MARKER = "@@sharpen-test-result@@ "
MAX_MESSAGE_CHARS = 300
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")

_DRIVER = """
import json, os, sys
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
print({marker!r} + json.dumps(result))
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
    sandbox: Sandbox, files: Snapshot, *, deselect: Sequence[str] = (), ignore: Sequence[str] = ()
) -> SuiteResult:
    """Run pytest at the snapshot's root in a fresh sandbox; ``deselect``: node ids not to run; ``ignore``: test
    files or folders not to collect."""
    if DRIVER_NAME in files:
        raise ValueError(f"the snapshot may not contain {DRIVER_NAME!r}: the test driver is written there")
    driver = _DRIVER.format(
        pytest_path=PYTEST_PATH,
        options=[*(f"--deselect={node}" for node in deselect), *(f"--ignore={path}" for path in ignore)],
        marker=RESULT_MARKER,
    )
    python = sandbox.config.python_executable
    argv = ["/usr/bin/env", "PYTHONHASHSEED=0", python, "-s", "-S", "-B", DRIVER_NAME]
    result = sandbox.run(argv, files={**files, DRIVER_NAME: driver})
    line = next((line for line in reversed(result.stdout.splitlines()) if line.startswith(RESULT_MARKER)), None)
    if line is None or result.status not in (ExecutionStatus.OK, ExecutionStatus.NONZERO_EXIT):
        tail = (result.stdout + result.stderr).strip().splitlines()[-3:]
        detail = f"{result.status}: {result.detail}; output ends: {' | '.join(tail)}"
        return SuiteResult(
            is_complete=False, exit_code=None, passed=(), failed={}, wall_seconds=result.wall_seconds, detail=detail
        )
    report = json.loads(line.removeprefix(RESULT_MARKER))
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
