"""The repository environment's workspace tools (read_file, search, edit_file, run_tests): the program's answers on
a folder of the test's own (golden outputs), and scripted agents in the real sandbox on the default task set:
reading and fixing the mutated function with edit_file scores 1; editing a test file with it scores 0; no tool
reaches outside the workspace (``..``, absolute paths such as the task set's hidden ``original/``, a link out);
the tools are declared to the policy and read in another tool-call format; their output is bounded."""

from __future__ import annotations

import asyncio
import difflib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from repo_task_checks import TASKS_DIR

from sharpen.config.environments import RepositoryEnvironmentConfig
from sharpen.config.sandbox import SandboxConfig
from sharpen.data.repo_tasks import ORIGINAL_DIR, RepoTask
from sharpen.environments import EpisodeContext, StepResult
from sharpen.environments.registry import build_sandbox
from sharpen.environments.repository import RepositoryEnvironment
from sharpen.environments.sandbox import SandboxPool
from sharpen.environments.workspace_tools import ToolError, edit_file, read_file, resolve, search

needs_sandbox = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


# The program, on a folder of the test's own (what the sandbox runs, called directly here).


@pytest.fixture
def home(tmp_path: Path) -> str:
    (tmp_path / "repo" / "pkg").mkdir(parents=True)
    (tmp_path / "repo" / "pkg" / "a.py").write_text("def f():\n    return 1\n\n\ndef g():\n    return 1\n")
    (tmp_path / "repo" / "pkg" / "blob.bin").write_bytes(b"def f\0")
    (tmp_path / "secret.txt").write_text("def hidden(): pass\n")
    return os.path.realpath(tmp_path / "repo")


def test_read_file_numbers_the_lines_of_the_range_asked(home: str) -> None:
    assert read_file(home, "pkg/a.py", 4, 5) == "pkg/a.py: lines 4-5 of 6\n     4\t\n     5\tdef g():"
    assert read_file(home, "pkg/a.py", 6, 0) == "pkg/a.py: lines 6-6 of 6\n     6\t    return 1"
    assert read_file(home, "pkg/a.py", 5, 99).endswith("     6\t    return 1")  # an end past the file: its last
    with pytest.raises(ToolError, match="past its end"):
        read_file(home, "pkg/a.py", 7, 0)
    with pytest.raises(ToolError, match="end_line 0 or at least start_line"):
        read_file(home, "pkg/a.py", 3, 2)
    with pytest.raises(ToolError, match="is a directory"):
        read_file(home, "pkg", 1, 0)
    with pytest.raises(ToolError, match="no such file"):
        read_file(home, "pkg/b.py", 1, 0)


def test_search_lists_matching_lines_of_text_files_only(home: str) -> None:
    assert search(home, r"def \w\(", ".") == "pkg/a.py:1: def f():\npkg/a.py:5: def g():"
    assert search(home, "return 2", "pkg") == "no line matches 'return 2' under pkg"
    with pytest.raises(ToolError, match="not a regular expression"):
        search(home, "def (", ".")


def test_search_shows_at_most_50_matches_and_counts_the_rest(home: str) -> None:
    Path(home, "many.txt").write_text("x\n" * 60)
    lines = search(home, "x", "many.txt").splitlines()
    assert len(lines) == 51 and lines[0] == "many.txt:1: x" and lines[49] == "many.txt:50: x"
    assert lines[50] == "[10 more matching lines not shown: narrow the pattern or the path]"


def test_edit_file_replaces_the_one_exact_occurrence_and_refuses_otherwise(home: str) -> None:
    path = Path(home, "pkg", "a.py")
    with pytest.raises(ToolError, match=r"occurs 2 times in pkg/a\.py"):
        edit_file(home, "pkg/a.py", "    return 1\n", "    return 2\n")
    with pytest.raises(ToolError, match=r"does not occur in pkg/a\.py"):
        edit_file(home, "pkg/a.py", "def g():\n  return 1", "")  # two spaces of indentation, not four
    with pytest.raises(ToolError, match="old_string is empty"):
        edit_file(home, "pkg/a.py", "", "x")
    assert path.read_text() == "def f():\n    return 1\n\n\ndef g():\n    return 1\n"  # the refusals wrote nothing
    shown = edit_file(home, "pkg/a.py", "def g():\n    return 1", "def g():\n    x = 2\n    return x")
    assert shown == "edited pkg/a.py: lines 5-7 now read\n     5\tdef g():\n     6\t    x = 2\n     7\t    return x"
    assert path.read_text() == "def f():\n    return 1\n\n\ndef g():\n    x = 2\n    return x\n"


