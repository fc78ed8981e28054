"""A repository environment: the policy fixes a real package's planted bug in a shell, and the package's own tests,
restored to their pristine state, grade the result outside the policy's sandbox.

`RepositoryEnvironment` is the terminal environment (`TerminalEnvironment`: one `SandboxShell` per episode, the
``run_command`` tool, grading after every turn, a turn's reward the change of the grade) with other tasks: the
tasks of a task set folder (`sharpen.data.repo_tasks`, built by ``sharpen tasks build``). An example carries the
task's id and its statement (the failing tests and their failure lines); never the mutation's record.

- **Tools.** Beside ``run_command``: ``read_file``, ``search``, ``edit_file`` (exact string replacement) and
  ``run_tests``, declared like it (so every tool-call format reads them). Each call runs `workspace_tools` in the
  episode's shell, on its workspace, under the command time limit and with its output cut like a command's; paths
  are relative to the workspace's root and refused outside it. Each turn's info carries ``num_solved``, the grade's
  change: summed over an episode it is 1 when the episode solved its task, so the run's
  ``env/num_solved_per_episode`` is the solve rate.

- **Workspace.** At reset the task's snapshot is read from the task set on the host and unpacked into the shell's
  private, writable home: every episode gets its own copy, discarded with the session, and nothing of one episode
  reaches another. Nothing of the task set itself (the other snapshots, ``original/``, ``tasks.jsonl`` with the
  mutations) is ever inside the sandbox: it is read on the host only. pytest is visible read-only at
  ``/opt/sharpen-pytest`` (the run's sandbox gets `pytest_ro_binds`) and on the shell's ``PYTHONPATH``.
- **Grading.** After a turn, the shell computes its source files' digest (`workspace_tools.changes`); when it is
  the last graded one nothing more crosses the session and the grade stands, else only the source files that
  differ from the pristine snapshot come back (the session's output counts against ``max_output_bytes``: a whole
  snapshot a turn ran out of it; `check_session_output` refuses a config whose worst case does not fit). They are
  merged with the pristine snapshot: the policy's version of every
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

import base64
import functools
import hashlib
import json
import logging
import random
import shlex
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from sharpen.config.environments import RepositoryEnvironmentConfig
from sharpen.data.repo_tasks import MANIFEST_FILE, RepoTask, read_repo_tasks, read_tree
from sharpen.data.sources import DataError
from sharpen.environments import workspace_tools
from sharpen.environments.base import EpisodeContext, StepResult
from sharpen.environments.pytest_suite import DRIVER_NAME, SuiteResult, read_suite_result, suite_execution
from sharpen.environments.sandbox import ExecutionStatus
from sharpen.environments.shell import MAX_SNAPSHOT_BYTES, ShellLost
from sharpen.environments.terminal import TerminalEnvironment, TerminalFailure
from sharpen.rewards.code_tests import PYTEST_PATH
from sharpen.types import Example, Message

logger = logging.getLogger(__name__)
DEFAULT_INSTRUCTIONS: str = RepositoryEnvironmentConfig.model_fields["instructions"].default
DEFAULT_TASKS_DIR: str = RepositoryEnvironmentConfig.model_fields["tasks_dir"].default
TOOL_ANSWER_BYTES = 256
"""Bound on what a tool call's answer adds to its cut output on the session: notes, the end marker line."""
GRADE_CHECK_BYTES = 256
"""Bound on a grading's answer when nothing changed (``unchanged DIGEST`` and the end marker line)."""


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
    """Whether the grader takes ``path`` from the pristine snapshot rather than from the workspace (the rule is
    `workspace_tools.is_test_path`, which also runs in the sandbox, plus the suite's driver)."""
    return workspace_tools.is_test_path(path) or PurePosixPath(path).name == DRIVER_NAME


def session_output_bound(
    *, tasks_dir: str, max_turns: int, max_tool_calls: int, max_output_chars: int
) -> tuple[int, int]:
    """Bytes an episode's shell session sends the host at most, as ``(fixed, per_graded_turn)``: ``fixed`` is
    every tool call's cut output with its notes and every turn's grading check; ``per_graded_turn`` is a graded
    turn's shipment when it changed one file as large as the task set's largest source file (uncompressed: the
    shipment is compressed). Changes the policy spreads over more or larger files are not bounded here: at run time
    such a grading is refused when it does not fit (`RepositoryEnvironment._grade`)."""
    task_set = load_task_set(tasks_dir)
    largest = max(
        (
            file.stat().st_size
            for task in task_set.tasks.values()
            for file in task.snapshot_dir(task_set.root).rglob("*")
            if file.is_file() and not is_test_path(file.relative_to(task.snapshot_dir(task_set.root)).as_posix())
        ),
        default=0,
    )
    fixed = GRADE_CHECK_BYTES * (max_turns + 1) + max_tool_calls * (max_output_chars + TOOL_ANSWER_BYTES)
    return fixed, largest + GRADE_CHECK_BYTES


