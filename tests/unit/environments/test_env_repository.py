"""The repository environment on the default task set (h11 with planted bugs), in the real sandbox, driven by
scripted agents: the right fix scores 1; editing or deleting the failing tests scores 0 (the grader restores
them); the task set's hidden material (``original/``, the records with the mutation) is out of the shell's reach;
nothing crosses episodes; the policy can run the package's tests in its shell; a workspace is made quickly."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from repo_task_checks import ROOT, TASKS_DIR

from sharpen.config import load_config
from sharpen.config.environments import RepositoryEnvironmentConfig
from sharpen.config.sandbox import SandboxConfig
from sharpen.data.repo_tasks import ORIGINAL_DIR, RepoTask
from sharpen.environments import EpisodeContext, StepResult
from sharpen.environments.pytest_suite import RESULT_MARKER
from sharpen.environments.registry import build_environment_factory, build_sandbox, environment_tasks
from sharpen.environments.repository import RepositoryEnvironment, graded_tree, is_test_path
from sharpen.environments.sandbox import SandboxPool
from sharpen.types import Example

RECIPE = ROOT / "recipes" / "repository.toml"
needs_sandbox = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    config = RepositoryEnvironmentConfig(tasks_dir=str(TASKS_DIR))
    sandbox = build_sandbox(config, SandboxConfig(backend="bwrap", wall_seconds=60))
    assert isinstance(sandbox, SandboxPool) and sandbox.report.backend == "bwrap"
    with sandbox:
        yield sandbox


def _call(command: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'run_command', 'arguments': {'command': command}})}</tool_call>"


def _example(task: RepoTask) -> Example:
    (example,) = RepositoryEnvironment.make_tasks(1, seed=0, tasks_dir=str(TASKS_DIR), task_ids=[task.id])
    return example


def _episode(
    pool: SandboxPool, task: RepoTask, actions: list[str], **options: Any
) -> tuple[RepositoryEnvironment, list[StepResult], float]:
    """Play the actions; also returns the reset's seconds (the workspace's creation)."""

    async def play() -> tuple[RepositoryEnvironment, list[StepResult], float]:
        environment = RepositoryEnvironment(tasks_dir=str(TASKS_DIR), **options)
        ctx = EpisodeContext(seed=0, sample_index=0, max_turns=8, max_tokens=99999, sandbox=pool)
        start = time.perf_counter()
        await environment.reset(_example(task), ctx)
        reset_seconds = time.perf_counter() - start
        results = []
        for action in actions:
            results.append(await environment.step(action))
            if results[-1].terminated or results[-1].truncated:
                break
        return environment, results, reset_seconds

    return asyncio.run(play())


def _outputs(results: list[StepResult]) -> list[str]:
    return [message.text for result in results for message in result.observation]


def _write(path: str, data: bytes) -> str:
    """A shell command that writes ``data`` to ``path`` (any bytes, through base64)."""
    return f"printf %s {base64.b64encode(data).decode()} | base64 -d > {path}"


def _forged_result(task: RepoTask) -> bytes:
    """Source that prints a result line claiming every test passed, at import and at exit (after the driver's)."""
    passed = [*task.failing_tests, *(f"t{i}" for i in range(task.num_tests))]
    line = RESULT_MARKER + json.dumps({"exit_code": 0, "passed": passed, "failed": {}})
    return f"import atexit\nprint({line!r})\natexit.register(print, {line!r})\n".encode()


def _fix(task: RepoTask) -> str:
    """The right fix, made on the host side of the test: the mutated file as the package ships it."""
    return _write(task.mutation.path, (TASKS_DIR / ORIGINAL_DIR / task.mutation.path).read_bytes())


def test_the_grader_takes_tests_from_the_pristine_snapshot() -> None:
    assert all(
        map(is_test_path, ["h11/tests/test_io.py", "tests/helpers.py", "conftest.py", "pkg/conftest.py", "setup.cfg"])
    )
    assert not any(map(is_test_path, ["h11/_connection.py", "pkg/setup.cfg", "docs/index.rst", "README.rst"]))
    pristine = {"pkg/a.py": b"bug", "pkg/tests/test_a.py": b"real test", "setup.cfg": b"[tool:pytest]"}
    workspace = {"pkg/a.py": b"fixed", "pkg/tests/test_new.py": b"x", "conftest.py": b"cheat", "pkg/b.py": b"new"}
    workspace |= {"pkg/__pycache__/a.cpython-312.pyc": b"stale", "setup.cfg": b"[tool:pytest]\naddopts = -k nothing"}
    assert graded_tree(pristine, workspace) == {
        "pkg/a.py": b"fixed",
        "pkg/b.py": b"new",
        "pkg/tests/test_a.py": b"real test",
        "setup.cfg": b"[tool:pytest]",
    }


@needs_sandbox
def test_the_right_fix_scores_1_and_the_tests_run_in_the_shell(pool: SandboxPool, task: RepoTask) -> None:
    first = task.failing_tests[0]
    actions = [_call(f"python3 -m pytest -q -o addopts= -p no:cacheprovider '{first}'"), _call(_fix(task))]
    actions += [_call(f"python3 -m pytest -q -o addopts= -p no:cacheprovider '{first}'"), "Fixed."]
    _, results, reset_seconds = _episode(pool, task, actions)
    outputs = _outputs(results)
    assert [r.reward for r in results] == [0.0, 1.0, 0.0, 0.0], outputs
    assert "1 failed" in outputs[0] and "1 passed" in outputs[2], outputs
    assert results[-1].terminated and results[-1].info["grade"] == 1.0
    assert reset_seconds < 5.0  # the workspace's creation (typically well under a second)


@needs_sandbox
def test_editing_or_deleting_the_failing_tests_scores_0(pool: SandboxPool, task: RepoTask) -> None:
    test_file = task.failing_tests[0].split("::")[0]
    stub = b"def test_nothing():\n    pass\n"
    actions = [
        _call(_write(test_file, stub)),  # the failing tests replaced by one that passes
        _call(f"rm -rf {Path(test_file).parent} && ls h11"),  # every test deleted
        _call(_write("conftest.py", b"import pytest\ncollect_ignore_glob = ['*']\n")),  # collection switched off
        _call(_write("h11/__init__.py", _forged_result(task))),  # a forged result line: not read
        _call("echo 'raise ImportError' >> h11/__init__.py"),  # a source edit: the suite runs, and everything fails
        "Done.",
    ]
    environment, results, _ = _episode(pool, task, actions)
    assert [r.reward for r in results] == [0.0] * 6, _outputs(results)
    assert len(environment.grades) == 3  # the test edits left the graded tree as it was; the source edits ran
    assert results[-1].info["grade"] == 0.0


@needs_sandbox
def test_the_hidden_material_is_out_of_the_shells_reach(pool: SandboxPool, task: RepoTask) -> None:
    original = TASKS_DIR / ORIGINAL_DIR / task.mutation.path
    search = (
        f"cat {original}; ls {TASKS_DIR}; "
        "find / \\( -path /proc -o -path /usr \\) -prune -o \\( -name original -o -name 'tasks.jsonl' \\) -print "
        "2>/dev/null; echo end"
    )
    _, results, _ = _episode(pool, task, [_call(search), _call(f"cp {original} {task.mutation.path}"), "Done."])
    outputs = _outputs(results)
    assert "No such file or directory" in outputs[0] and outputs[0].endswith("\nend"), outputs  # found nothing
    assert task.mutation.function.split(".")[-1] not in outputs[0]
    assert [r.reward for r in results] == [0.0, 0.0, 0.0], outputs


@needs_sandbox
def test_no_state_crosses_episodes(pool: SandboxPool, task: RepoTask) -> None:
    _, first, _ = _episode(pool, task, [_call("echo secret > left.txt && rm -r h11/tests && ls")])
    _, second, _ = _episode(pool, task, [_call("ls left.txt; ls h11/tests | head -n 2")])
    assert "left.txt" in _outputs(first)[0]
    assert "No such file" in _outputs(second)[0] and "__init__.py" in _outputs(second)[0]


def test_the_config_builds_the_environment_and_its_tasks(task: RepoTask) -> None:
    config = RepositoryEnvironmentConfig(tasks_dir=str(TASKS_DIR), task_ids=[task.id], command_timeout_seconds=3.0)
    environment = build_environment_factory(config)()
    assert isinstance(environment, RepositoryEnvironment) and environment.command_timeout_seconds == 3.0
    examples = environment_tasks(config, size=3, seed=0)
    assert [e.metadata["task_id"] for e in examples] == [task.id] * 3
    assert all(e.prompt[0].text == task.statement and e.answer is None for e in examples)
    assert task.mutation.path not in examples[0].prompt[0].text  # nothing of the mutation travels with the prompt
    with pytest.raises(ValueError, match="tasks not in"):
        build_environment_factory(RepositoryEnvironmentConfig(tasks_dir=str(TASKS_DIR), task_ids=["nope"]))
    sandbox = build_sandbox(config, SandboxConfig(backend="process", min_isolation="weak"))
    assert sandbox is not None
    with sandbox:
        assert any(bind.endswith(":/opt/sharpen-pytest/pytest") for bind in sandbox.config.extra_ro_binds)


def test_the_recipe_loads() -> None:
    config = load_config(RECIPE)
    assert config.environment.type == "repository" and config.data.type == "environment"
