"""A terminal environment: the policy works in a persistent shell in the sandbox, one per episode, and a task's
checker grades the workspace it leaves.

`TerminalEnvironment` is a `ToolEnvironment` with one tool, ``run_command(command)``, read with the configured
tool-call parser. At reset it builds the example's task (`terminal_tasks`, from the task's name and seed) and
starts the episode's `SandboxShell` on the run's sandbox with the task's files as its workspace; each call runs one
command there, under ``command_timeout_seconds`` (at the limit the command's process group is killed and the shell
kept: see shell.py), its output cut to ``max_output_chars`` (head and tail). The working directory, the exported
variables and the files carry over between calls; nothing carries over between episodes. The episode ends when
the policy answers without a tool call, at ``max_turns``, or after ``max_tool_calls``.

Scoring: after every turn the task's checker grades a snapshot of the workspace, outside the policy's shell (on
the host for a file check, in a separate sandbox execution for a `SandboxCheck`, whose hidden files the shell
never sees); the turn's reward is the change of that grade, so an episode's rewards sum to the grade of its last
graded turn (1 solved, 0 not) however the episode ends, even when the episode loop cuts it for its token budget
without telling the environment. A shell the policy's own commands killed ends the episode with the grade it
had; a sandbox that failed, or a session cut by the sandbox's wall clock or its output budget, is an
infrastructure fault (the episode abstains).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sharpen.config.environments import TerminalEnvironmentConfig
from sharpen.environments.base import EnvironmentInfraError, EpisodeContext, StepResult
from sharpen.environments.sandbox import ExecutionStatus
from sharpen.environments.shell import CommandResult, SandboxShell, ShellLost, is_infrastructure_loss
from sharpen.environments.terminal_tasks import (
    TERMINAL_TASKS,
    SandboxCheck,
    TerminalTask,
    build_terminal_task,
)
from sharpen.environments.tool_use import ToolEnvironment
from sharpen.types import Example, Message

DEFAULT_INSTRUCTIONS: str = TerminalEnvironmentConfig.model_fields["instructions"].default
_NOTE_CHARS = 200
"""Room for the exit-status line and the notes beside a command's (already cut) output."""


class TerminalFailure(EnvironmentInfraError):
    """The sandbox could not run the episode's shell or its checker (not the policy's fault)."""


