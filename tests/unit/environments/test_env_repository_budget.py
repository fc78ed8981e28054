"""The repository environment's use of its shell session's output budget (sandbox.max_output_bytes): a turn that
changed no source file is not read or graded again, a graded turn ships only the changed files, a grading past the
budget ends the policy's shell with its last grade (never an abstention), and a config whose worst case overflows is
refused."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from types import SimpleNamespace
from typing import Any

import pytest
from repo_task_checks import TASKS_DIR

from sharpen.config.environments import RepositoryEnvironmentConfig
from sharpen.config.sandbox import SandboxConfig
from sharpen.data.repo_tasks import ORIGINAL_DIR, RepoTask
from sharpen.environments import EpisodeContext
from sharpen.environments import terminal as terminal_module
from sharpen.environments.registry import build_sandbox
from sharpen.environments.repository import RepositoryEnvironment, check_session_output, is_test_path
from sharpen.environments.sandbox import SandboxPool
from sharpen.environments.shell import CommandResult, ShellLost, is_infrastructure_loss
from sharpen.environments.terminal import TerminalFailure
from sharpen.environments.workspace_tools import source_digest

needs_sandbox = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def _call(command: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'run_command', 'arguments': {'command': command}})}</tool_call>"


def _write(path: str, data: bytes) -> str:
    return f"printf %s {base64.b64encode(data).decode()} | base64 -d > {path}"


def _example(task: RepoTask) -> Any:
    (example,) = RepositoryEnvironment.make_tasks(1, seed=0, tasks_dir=str(TASKS_DIR), task_ids=[task.id])
    return example


@needs_sandbox
@pytest.mark.slow
def test_more_turns_than_whole_snapshots_fit_are_graded_and_unchanged_turns_are_not(task: RepoTask) -> None:
    # 12 turns: a 130 kB snapshot a turn (the old grading) is 1.5 MB, past the default 1 MiB session budget.
    other = "h11/_util.py" if task.mutation.path != "h11/_util.py" else "h11/_events.py"
    fix = (TASKS_DIR / ORIGINAL_DIR / task.mutation.path).read_bytes()
    actions = [
        _call("ls"),  # nothing changed: not read, not graded
        _call(f"echo '# a comment' >> {other}"),  # a source change, still buggy: suite run 1, grade 0
        _call(f"wc -l {other}; python3 -c 'import sys' "),  # nothing changed
        _call("echo '# x' >> h11/tests/test_util.py"),  # a test file: the grader restores it, nothing to grade
        _call(_write(task.mutation.path, fix)),  # the fix: suite run 2, grade 1
        *[_call("true")] * 6,
        "Done.",
    ]

    async def play() -> tuple[RepositoryEnvironment, list[Any]]:
        config = RepositoryEnvironmentConfig(tasks_dir=str(TASKS_DIR), max_turns=12)
        pool = build_sandbox(config, SandboxConfig(backend="bwrap", wall_seconds=120))
        assert isinstance(pool, SandboxPool) and pool.config.max_output_bytes == 1 << 20
        with pool:
            environment = RepositoryEnvironment(tasks_dir=str(TASKS_DIR))
            ctx = EpisodeContext(seed=0, sample_index=0, max_turns=12, max_tokens=99999, sandbox=pool)
            await environment.reset(_example(task), ctx)
            results = [await environment.step(action) for action in actions]
            return environment, results

    environment, results = asyncio.run(play())
    texts = [m.text for r in results for m in r.observation]
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 0.0, 1.0, *[0.0] * 6, 0.0], texts
    assert [r.info["grade"] for r in results] == [0.0] * 4 + [1.0] * 8
    assert sum(r.info["num_solved"] for r in results) == 1.0
    assert results[-1].terminated and not any(r.truncated for r in results)
    assert environment.num_suite_runs == 2  # the comment, the fix; never an unchanged turn
    assert environment.num_shipments == 2  # the sandbox's digest of an untouched workspace is the host's
    assert environment.shell is not None and environment.shell.num_received_bytes < 64_000  # no 130 kB snapshots


class _FakeShell:
    """A shell whose commands answer from a script: each entry a `CommandResult` or a `ShellLost` to raise."""

    def __init__(self, answers: list[CommandResult | ShellLost], *, num_received_bytes: int = 0) -> None:
        self.answers = answers
        self.num_received_bytes = num_received_bytes
        self.commands: list[str] = []
        self.is_closed = False

    async def run(self, command: str, *, timeout_seconds: float, keep_bytes: int) -> CommandResult:
        self.commands.append(command)
        answer = self.answers.pop(0)
        if isinstance(answer, ShellLost):
            raise answer
        return answer

    async def close(self) -> None:
        self.is_closed = True


def _answer(output: str, *, timed_out: bool = False) -> CommandResult:
    code = 137 if timed_out else 0
    size = len(output.encode())
    return CommandResult(
        output=output, exit_code=code, is_timed_out=timed_out, num_output_bytes=size, is_truncated=False
    )


def _fake_episode(
    monkeypatch: pytest.MonkeyPatch, task: RepoTask, shell: _FakeShell, *, max_output_bytes: int = 20_000
) -> tuple[RepositoryEnvironment, EpisodeContext]:
    async def start(sandbox: object, files: object) -> _FakeShell:
        return shell

    monkeypatch.setattr(terminal_module.SandboxShell, "start", start)
    pool = SimpleNamespace(sandbox=None, config=SandboxConfig(max_output_bytes=max_output_bytes))
    # fixed part of the budget: 256 x (4 + 1) grading checks + 4 tool calls x (1000 + 256) = 6,304 bytes
    environment = RepositoryEnvironment(tasks_dir=str(TASKS_DIR), max_tool_calls=4, max_output_chars=1000)
    ctx = EpisodeContext(seed=0, sample_index=0, max_turns=4, max_tokens=99999, sandbox=pool)
    return environment, ctx


def test_a_first_command_that_times_out_or_loses_the_shell_is_an_infrastructure_failure(
    monkeypatch: pytest.MonkeyPatch, task: RepoTask
) -> None:
    for answer in [
        _answer("", timed_out=True),
        ShellLost("the shell stopped answering: status killed", status="killed"),
    ]:
        environment, ctx = _fake_episode(monkeypatch, task, _FakeShell([answer]))
        with pytest.raises(TerminalFailure, match="the workspace's shell did not"):
            asyncio.run(environment.reset(_example(task), ctx))


def test_a_grading_past_the_sessions_budget_ends_the_policys_shell_with_its_last_grade(
    monkeypatch: pytest.MonkeyPatch, task: RepoTask
) -> None:
    """The config leaves every turn room for the task set's largest source file, so only the policy's own large
    changes use the budget up: its shell ends and its last grade stands, never an abstention (which a policy could
    reach on purpose by bloating its workspace)."""
    digest = "d" * 64

    async def one_turn(shell: _FakeShell) -> tuple[RepositoryEnvironment, Any]:
        environment, ctx = _fake_episode(monkeypatch, task, shell)
        await environment.reset(_example(task), ctx)
        return environment, await environment.step(_call("make something"))

    # budget 20,000, 15,000 used: 20,000 - 15,000 - 256 = 4,744 left, asked for in the grading's limit
    for size in (9000, 13697):
        shell = _FakeShell([_answer("/home"), _answer("exit 0"), _answer(f"too_large {digest} {size}")])
        shell.num_received_bytes = 15_000
        environment, result = asyncio.run(one_turn(shell))
        assert json.loads(base64.b64decode(shell.commands[2].rsplit("\n", 2)[1]))["arguments"]["limit"] == 4744
        assert result.reward == 0.0 and result.truncated and result.info["stop"] == "shell_lost" and shell.is_closed
        assert environment.num_suite_runs == 0


def test_an_unchanged_digest_is_not_graded_and_a_shell_lost_to_its_sandbox_is_an_infrastructure_failure(
    monkeypatch: pytest.MonkeyPatch, task: RepoTask
) -> None:
    lost = ShellLost("the shell ended: status sandbox_error", status="sandbox_error", detail="bwrap failed")
    shell = _FakeShell([_answer("/home"), _answer("exit 0"), lost])
    environment, ctx = _fake_episode(monkeypatch, task, shell)

    async def play() -> None:
        await environment.reset(_example(task), ctx)
        shell.answers[:0] = [_answer("exit 0"), _answer(f"unchanged {environment.graded_digest}")]
        result = await environment.step(_call("ls"))
        assert result.reward == 0.0 and environment.num_shipments == environment.num_suite_runs == 0
        request = json.loads(base64.b64decode(shell.commands[2].rsplit("\n", 2)[1]))
        assert not result.truncated and request["tool"] == "changes"
        assert request["arguments"]["last"] == environment.graded_digest == _pristine_digest(environment)
        await environment.step(_call("ls"))

    with pytest.raises(TerminalFailure, match="the episode's shell was lost"):
        asyncio.run(play())
    assert is_infrastructure_loss(lost)
    assert not is_infrastructure_loss(ShellLost("x", status="killed", detail="ended by signal SIGKILL"))
    # past max_output_bytes: only a command writing around the controller gets there (the environment's traffic is
    # bounded below it), so it is the policy's doing, never an abstention
    assert not is_infrastructure_loss(ShellLost("x", status="killed", detail="output passed max_output_bytes"))


def _pristine_digest(environment: RepositoryEnvironment) -> str:
    sources = {p: d for p, d in environment.pristine.items() if not is_test_path(p) and "__pycache__" not in p}
    return source_digest(sources)


def test_a_config_whose_worst_case_overflows_the_session_is_refused_in_one_line() -> None:
    # h11's largest source file is 44,819 bytes. Defaults: 256 x 17 + 32 x (4,000 + 256) = 140,544 fixed, plus
    # 16 x (44,819 + 256) = 721,200 for the graded turns: 861,744 <= 1,048,576, accepted.
    check_session_output(
        tasks_dir=str(TASKS_DIR), max_turns=16, max_tool_calls=32, max_output_chars=4000, max_output_bytes=1 << 20
    )
    # 32 turns: 256 x 33 + 136,192 = 144,640 fixed, plus 32 x 45,075 = 1,442,400: 1,587,040 bytes.
    with pytest.raises(ValueError, match=r"^repository: an episode's shell may send 1587040 bytes [^\n]*$"):
        check_session_output(
            tasks_dir=str(TASKS_DIR), max_turns=32, max_tool_calls=32, max_output_chars=4000, max_output_bytes=1 << 20
        )
    config = RepositoryEnvironmentConfig(tasks_dir=str(TASKS_DIR), max_turns=32)
    with pytest.raises(ValueError, match=r"sandbox\.max_output_bytes = 1048576"):
        build_sandbox(config, SandboxConfig(backend="process", min_isolation="weak"))


def test_the_humaneval_checkers_sandbox_is_the_runs_one_rule_for_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    from sharpen.config import SharpenConfig
    from sharpen.environments.registry import sandbox_for_run
    from sharpen.orchestration import build
    from sharpen.rewards.code_tests import pytest_ro_binds

    opened: list[SandboxConfig] = []

    @contextlib.contextmanager
    def open_sandbox(sandbox: SandboxConfig) -> Any:
        opened.append(sandbox)
        yield object()

    monkeypatch.setattr(build, "open_sandbox", open_sandbox)
    # one of pytest's binds given already: the one rule (`sandbox_for_run`) does not bind it twice
    given = ["/host/extra:/opt/extra", pytest_ro_binds()[0]]
    config = SharpenConfig.model_validate({"data": {"type": "humaneval"}, "sandbox": {"extra_ro_binds": given}})
    with contextlib.ExitStack() as stack:
        build.build_reward_fn(config, stack)
    assert opened == [sandbox_for_run(config)]
    assert opened[0].extra_ro_binds == [*given, *pytest_ro_binds()[1:]]
