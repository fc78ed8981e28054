"""Fixtures of the sandbox tests (test_sandbox*.py): a bwrap sandbox with small limits, a host loopback listener;
and of the repository environment's tests: the default task set's first task. Helpers shared by those tests live in
sandbox_checks.py and repo_task_checks.py."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator

import pytest
from repo_task_checks import TASKS_DIR
from sandbox_checks import SHORT_WALL_SECONDS, sandbox_config

from sharpen.data.repo_tasks import RepoTask, read_repo_tasks
from sharpen.environments.sandbox import Sandbox


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    """A bwrap sandbox with small limits, shared by a module's tests (each execution is independent)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (make system-deps)")
    with Sandbox(sandbox_config(backend="bwrap")) as box:
        cgroup_paths = [d.path for d in box.cgroup_dirs]
        yield box
    assert not box.state_dir.exists()
    assert not any(path.exists() for path in cgroup_paths)


@pytest.fixture(scope="module")
def short_sandbox() -> Iterator[Sandbox]:
    """Like ``sandbox`` with a short wall clock, for the attacks that end in a timeout."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (make system-deps)")
    with Sandbox(sandbox_config(backend="bwrap", wall_seconds=SHORT_WALL_SECONDS)) as box:
        yield box


@pytest.fixture
def host_listener() -> Iterator[socket.socket]:
    """A TCP listener on the host's loopback (never anything off this machine)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    yield listener
    listener.close()


@pytest.fixture(scope="module")
def task() -> RepoTask:
    """The default repository task set's first task (`make tasks` builds the set)."""
    if not (TASKS_DIR / "tasks.jsonl").is_file():
        pytest.fail(f"no default task set at {TASKS_DIR} (`make tasks` builds it)")
    return read_repo_tasks(TASKS_DIR)[0]
