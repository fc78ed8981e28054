"""The remote sandbox backend against in-process `sharpen serve-sandbox` services (bwrap): the same results as a
local sandbox, sessions that carry the code grader's relay, idle sessions that expire, full replicas that send
work elsewhere, and faults of the service that abstain instead of blaming the program. The replica-kill test is
test_remote_kill.py."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from sandbox_checks import sandbox_config

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.base import EpisodeContext
from sharpen.environments.python_tool import PythonEnvironment, SandboxFailure
from sharpen.environments.sandbox import ExecutionResult, ExecutionStatus, Sandbox, SandboxPool
from sharpen.environments.sandbox.remote import RemoteSandbox, RemoteSandboxPool
from sharpen.environments.sandbox.service import SandboxService
from sharpen.rewards.code_tests import CodeTestReward, pytest_ro_binds
from sharpen.types import Example, Message, RewardStatus

TOKEN = "remote-sandbox-test-token"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def _server_config(**overrides: Any) -> SandboxConfig:
    limits = {"wall_seconds": 4.0, "cpu_seconds": 4, "memory_mb": 256, "extra_ro_binds": pytest_ro_binds()}
    return sandbox_config(backend="bwrap", **{**limits, **overrides})


def _client_config(*urls: str, **remote: Any) -> SandboxConfig:
    return SandboxConfig(backend="remote", wall_seconds=4.0, remote={"urls": list(urls), "backoff_s": 0.05, **remote})


def _serve(stack: ExitStack, config: SandboxConfig) -> SandboxService:
    pool = stack.enter_context(SandboxPool(config))
    return stack.enter_context(SandboxService(config, pool=pool, token=TOKEN))


@pytest.fixture(autouse=True)
def token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", TOKEN)


@pytest.fixture(scope="module")
def service() -> Iterator[SandboxService]:
    with ExitStack() as stack:
        yield _serve(stack, _server_config())


@pytest.fixture
def remote(service: SandboxService) -> Iterator[RemoteSandbox]:
    with RemoteSandbox(_client_config(service.url)) as box:
        yield box


def test_remote_results_are_a_local_sandboxs(remote: RemoteSandbox) -> None:
    code = "import sys\nprint(open('data.bin', 'rb').read().hex(), sys.stdin.read(), open('t.txt').read())"
    files: dict[str, str | bytes] = {"data.bin": bytes([0, 255, 10]), "t.txt": "text"}
    programs = [
        lambda box: box.run_python(code, files=files, stdin="in put"),
        lambda box: box.run(["/bin/sh", "-c", "echo out; echo err >&2; exit 3"]),
        lambda box: box.run_python("import os; os.kill(os.getpid(), 9)"),
    ]
    with Sandbox(_server_config()) as local:
        for program in programs:
            mine, theirs = program(local), program(remote)
            assert (theirs.status, theirs.exit_code, theirs.signal, theirs.stdout, theirs.stderr) == (
                mine.status,
                mine.exit_code,
                mine.signal,
                mine.stdout,
                mine.stderr,
            )
            assert theirs.is_program_started and theirs.backend == "bwrap"
    assert remote.report.backend == "bwrap" and remote.report.level == "strong"
    with pytest.raises(ValueError, match=r"main\.py"):
        remote.run_python("pass", files={"main.py": "x"})
    with pytest.raises(ValueError):
        remote.run_python("pass", files={"../escape": "x"})


def _example(**metadata: Any) -> Example:
    return Example(task_key="add/0", prompt=(Message(role="user", content="Write add(a, b)."),), metadata=metadata)


@pytest.mark.parametrize(
    ("program", "status"),
    [
        ("def add(a, b):\n    return a + b\n", RewardStatus.OK),
        ("def add(a, b):\n    return a - b\n", RewardStatus.WRONG),
    ],
    ids=["ok", "wrong"],  # a hang, and the rest of the grader's tests: tests/unit/rewards/test_code_tests_remote.py
)
def test_the_code_graders_relay_runs_over_remote_sessions(remote: RemoteSandbox, program: str, status: str) -> None:
    cases = _example(entry_point="add", cases=[{"args": [1, 2], "expected": 3}, {"call": "add(5, 7)", "expected": 12}])
    checker = _example(
        test_files={"test_add.py": "from solution import add\n\ndef test_add():\n    assert add(1, 2) == 3\n"}
    )
    for example in (cases, checker):  # in-process comparison, then two sandboxes relayed by the host
        result = CodeTestReward(remote)(example, f"```python\n{program}```")
        assert result.status == status, result.detail
        assert result.score == (1.0 if status == RewardStatus.OK else 0.0)


def test_an_idle_session_expires_and_its_end_abstains() -> None:
    with ExitStack() as stack:
        service = _serve(stack, _server_config(service={"idle_seconds": 0.3}))
        remote = stack.enter_context(RemoteSandbox(_client_config(service.url)))
        session = remote.open_python_session(
            "import sys\nfor line in sys.stdin: print(line.upper(), end='', flush=True)"
        )
        assert session.send(b"hi", timeout=5) and session.receive(timeout=5) == b"HI"
        _wait_for(lambda: "sharpen_open_sessions 0" in httpx.get(service.url + "/metrics").text)
        assert not session.send(b"again", timeout=5)
        assert session.receive(timeout=1) is None and session.has_ended
        result = session.close()
        assert result.status == ExecutionStatus.SANDBOX_ERROR and not result.is_program_started
        assert "lost" in result.detail


def test_a_full_replica_sends_executions_to_another() -> None:
    with ExitStack() as stack:
        services = [_serve(stack, _server_config(max_concurrency=1, service={"max_queue_size": 0})) for _ in range(2)]
        pool = stack.enter_context(RemoteSandboxPool(_client_config(*(s.url for s in services))))

        async def run_all() -> list[Any]:
            code = "import time; time.sleep(0.4); print({})"
            return await asyncio.gather(*(pool.run_python(code.format(i)) for i in range(6)))

        results = asyncio.run(run_all())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
    assert all(s.num_executions >= 1 for s in services)
    assert sum(s.num_executions for s in services) == 6
    assert sum(s.shell.counts["rejected"] for s in services) >= 1, "some calls met a full replica and moved on"


class BrokenPool:
    """A replica's pool whose sandbox starts nothing (as when its host lost a cgroup), until ``is_broken`` is cleared;
    it is its own ``sandbox`` so that the readiness probe's run goes through it too."""

    def __init__(self, pool: SandboxPool) -> None:
        self.pool, self.report, self.config, self.sandbox = pool, pool.report, pool.config, self
        self.is_broken = True

    def _failed(self) -> ExecutionResult:
        return ExecutionResult(
            status=ExecutionStatus.SANDBOX_ERROR,
            exit_code=None,
            stdout="",
            stderr="",
            wall_seconds=0.0,
            is_output_truncated=False,
            backend="bwrap",
            detail="cgroup vanished",
        )

    async def run_python(self, code: str, **kwargs: Any) -> ExecutionResult:
        return self._failed() if self.is_broken else await self.pool.run_python(code, **kwargs)

    def run(self, argv: list[str], **kwargs: Any) -> ExecutionResult:
        return self._failed() if self.is_broken else self.pool.sandbox.run(argv, **kwargs)


