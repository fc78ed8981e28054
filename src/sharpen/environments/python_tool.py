"""Code execution as a tool: the policy runs Python programs in the sandbox and reads what they printed.

`PythonEnvironment` is a `ToolEnvironment` with one tool, ``python(code)``, run by the episode's sandbox pool
(``EpisodeContext.sandbox``: a `SandboxPool` shared by all episodes, bounded in concurrency). The program's
status, exit code and (capped) output go back to the policy. A sandbox that fails (``sandbox_error``), or a run
without a sandbox, is an infrastructure fault: the environment raises, so the episode abstains instead of
teaching the policy that its code was wrong. The final answer is scored by the run's rubric.
"""

from __future__ import annotations

from sharpen.environments.base import EnvironmentInfraError, EpisodeContext
from sharpen.environments.sandbox import ExecutionStatus
from sharpen.environments.tool_use import ToolEnvironment
from sharpen.types import Example, Message


class SandboxFailure(EnvironmentInfraError):
    """The sandbox could not run the policy's program (not the program's fault)."""


class PythonEnvironment(ToolEnvironment):
    name = "python"
    version = "1"

    def __init__(self, *, parser: str = "hermes", max_tool_calls: int = 4, max_output_chars: int = 2000) -> None:
        super().__init__([self.python], parser=parser, max_tool_calls=max_tool_calls, max_output_chars=max_output_chars)

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        if ctx.sandbox is None:
            raise SandboxFailure("the python environment needs a sandbox (the run's [sandbox]) and got none")
        return await super().reset(example, ctx)

    async def python(self, code: str) -> str:
        """Run a Python 3 program in a sandbox (no network, nothing kept between runs) and return its output.

        Args:
            code: the whole program; print what you want to see
        """
        result = await self.context.sandbox.run_python(code)
        if result.status == ExecutionStatus.SANDBOX_ERROR:
            raise SandboxFailure(f"sandbox error: {result.detail}")
        lines = [f"status: {result.status.value}" + (f" (exit code {result.exit_code})" if result.exit_code else "")]
        if result.stdout:
            lines.append(f"stdout:\n{result.stdout.rstrip()}")
        if result.stderr:
            lines.append(f"stderr:\n{result.stderr.rstrip()}")
        if result.is_output_truncated:
            lines.append("[output truncated by the sandbox]")
        return "\n".join(lines)