class TerminalEnvironment(ToolEnvironment):
    name = "terminal"
    version = "1"

    def __init__(
        self,
        *,
        parser: str = "hermes",
        max_tool_calls: int = 16,
        max_output_chars: int = 2000,
        command_timeout_seconds: float = 10.0,
        instructions: str = DEFAULT_INSTRUCTIONS,
        tools: Sequence[Callable[..., Any]] = (),
    ) -> None:
        super().__init__(
            [self.run_command, *tools],  # ``tools``: a subclass's own, beside the shell (the repository's file tools)
            parser=parser,
            max_tool_calls=max_tool_calls,
            max_output_chars=max_output_chars + _NOTE_CHARS,
        )
        self.keep_bytes = max_output_chars
        self.command_timeout_seconds = command_timeout_seconds
        self.instructions = instructions
        self.task: TerminalTask | None = None
        self.shell: SandboxShell | None = None
        self.grade = 0.0
        self.num_turns = 0
        self.is_shell_lost = False

    @staticmethod
    def make_tasks(num_tasks: int, *, seed: int, tasks: list[str]) -> list[Example]:
        """``num_tasks`` tasks cycling through ``tasks`` (empty: the whole set), each with its own seed drawn from
        ``seed``; an example carries the task's name and seed, never its expected outcome."""
        names = tasks or list(TERMINAL_TASKS)
        unknown = [name for name in names if name not in TERMINAL_TASKS]
        if unknown:
            raise ValueError(f"unknown terminal tasks {unknown} (known: {', '.join(TERMINAL_TASKS)})")
        rng = random.Random(seed)
        examples = []
        for index in range(num_tasks):
            name, task_seed = names[index % len(names)], rng.randrange(1 << 31)
            task = build_terminal_task(name, task_seed)
            examples.append(
                Example(
                    task_key=f"terminal/{name}/{index}",
                    prompt=(Message(role="user", content=task.instructions),),
                    metadata={"source": "terminal", "task": name, "task_seed": task_seed},
                )
            )
        return examples

    def system_prompt(self, example: Example) -> str:
        return "\n\n".join([self.instructions, super().system_prompt(example)])

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        if ctx.sandbox is None:
            raise TerminalFailure("the terminal environment needs a sandbox (the run's [sandbox]) and got none")
        files = self.load_task(example)
        messages = await super().reset(example, ctx)
        self.grade, self.num_turns, self.is_shell_lost = 0.0, 0, False
        self.shell = await SandboxShell.start(ctx.sandbox.sandbox, files)
        return messages

    def load_task(self, example: Example) -> Mapping[str, str | bytes]:
        """Build the example's task (kept for grading) and return the workspace's seed files. A subclass with
        other tasks overrides this and `check_workspace` (the repository environment does)."""
        name, task_seed = example.metadata.get("task"), example.metadata.get("task_seed")
        if not isinstance(name, str) or not isinstance(task_seed, int):
            raise ValueError(f"terminal: example {example.task_key} has no task and task_seed in its metadata")
        self.task = build_terminal_task(name, task_seed)
        return self.task.files

    async def step(self, action: str) -> StepResult:
        result = await super().step(action)
        self.num_turns += 1
        previous = self.grade
        if not self.is_shell_lost:
            self.grade = await self._grade()
        if self.is_shell_lost:  # by a command of this turn, or while grading it
            result = StepResult(truncated=True, info={**result.info, "stop": "shell_lost"})
        result.reward = self.grade - previous  # never None: the rubric must not score a terminal episode
        result.info["grade"] = self.grade
        if result.terminated or result.truncated or self.num_turns >= self.context.max_turns:
            await self._close_shell()
        return result

    async def run_command(self, command: str) -> str:
        """Run a bash command in your working directory and return its exit code and output (stdout and stderr).

        Args:
            command: the command line (several lines are allowed, e.g. a here-document)
        """
        ran = await self.run_in_shell(command, ended="error: the shell has ended; no more commands can run")
        if isinstance(ran, str):
            return ran
        if ran.is_timed_out:
            head = (
                f"error: the command ran past its {self.command_timeout_seconds:g} s limit and was killed "
                "(the shell is kept; its working directory is as before the command)"
            )
        else:
            head = f"exit code: {ran.exit_code}"
        if ran.is_truncated:
            head += f" (output of {ran.num_output_bytes} bytes, cut to its start and end)"
        return f"{head}\n{ran.output}" if ran.output else head

    async def run_in_shell(self, command: str, *, ended: str) -> CommandResult | str:
        """``command`` in the episode's shell under the command limits (time, output kept), or the policy's answer
        instead: ``ended`` when the shell is gone, the loss's line when it is lost now (`_lose`)."""
        if self.shell is None or self.is_shell_lost:
            return ended
        try:
            return await self.shell.run(
                command, timeout_seconds=self.command_timeout_seconds, keep_bytes=self.keep_bytes
            )
        except ShellLost as error:
            return self._lose(error)

    def _lose(self, error: ShellLost) -> str:
        if is_infrastructure_loss(error):
            raise TerminalFailure(f"the episode's shell was lost: {error}") from None
        self.is_shell_lost = True
        return f"error: {error}; the workspace is gone"

    async def _grade(self) -> float:
        """1.0 when the task's checker passes on the workspace now, else 0.0."""
        assert self.shell is not None
        try:
            files = await self.shell.snapshot()
        except ShellLost as error:
            self._lose(error)
            return self.grade  # the workspace is gone: the last grade stands
        return await self.check_workspace(files)

    async def check_workspace(self, files: Mapping[str, bytes]) -> float:
        """The grade of a snapshot of the workspace, outside the shell: 1.0 when the task's checker passes."""
        assert self.task is not None
        check = self.task.check
        if not isinstance(check, SandboxCheck):
            return float(check(files))
        return float(await self._run_sandbox_check(check, files))

    async def _run_sandbox_check(self, check: SandboxCheck, files: Mapping[str, bytes]) -> bool:
        staged: dict[str, str | bytes] = {f"workspace/{name}": data for name, data in files.items()}
        staged.update({f"checker/{name}": text for name, text in check.files.items()})
        result = await self.context.sandbox.run(list(check.argv), files=staged)
        if result.status == ExecutionStatus.SANDBOX_ERROR:
            raise TerminalFailure(f"the task's checker could not run: {result.detail}")
        return result.status == ExecutionStatus.OK and result.exit_code == 0

    async def _close_shell(self) -> None:
        if self.shell is not None:
            await self.shell.close()
