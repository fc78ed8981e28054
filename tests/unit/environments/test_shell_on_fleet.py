"""Terminal and repository episodes on a sandbox fleet: two real `sharpen serve-sandbox` processes, served from a
repository config as a run's replicas are, and episodes configured the way code episodes are (``sandbox.backend =
"remote"``, the replicas' URLs). Each episode's shell is a session pinned to one replica (two episodes reset at once
take one replica each); a scripted terminal episode (with a hidden checker run as a separate remote execution) and
a scripted repository episode (the right fix, graded by the package's suite on a replica) score and answer exactly
as on a local bwrap pool."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sharpen.config import SharpenConfig
from sharpen.config.environments import RepositoryEnvironmentConfig
from sharpen.config.sandbox import SandboxConfig
from sharpen.config.service import RemoteConfig
from sharpen.data.repo_tasks import ORIGINAL_DIR
from sharpen.environments import EpisodeContext, StepResult
from sharpen.environments.registry import build_sandbox, sandbox_for_run
from sharpen.environments.repository import RepositoryEnvironment
from sharpen.environments.sandbox import SandboxPool
from sharpen.environments.sandbox.remote import RemoteSandboxPool
from sharpen.environments.terminal import TerminalEnvironment
from sharpen.rewards.code_tests import PYTEST_PATH

ROOT = Path(__file__).resolve().parents[3]
TASKS_DIR = ROOT / ".sharpen-tasks" / "h11-0.16.0-seed0"  # the Makefile's DEFAULT_TASKS
TOKEN = "shell-on-fleet-test-token"
WALL_SECONDS = 150  # beyond environment.wall_seconds (120 by default), as the config asks
SERVED = ["sandbox.backend=bwrap", f"sandbox.wall_seconds={WALL_SECONDS}", "environment.type=repository"]
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def _call(command: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'run_command', 'arguments': {'command': command}})}</tool_call>"


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[str]]:
    """Two `sharpen serve-sandbox` processes (the recipe's [sandbox] of a repository run); their URLs."""
    if not (TASKS_DIR / "tasks.jsonl").is_file():
        pytest.fail(f"no default task set at {TASKS_DIR} (`make tasks` builds it)")
    command = [sys.executable, "-m", "sharpen.cli.main", "serve-sandbox", "--port", "0", *SERVED]
    env = {**os.environ, "SHARPEN_SERVICE_TOKEN": TOKEN}
    servers = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        urls = []
        for server in servers:
            assert server.stdout is not None
            line = server.stdout.readline()
            assert " at http://" in line, line
            urls.append(line.rsplit(" at ", 1)[1].strip())
        yield urls
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)
        for server in servers:
            server.wait(timeout=30)


@pytest.fixture
def token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", TOKEN)


def _open_sessions(url: str) -> int:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("sharpen_open_sessions "):
            return int(float(line.split()[1]))
    raise AssertionError(f"{url}/metrics has no sharpen_open_sessions")


def _play_both(
    pool: SandboxPool | RemoteSandboxPool, *, after_resets: list[str]
) -> tuple[list[StepResult], list[StepResult], list[int]]:
    """One scripted terminal episode (double_script: its checker is hidden, a separate execution) and one scripted
    repository episode (the shipped file written back) on the run's one pool, reset at once, then played; the open
    sessions of each URL of ``after_resets`` once both have reset."""
    (terminal_example,) = TerminalEnvironment.make_tasks(1, seed=7, tasks=["double_script"])
    terminal_actions = [
        _call("ls -a"),
        _call("cat > double.sh <<'EOF'\necho $(( $1 * 2 ))\nEOF\nbash double.sh 21"),
        "Done.",
    ]
    repository = RepositoryEnvironment(tasks_dir=str(TASKS_DIR))
    task_id = sorted(repository.task_set.tasks)[0]
    (repository_example,) = RepositoryEnvironment.make_tasks(1, seed=0, tasks_dir=str(TASKS_DIR), task_ids=[task_id])
    path = repository.task_set.tasks[task_id].mutation.path
    shipped = base64.b64encode((TASKS_DIR / ORIGINAL_DIR / path).read_bytes()).decode()
    repository_actions = [_call(f"echo $PYTHONPATH; ls {PYTEST_PATH}/pytest >/dev/null && echo pytest is there")]
    repository_actions += [_call(f"printf %s {shipped} | base64 -d > {path}"), "Fixed."]

    async def play() -> tuple[list[StepResult], list[StepResult], list[int]]:
        terminal = TerminalEnvironment()
        await asyncio.gather(
            terminal.reset(terminal_example, _context(pool)),
            repository.reset(repository_example, _context(pool)),
        )
        sessions = [await asyncio.to_thread(_open_sessions, url) for url in after_resets]
        terminal_results = [await terminal.step(action) for action in terminal_actions]
        repository_results = [await repository.step(action) for action in repository_actions]
        return terminal_results, repository_results, sessions

    return asyncio.run(play())


def _context(pool: SandboxPool | RemoteSandboxPool) -> EpisodeContext:
    return EpisodeContext(seed=0, sample_index=0, max_turns=8, max_tokens=99999, sandbox=pool)


def _seen(results: list[StepResult]) -> list[tuple[float | None, bool, bool, list[str]]]:
    return [(r.reward, r.terminated, r.truncated, [m.text for m in r.observation]) for r in results]


def test_terminal_and_repository_episodes_on_two_replicas_score_as_locally(
    replicas: list[str], token_env: None
) -> None:
    remote = SandboxConfig(
        backend="remote", wall_seconds=WALL_SECONDS, remote=RemoteConfig(urls=replicas, backoff_s=0.05)
    )
    config = RepositoryEnvironmentConfig(tasks_dir=str(TASKS_DIR))  # its pool serves the terminal episode too
    fleet = build_sandbox(config, remote)
    assert isinstance(fleet, RemoteSandboxPool)
    with fleet:
        fleet_terminal, fleet_repository, sessions = _play_both(fleet, after_resets=replicas)
    assert sessions == [1, 1]  # one shell on each replica
    assert [_open_sessions(url) for url in replicas] == [0, 0]  # closed with their episodes

    local = SandboxConfig(backend="bwrap", wall_seconds=WALL_SECONDS)
    pool = build_sandbox(config, local)
    assert isinstance(pool, SandboxPool)
    with pool:
        local_terminal, local_repository, _ = _play_both(pool, after_resets=[])

    assert [r.reward for r in fleet_terminal] == [0.0, 1.0, 0.0]
    assert [r.reward for r in fleet_repository] == [0.0, 1.0, 0.0]  # the right fix scores 1
    assert f"{PYTEST_PATH}\npytest is there" in fleet_repository[0].observation[0].text
    assert _seen(fleet_terminal) == _seen(local_terminal)
    assert _seen(fleet_repository) == _seen(local_repository)


def test_the_served_sandbox_of_a_repository_run_binds_pytest_as_a_local_one() -> None:
    def binds(environment: str) -> list[str]:
        config = SharpenConfig.model_validate({"environment": {"type": environment}, "sandbox": {"wall_seconds": 150}})
        return sandbox_for_run(config).extra_ro_binds

    assert any(bind.endswith(f":{PYTEST_PATH}/pytest") for bind in binds("repository"))
    assert binds("terminal") == []