def test_a_replica_whose_sandbox_starts_nothing_sends_work_elsewhere_and_is_not_ready() -> None:
    with ExitStack() as stack:
        config = _server_config()
        broken = BrokenPool(stack.enter_context(SandboxPool(config)))
        sick = stack.enter_context(SandboxService(config, pool=broken, token=TOKEN))  # type: ignore[arg-type]
        well = _serve(stack, config)
        remote = stack.enter_context(RemoteSandbox(_client_config(sick.url, well.url)))
        results = [remote.run_python(f"print({i})") for i in range(8)]
        assert [(r.status, r.stdout) for r in results] == [(ExecutionStatus.OK, f"{i}\n") for i in range(8)]
        assert sick.shell.counts["requests"] >= 3 and well.num_executions == 8
        assert httpx.get(sick.url + "/readyz").status_code == 503
        assert httpx.get(well.url + "/readyz").status_code == 200
        broken.is_broken = False  # the host recovers: the next readiness check's trivial program starts
        assert httpx.get(sick.url + "/readyz").status_code == 200


def test_a_service_that_is_gone_is_an_infrastructure_fault() -> None:
    with ExitStack() as stack:
        service = _serve(stack, _server_config())
        pool = stack.enter_context(RemoteSandboxPool(_client_config(service.url, max_retries=1)))
        env = PythonEnvironment()
        ctx = EpisodeContext(seed=0, sample_index=0, max_turns=2, max_tokens=100, sandbox=pool)
        example = Example(task_key="t", prompt=(Message(role="user", content="go"),))

        async def episode() -> str:
            await env.reset(example, ctx)
            return await env.python("print(6 * 7)")

        assert "42" in asyncio.run(episode())
        service.close()
        result = pool.sandbox.run_python("print(1)")
        assert result.status == ExecutionStatus.SANDBOX_ERROR and not result.is_program_started
        with pytest.raises(SandboxFailure, match="no sandbox replica"):
            asyncio.run(episode())


def test_a_wrong_token_fails_at_construction(service: SandboxService, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", "not-the-token")
    with pytest.raises(RuntimeError, match="401"):
        RemoteSandbox(_client_config(service.url))


def _wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)
