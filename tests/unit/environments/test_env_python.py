"""The Python code-execution environment: the policy's program runs in the real sandbox and its output comes back as
a tool message; a failing sandbox is an infrastructure fault (the episode abstains), never the policy's."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from sharpen.config.environments import PythonEnvironmentConfig
from sharpen.config.sandbox import SandboxConfig
from sharpen.environments import EnvironmentInfraError, EpisodeContext
from sharpen.environments.python_tool import PythonEnvironment, SandboxFailure
from sharpen.environments.registry import build_environment_factory, build_sandbox
from sharpen.environments.sandbox import ExecutionResult, ExecutionStatus
from sharpen.types import Example, Message

EXAMPLE = Example(task_key="t/0", prompt=(Message(role="user", content="What is 6 * 7?"),), answer="42")


def _call(code: str) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"


def _episode(sandbox, actions: list[str]):
    async def play():
        environment = PythonEnvironment()
        await environment.reset(
            EXAMPLE, EpisodeContext(seed=0, sample_index=0, max_turns=4, max_tokens=99, sandbox=sandbox)
        )
        return [await environment.step(action) for action in actions]

    return asyncio.run(play())


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make system-deps)")
def test_programs_run_in_the_sandbox_and_their_output_comes_back():
    pool = build_sandbox(PythonEnvironmentConfig(), SandboxConfig(backend="bwrap", wall_seconds=5))
    assert pool is not None and pool.report.backend == "bwrap"
    try:
        ok, failing, secret, answer = _episode(
            pool,
            [
                _call("print(6 * 7)"),
                _call("import sys; print('partial'); sys.exit(3)"),
                _call("import os; print(open('/etc/shadow').read() if os.path.exists('/etc/shadow') else 'no shadow')"),
                "The answer is <answer>42</answer>",
            ],
        )
    finally:
        pool.close()
    assert ok.observation == [Message(role="tool", content="status: ok\nstdout:\n42")]
    assert failing.observation[0].content == "status: nonzero_exit (exit code 3)\nstdout:\npartial"
    assert secret.observation[0].content == "status: ok\nstdout:\nno shadow"  # the host's files are not there
    assert answer.terminated


class _BrokenPool:
    async def run_python(self, code: str) -> ExecutionResult:
        return ExecutionResult(
            status=ExecutionStatus.SANDBOX_ERROR,
            exit_code=None,
            stdout="",
            stderr="",
            wall_seconds=0.0,
            is_output_truncated=False,
            backend="bwrap",
            detail="bwrap: setting up uid map: Permission denied",
        )


def test_a_sandbox_failure_is_an_infra_error_not_feedback_for_the_policy():
    with pytest.raises(EnvironmentInfraError, match="sandbox error: bwrap: setting up uid map"):
        _episode(_BrokenPool(), [_call("print(1)")])
    with pytest.raises(SandboxFailure, match="needs a sandbox"):
        _episode(None, [])
    assert isinstance(build_environment_factory(PythonEnvironmentConfig(max_tool_calls=2))(), PythonEnvironment)