def check_session_output(
    *, tasks_dir: str, max_turns: int, max_tool_calls: int, max_output_chars: int, max_output_bytes: int
) -> None:
    """ValueError (one line) when an episode's worst case (`session_output_bound`, every turn graded) does not fit
    the sandbox's ``max_output_bytes``, which ends the shell's session when passed."""
    fixed, per_turn = session_output_bound(
        tasks_dir=tasks_dir, max_turns=max_turns, max_tool_calls=max_tool_calls, max_output_chars=max_output_chars
    )
    if fixed + max_turns * per_turn > max_output_bytes:
        raise ValueError(
            f"repository: an episode's shell may send {fixed + max_turns * per_turn} bytes ({max_tool_calls} tool "
            f"outputs of {max_output_chars} + {max_turns} graded turns of {per_turn}), more than "
            f"sandbox.max_output_bytes = {max_output_bytes}: raise it or lower environment.max_turns, "
            "max_tool_calls or max_output_chars"
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
    version = "2"

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
            tools=[self.read_file, self.search, self.edit_file, self.run_tests],
        )
        self.home = ""
        """The workspace's root inside the sandbox (the shell's starting directory), where the file tools work."""
        self.task_set = load_task_set(tasks_dir)
        self.repo_task: RepoTask | None = None
        self.pristine: dict[str, bytes] = {}
        self.grades: dict[str, float] = {}
        """Grades of the trees graded in this episode, by their digest."""
        self.pristine_hashes: dict[str, str] = {}
        """sha256 of the pristine snapshot's source files (what the grader takes from the workspace), by path."""
        self.graded_digest = ""
        """`workspace_tools.source_digest` of the workspace's source files when it was last graded."""
        self.num_shipments = 0
        """Gradings of this episode that read changed files out of the sandbox (the others found nothing new)."""
        self.num_suite_runs = 0
        """Suite runs of this episode (a tree graded before is not run again)."""

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
        sources = _sources(self.pristine)
        self.pristine_hashes = {path: hashlib.sha256(data).hexdigest() for path, data in sources.items()}
        self.graded_digest = workspace_tools.source_digest(sources)
        self.num_shipments = self.num_suite_runs = 0
        return self.pristine

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        messages = await super().reset(example, ctx)
        assert self.shell is not None
        try:
            ran = await self.shell.run(
                f"export PYTHONPATH={PYTEST_PATH}; pwd", timeout_seconds=self.command_timeout_seconds, keep_bytes=1000
            )
        except ShellLost as error:  # before the policy's first action: never its doing
            raise TerminalFailure(f"the workspace's shell did not start: {error}") from None
        self.home = ran.output.strip()
        if ran.is_timed_out or ran.exit_code != 0 or not self.home.startswith("/"):
            raise TerminalFailure(f"the workspace's shell did not start as expected: {ran.output[-200:]!r}")
        return messages

    async def step(self, action: str) -> StepResult:
        result = await super().step(action)
        result.info["num_solved"] = result.reward  # the grade's change: summed over an episode, 1 solved, 0 not
        return result

    async def read_file(self, path: str, start_line: int = 1, end_line: int = 0) -> str:
        """Read a text file of the repository, its lines numbered.

        Args:
            path: the file's path relative to the repository's root, e.g. pkg/module.py
            start_line: the first line to show (1: the file's first line)
            end_line: the last line to show (0: the file's last line)
        """
        return await self._run_workspace_tool("read_file", path=path, start_line=start_line, end_line=end_line)

    async def search(self, pattern: str, path: str = ".") -> str:
        """Search the repository's text files for lines matching a regular expression (Python re, like grep -rn).

        Args:
            pattern: the regular expression, e.g. def parse_
            path: a file or folder relative to the repository's root (.: the whole repository)
        """
        return await self._run_workspace_tool("search", pattern=pattern, path=path)

    async def edit_file(self, path: str, old_string: str, new_string: str) -> str:
        """Edit a file: replace the exact text old_string, which must occur exactly once in it, by new_string.

        Args:
            path: the file's path relative to the repository's root
            old_string: the exact text to replace, whitespace and indentation included (a few lines, unique)
            new_string: the text to put in its place
        """
        return await self._run_workspace_tool("edit_file", path=path, old_string=old_string, new_string=new_string)

    async def run_tests(self, tests: str = "") -> str:
        """Run the repository's tests with pytest and return its report.

        Args:
            tests: test files, folders or node ids (path::test_name) separated by spaces; empty: the whole suite
        """
        task_set = self.task_set
        arguments = {"tests": tests.split(), "ignore": list(task_set.ignore), "deselect": list(task_set.deselect)}
        return await self._run_workspace_tool("run_tests", **arguments, pytest_path=PYTEST_PATH)

    def _tool_command(self, tool: str, arguments: Mapping[str, object]) -> str:
        request = base64.b64encode(json.dumps({"tool": tool, "arguments": arguments}).encode()).decode()
        python = self.context.sandbox.config.python_executable
        return f"{python} -I -c {shlex.quote(_tool_source())} {shlex.quote(self.home)} <<'EOF'\n{request}\nEOF"

    async def _run_workspace_tool(self, tool: str, **arguments: object) -> str:
        """Run one call of `workspace_tools` in the episode's shell, on its workspace (never on the host)."""
        ran = await self.run_in_shell(
            self._tool_command(tool, arguments), ended="error: the shell has ended; the workspace is gone"
        )
        if isinstance(ran, str):
            return ran
        if ran.is_timed_out:
            return f"error: {tool} ran past its {self.command_timeout_seconds:g} s limit and was stopped"
        output = f"exit code: {ran.exit_code}\n{ran.output}" if tool == "run_tests" else ran.output
        if ran.is_truncated:
            output += f"\n[output of {ran.num_output_bytes} bytes, cut to its start and end]"
        return output

    async def _grade(self) -> float:
        """The grade of the workspace now, reading as little of it as possible through the session (whose output
        counts against the sandbox's ``max_output_bytes``): the `workspace_tools.changes` call in the shell answers
        with its source files' digest alone when that is the last graded one (the grade stands, nothing more
        crosses), else with the source files that differ from the pristine snapshot, which are graded. A
        shipment that does not fit what is left of the budget is the policy's doing (the config's worst case leaves
        each turn room for the task set's largest source file, `check_session_output`, so only changes larger than
        that use it up): its shell is ended and the last grade stands, as when its own commands kill the shell. It
        is never an abstention, which a policy could otherwise reach on purpose by bloating its workspace."""
        assert self.shell is not None
        budget = self.context.sandbox.config.max_output_bytes
        room = budget - self.shell.num_received_bytes - GRADE_CHECK_BYTES
        arguments = {"known": self.pristine_hashes, "last": self.graded_digest, "limit": max(room, 0)}
        try:
            ran = await self.shell.run(
                self._tool_command("changes", arguments),
                timeout_seconds=self.command_timeout_seconds,
                keep_bytes=max(room, 0) + GRADE_CHECK_BYTES,
            )
        except ShellLost as error:
            self._lose(error)  # raises TerminalFailure when it was not the policy's doing
            return self.grade
        kind, _, rest = ran.output.strip().partition(" ")
        if ran.is_timed_out or ran.exit_code != 0 or kind not in ("unchanged", "changed", "too_large"):
            return await self._lose_workspace(f"the workspace could not be read for grading: {ran.output[-200:]!r}")
        if kind == "unchanged":
            return self.grade
        if kind == "too_large":
            size = int(rest.split()[1])
            return await self._lose_workspace(
                f"grading needs {size} bytes of the shell session's output and {max(room, 0)} are left of "
                f"sandbox.max_output_bytes = {budget}"
            )
        self.num_shipments += 1
        workspace = self._apply_changes(rest.partition(" ")[2])
        if workspace is None:
            return await self._lose_workspace("the workspace's changes could not be read")
        self.graded_digest = workspace_tools.source_digest(_sources(workspace))
        return await self.check_workspace(workspace)

    def _apply_changes(self, payload: str) -> dict[str, bytes] | None:
        """The pristine snapshot with a `workspace_tools.changes` payload applied (None when it is not one)."""
        try:
            inflater = zlib.decompressobj()
            text = inflater.decompress(base64.b64decode(payload, validate=True), MAX_SNAPSHOT_BYTES)
            if inflater.unconsumed_tail:
                return None  # more than a snapshot may hold
            shipped = json.loads(text)
            workspace = {path: data for path, data in self.pristine.items() if path not in set(shipped["deleted"])}
            workspace.update({path: data.encode("latin-1") for path, data in shipped["changed"].items()})
        except (ValueError, TypeError, KeyError, AttributeError, zlib.error):
            return None
        return workspace

    async def _lose_workspace(self, message: str) -> float:
        """The policy's workspace cannot be graded any more (``message`` says why): its shell is ended and the
        last grade stands."""
        logger.info("repository: the episode's shell is ended: %s", message)
        self.is_shell_lost = True
        if self.shell is not None:
            await self.shell.close()
        return self.grade

    async def check_workspace(self, files: Mapping[str, bytes]) -> float:
        assert self.repo_task is not None
        tree = graded_tree(self.pristine, files)
        key = _digest(tree)
        if key not in self.grades:
            self.num_suite_runs += 1
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


@functools.cache
def _tool_source() -> str:
    return Path(workspace_tools.__file__).read_text()


def _is_bytecode(path: str) -> bool:
    return workspace_tools.is_bytecode(path)


def _sources(files: Mapping[str, bytes]) -> dict[str, bytes]:
    """The files the grader takes from a workspace, as `workspace_tools.source_files` reads them in the sandbox."""
    return {
        path: data for path, data in files.items() if not workspace_tools.is_test_path(path) and not _is_bytecode(path)
    }


def _digest(tree: Mapping[str, bytes]) -> str:
    hasher = hashlib.sha256()
    for path, data in tree.items():
        hasher.update(f"{path}\0{len(data)}\0".encode())
        hasher.update(data)
    return hasher.hexdigest()