def test_no_path_outside_the_workspace_resolves(home: str) -> None:
    os.symlink("..", Path(home, "up"))
    for path in ["../secret.txt", "pkg/../../secret.txt", "up/secret.txt", "/etc/passwd", ""]:
        with pytest.raises(ToolError):
            resolve(home, path)
    assert resolve(home, "pkg/../pkg/a.py") == f"{home}/pkg/a.py"
    assert "hidden" not in search(home, "def", ".")  # the walk does not follow the link out


# The environment, in the real sandbox, on the default task set.


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    config = RepositoryEnvironmentConfig(tasks_dir=str(TASKS_DIR))
    # every turn's snapshot (~130 kB of h11, base64) crosses the session: room for the 11 turns of one test
    sandbox = build_sandbox(config, SandboxConfig(backend="bwrap", wall_seconds=60, max_output_bytes=4 << 20))
    assert isinstance(sandbox, SandboxPool) and sandbox.report.backend == "bwrap"
    with sandbox:
        yield sandbox


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _episode(
    pool: SandboxPool, task: RepoTask, actions: list[str], **options: Any
) -> tuple[RepositoryEnvironment, list[StepResult], list[str]]:
    async def play() -> tuple[RepositoryEnvironment, list[StepResult], list[str]]:
        environment = RepositoryEnvironment(tasks_dir=str(TASKS_DIR), **options)
        (example,) = RepositoryEnvironment.make_tasks(1, seed=0, tasks_dir=str(TASKS_DIR), task_ids=[task.id])
        ctx = EpisodeContext(seed=0, sample_index=0, max_turns=16, max_tokens=99999, sandbox=pool)
        await environment.reset(example, ctx)
        results = []
        for action in actions:
            results.append(await environment.step(action))
            if results[-1].terminated or results[-1].truncated:
                break
        return environment, results, [message.text for result in results for message in result.observation]

    return asyncio.run(play())


def _fix_as_edit(task: RepoTask) -> tuple[str, str]:
    """(old_string, new_string) that undo the task's mutation: the changed lines of the snapshot's file against
    the file as the package ships it, with context lines around them until the old text occurs once."""
    mutated = (task.snapshot_dir(TASKS_DIR) / task.mutation.path).read_text()
    shipped = (TASKS_DIR / ORIGINAL_DIR / task.mutation.path).read_text()
    old_lines, new_lines = mutated.splitlines(keepends=True), shipped.splitlines(keepends=True)
    opcodes = [op for op in difflib.SequenceMatcher(a=old_lines, b=new_lines).get_opcodes() if op[0] != "equal"]
    _, a_start, a_end, b_start, b_end = opcodes[0]
    assert len(opcodes) == 1 and a_start - b_start == 0  # one hunk, in place: the builder's mutations are such
    for context in range(1, 20):
        old = "".join(old_lines[max(0, a_start - context) : a_end + context])
        if mutated.count(old) == 1:
            new = "".join(new_lines[max(0, b_start - context) : b_end + context])
            return old, new
    raise AssertionError("no unique context around the mutation")


@needs_sandbox
def test_reading_and_fixing_the_mutated_function_with_edit_file_scores_1(pool: SandboxPool, task: RepoTask) -> None:
    function = task.mutation.function.split(".")[-1]
    old, new = _fix_as_edit(task)
    first = task.failing_tests[0]
    actions = [
        _call("search", pattern=f"def {function}\\b", path="h11"),
        _call("read_file", path=task.mutation.path, start_line=task.mutation.line - 5, end_line=task.mutation.line + 5),
        _call("run_tests", tests=first),
        _call("edit_file", path=task.mutation.path, old_string=old, new_string=new),
        _call("run_tests"),  # the task's whole suite, as the grader runs it
        "Fixed.",
    ]
    _, results, outputs = _episode(pool, task, actions)
    assert outputs[0].startswith(f"{task.mutation.path}:") and f"def {function}(" in outputs[0], outputs[0]
    assert outputs[1].startswith(f"{task.mutation.path}: lines {task.mutation.line - 5}-{task.mutation.line + 5} of")
    assert f"{task.mutation.line:6d}\t" in outputs[1]
    assert outputs[2].startswith("exit code: 1\n") and "1 failed" in outputs[2], outputs[2]
    assert outputs[3].startswith(f"edited {task.mutation.path}: lines "), outputs[3]
    assert outputs[4].startswith("exit code: 0\n") and f"{task.num_tests} passed" in outputs[4], outputs[4]
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0], outputs
    assert [r.info["num_solved"] for r in results] == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # sums to the solve: 1
    assert results[-1].terminated and results[-1].info["grade"] == 1.0


