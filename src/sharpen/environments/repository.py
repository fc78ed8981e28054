"""A repository environment: the policy fixes a real package's planted bug in a shell, and the package's own tests,
restored to their pristine state, grade the result outside the policy's sandbox.

`RepositoryEnvironment` is the terminal environment (`TerminalEnvironment`: one `SandboxShell` per episode, the
``run_command`` tool, grading after every turn, a turn's reward the change of the grade) with other tasks: the
tasks of a task set folder (`sharpen.data.repo_tasks`, built by ``sharpen tasks build``). An example carries the
task's id and its statement (the failing tests and their failure lines); never the mutation's record.

- **Workspace.** At reset the task's snapshot is read from the task set on the host and unpacked into the shell's
  private, writable home: every episode gets its own copy, discarded with the session, and nothing of one episode
  reaches another. Nothing of the task set itself (the other snapshots, ``original/``, ``tasks.jsonl`` with the
  mutations) is ever inside the sandbox: it is read on the host only. pytest is visible read-only at
  ``/opt/sharpen-pytest`` (the run's sandbox gets `pytest_ro_binds`) and on the shell's ``PYTHONPATH``.
- **Grading.** A snapshot of the workspace is merged with the pristine snapshot: the policy's version of every
  source file, the task set's version of every test file and test configuration (`is_test_path`: test folders,
  ``test_*.py``, ``conftest.py``, the root's pytest configuration files); test files the policy added or deleted
  are ignored, and bytecode is dropped (an unchecked ``.pyc`` could stand in for a test). The merged tree runs
  the suite (`sharpen.environments.pytest_suite`, as the builder ran it, with the set's ignored and deselected
  tests) in a fresh sandbox execution under the set's suite time limit. The grade is 1 when the run is complete,
  no test fails, every one of the task's failing tests passed and as many tests passed as the task has; else 0.
  So editing or deleting the tests gains nothing: they are put back and the bug still fails them. A tree graded
  before is not run again (the grade of the untouched snapshot, 0, is known from the start).

It does not build tasks (``sharpen.tasks``) and does not read the mutation's record (it is for checking only).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from sharpen.config.environments import RepositoryEnvironmentConfig
from sharpen.data.repo_tasks import MANIFEST_FILE, RepoTask, read_repo_tasks, read_tree
from sharpen.data.sources import DataError
from sharpen.environments.base import EpisodeContext
from sharpen.environments.pytest_suite import DRIVER_NAME, SuiteResult, read_suite_result, suite_execution
from sharpen.environments.sandbox import ExecutionStatus
from sharpen.environments.terminal import TerminalEnvironment, TerminalFailure
from sharpen.rewards.code_tests import PYTEST_PATH
from sharpen.types import Example, Message

DEFAULT_INSTRUCTIONS: str = RepositoryEnvironmentConfig.model_fields["instructions"].default
DEFAULT_TASKS_DIR: str = RepositoryEnvironmentConfig.model_fields["tasks_dir"].default
TEST_FOLDERS = frozenset({"tests", "test", "testing"})
TEST_CONFIG_FILES = frozenset({"pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "conftest.py"})
"""Files at the repository's root that shape how pytest collects and runs: restored like the tests."""


@dataclass(kw_only=True, slots=True, frozen=True)
class RepoTaskSet:
    """A task set as the environment uses it: its records by id and how its suite is run."""

    root: Path
    tasks: dict[str, RepoTask]
    ignore: tuple[str, ...]
    deselect: tuple[str, ...]
    suite_wall_seconds: float


@functools.cache
def load_task_set(root: str) -> RepoTaskSet:
    """The task set at ``root`` (read once per process); DataError (one line) when it is not one."""
    path = Path(root).resolve()
    tasks = read_repo_tasks(path)
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        ignore, deselect = tuple(manifest["ignored"]), tuple(manifest["deselected"])
        wall_seconds = float(manifest["suite_wall_seconds"])
    except (OSError, ValueError, KeyError) as error:
        raise DataError(f"{path}: the task set's {MANIFEST_FILE} cannot be read ({error})") from None
    return RepoTaskSet(
        root=path,
        tasks={task.id: task for task in tasks},
        ignore=ignore,
        deselect=deselect,
        suite_wall_seconds=wall_seconds,
    )


def is_test_path(path: str) -> bool:
    """Whether the grader takes ``path`` from the pristine snapshot rather than from the workspace."""
    parts = PurePosixPath(path).parts
    name = parts[-1] if parts else ""
    return (
        any(part in TEST_FOLDERS for part in parts[:-1])
        or name.startswith("test_")
        or name.endswith("_test.py")
        or name == "conftest.py"
        or (len(parts) == 1 and name in TEST_CONFIG_FILES)
        or name == DRIVER_NAME
    )