@needs_sandbox
def test_edit_file_on_a_test_file_gains_nothing(pool: SandboxPool, task: RepoTask) -> None:
    test_file, test_name = task.failing_tests[0].split("::")
    skipped = f"def {test_name}():\n    return\n\n\ndef _{test_name}_was("  # the failing test now passes at once
    actions = [
        _call("edit_file", path=test_file, old_string=f"def {test_name}(", new_string=skipped),
        _call("run_tests", tests=task.failing_tests[0]),
        "Done.",
    ]
    environment, results, outputs = _episode(pool, task, actions)
    assert outputs[0].startswith(f"edited {test_file}: lines "), outputs[0]
    assert outputs[1].startswith("exit code: 0\n") and "1 passed" in outputs[1], outputs[1]  # passes in the shell
    assert [r.reward for r in results] == [0.0, 0.0, 0.0] and results[-1].info["grade"] == 0.0
    assert len(environment.grades) == 1  # the graded tree is the untouched snapshot's: no suite ran


@needs_sandbox
def test_the_tools_cannot_reach_outside_the_workspace(pool: SandboxPool, task: RepoTask) -> None:
    original = str(TASKS_DIR / ORIGINAL_DIR / task.mutation.path)
    actions = [
        _call("read_file", path=original),
        _call("read_file", path=f"../{task.mutation.path}"),
        _call("search", pattern="def ", path=str(TASKS_DIR)),
        _call("search", pattern="def ", path=".."),
        _call("run_command", command="ln -s / root_link && ln -s .. up_link"),
        _call("read_file", path="root_link/etc/hostname"),
        _call("search", pattern="root", path="up_link"),
        _call("edit_file", path="../escaped.py", old_string="a", new_string="b"),
        _call("run_tests", tests=f"{original}::test_x"),
        _call("run_tests", tests="--rootdir=/ h11/tests"),
        _call("run_command", command="ls .. ; ls"),
    ]
    _, results, outputs = _episode(pool, task, actions)
    assert len(outputs) == len(actions), results[-1].info
    assert (
        outputs[0] == f"error: {original}: absolute paths are refused; give the path relative to the repository's root"
    )
    assert outputs[1] == f"error: ../{task.mutation.path}: outside the repository"
    assert (
        outputs[2] == f"error: {TASKS_DIR}: absolute paths are refused; give the path relative to the repository's root"
    )
    assert outputs[3] == "error: ..: outside the repository"
    assert outputs[5] == "error: root_link/etc/hostname: outside the repository"
    assert outputs[6] == "error: up_link: outside the repository"
    assert outputs[7] == "error: ../escaped.py: outside the repository", outputs
    assert outputs[8] == (
        f"exit code: 1\nerror: {original}: absolute paths are refused; give the path relative to the repository's root"
    )
    assert outputs[9] == "exit code: 1\nerror: --rootdir=/: options are refused; give test files, folders or node ids"
    assert "escaped.py" not in outputs[10]  # nothing was written above the workspace
    assert [r.reward for r in results] == [0.0] * len(actions)


@needs_sandbox
def test_the_tools_are_declared_and_read_in_another_call_format(pool: SandboxPool, task: RepoTask) -> None:
    environment = RepositoryEnvironment(tasks_dir=str(TASKS_DIR), parser="qwen3_coder")
    names = [spec["function"]["name"] for spec in environment.specs]
    assert names == ["run_command", "read_file", "search", "edit_file", "run_tests"]
    read = environment.specs[1]["function"]["parameters"]
    assert read["required"] == ["path"] and read["properties"]["start_line"]["type"] == "integer"
    call = (
        "<tool_call>\n<function=read_file>\n<parameter=path>\nh11/__init__.py\n</parameter>\n"
        "<parameter=start_line>\n1\n</parameter>\n<parameter=end_line>\n2\n</parameter>\n</function>\n</tool_call>"
    )
    _, _, outputs = _episode(pool, task, [call], parser="qwen3_coder")
    lines = (TASKS_DIR / ORIGINAL_DIR / "h11" / "__init__.py").read_text().splitlines()
    assert outputs == [f"h11/__init__.py: lines 1-2 of {len(lines)}\n     1\t{lines[0]}\n     2\t{lines[1]}"]


@needs_sandbox
def test_a_tools_output_is_bounded_like_a_commands(pool: SandboxPool, task: RepoTask) -> None:
    start = time.perf_counter()
    _, _, outputs = _episode(pool, task, [_call("read_file", path=task.mutation.path)], max_output_chars=500)
    size = (task.snapshot_dir(TASKS_DIR) / task.mutation.path).stat().st_size
    (output,) = outputs
    assert output.startswith(f"{task.mutation.path}: lines 1-") and "bytes of output cut" in output
    assert output.endswith("cut to its start and end]") and len(output) < 500 + 200 < size
    assert time.perf_counter() - start < 10.0