def graded_tree(pristine: Mapping[str, bytes], workspace: Mapping[str, bytes]) -> dict[str, bytes]:
    """What the grader runs: the workspace's source files, the pristine test files, no bytecode."""
    tree = {path: data for path, data in workspace.items() if not is_test_path(path) and not _is_bytecode(path)}
    tree.update({path: data for path, data in pristine.items() if is_test_path(path)})
    return dict(sorted(tree.items()))


def is_fixed(task: RepoTask, suite: SuiteResult) -> bool:
    """The task's failing tests pass and every other test still does."""
    passed = set(suite.passed)
    return (
        suite.is_complete
        and not suite.failed
        and passed.issuperset(task.failing_tests)
        and len(passed) >= task.num_tests
    )


class RepositoryEnvironment(TerminalEnvironment):
    name = "repository"
    version = "1"

    def __init__(
        self,
        *,
        tasks_dir: str = DEFAULT_TASKS_DIR,
        parser: str = "hermes",
        max_tool_calls: int = 32,
        max_output_chars: int = 4000,
        command_timeout_seconds: float = 30.0,
        instructions: str = DEFAULT_INSTRUCTIONS,
    ) -> None:
        super().__init__(
            parser=parser,
            max_tool_calls=max_tool_calls,
            max_output_chars=max_output_chars,
            command_timeout_seconds=command_timeout_seconds,
            instructions=instructions,
        )
        self.task_set = load_task_set(tasks_dir)
        self.repo_task: RepoTask | None = None
        self.pristine: dict[str, bytes] = {}
        self.grades: dict[str, float] = {}
        """Grades of the trees graded in this episode, by their digest."""

    @staticmethod
    def make_tasks(num_tasks: int, *, seed: int, tasks_dir: str, task_ids: list[str]) -> list[Example]:
        """``num_tasks`` examples cycling through ``task_ids`` (empty: every task of the set) in an order drawn
        from ``seed``; an example carries the task's id and statement, nothing of its mutation."""
        task_set = load_task_set(tasks_dir)
        ids = task_ids or list(task_set.tasks)
        unknown = [task_id for task_id in ids if task_id not in task_set.tasks]
        if unknown:
            raise ValueError(f"tasks not in {task_set.root}: {unknown} (known: {', '.join(task_set.tasks)})")
        random.Random(seed).shuffle(ids)
        examples = []
        for index in range(num_tasks):
            task = task_set.tasks[ids[index % len(ids)]]
            examples.append(
                Example(
                    task_key=f"repository/{task.id}/{index}",
                    prompt=(Message(role="user", content=task.statement),),
                    metadata={"source": "repository", "task_id": task.id},
                )
            )
        return examples

    def load_task(self, example: Example) -> Mapping[str, str | bytes]:
        task_id = example.metadata.get("task_id")
        if not isinstance(task_id, str) or task_id not in self.task_set.tasks:
            raise ValueError(f"repository: example {example.task_key} names no task of {self.task_set.root}")
        self.repo_task = self.task_set.tasks[task_id]
        self.pristine = read_tree(self.repo_task.snapshot_dir(self.task_set.root))
        self.grades = {_digest(graded_tree(self.pristine, self.pristine)): 0.0}  # the bug fails its tests
        return self.pristine

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        messages = await super().reset(example, ctx)
        assert self.shell is not None
        await self.shell.run(f"export PYTHONPATH={PYTEST_PATH}", timeout_seconds=5.0, keep_bytes=1000)
        return messages

    async def check_workspace(self, files: Mapping[str, bytes]) -> float:
        assert self.repo_task is not None
        tree = graded_tree(self.pristine, files)
        key = _digest(tree)
        if key not in self.grades:
            self.grades[key] = float(is_fixed(self.repo_task, await self.run_suite(tree)))
        return self.grades[key]

    async def run_suite(self, tree: Mapping[str, bytes]) -> SuiteResult:
        """The task set's suite on ``tree``, in a fresh sandbox execution, cut at the set's suite time limit."""
        pool = self.context.sandbox
        task_set = self.task_set
        execution = suite_execution(
            pool.config.python_executable, tree, deselect=task_set.deselect, ignore=task_set.ignore
        )
        limit = ["timeout", "-s", "KILL", f"{task_set.suite_wall_seconds:g}"]
        result = await pool.run([*limit, *execution.argv], files=execution.files, stdin=execution.stdin)
        if result.status == ExecutionStatus.SANDBOX_ERROR:
            raise TerminalFailure(f"the task's tests could not run: {result.detail}")
        return read_suite_result(result, execution)


def _is_bytecode(path: str) -> bool:
    return "__pycache__" in PurePosixPath(path).parts or path.endswith((".pyc", ".pyo"))


def _digest(tree: Mapping[str, bytes]) -> str:
    hasher = hashlib.sha256()
    for path, data in tree.items():
        hasher.update(f"{path}\0{len(data)}\0".encode())
        hasher.update(data)
    return hasher.hexdigest()
