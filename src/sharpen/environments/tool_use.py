"""`ToolEnvironment`: multi-turn tool use on any example; the policy calls tools until it answers without one.

Owns the tool-use turn protocol: the system prompt that lists the tools (JSON schema), parsing each turn with the
configured parser, running the calls, returning results (or errors) as ``tool`` messages, and a cap on calls per
episode. The final answer is scored by the run's reward function (the environment gives no reward), so the same
rubric and verifiers as single-turn training apply. Subclasses add tools (`CalculatorEnvironment`,
`PythonEnvironment`); a tool may be a bound method, to reach the episode's context (its sandbox).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from sharpen.environments.base import EpisodeContext, StepResult
from sharpen.environments.tools import TOOL_CALL_PARSERS, ToolCall, ToolCallError, call_tool, tool_spec
from sharpen.types import Example, Message

TOOL_INSTRUCTIONS = """You may call tools. To call one, write a block
{call_format}
and stop; the result comes back in the next message. When you know the answer, reply without a tool call.
Tools:
{specs}"""


class ToolEnvironment:
    name = "tools"
    version = "1"

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        *,
        parser: str = "hermes",
        max_tool_calls: int = 4,
        max_output_chars: int = 2000,
    ) -> None:
        if parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r} (known: {', '.join(TOOL_CALL_PARSERS)})")
        self.tools = {tool.__name__: tool for tool in tools}
        self.specs = [tool_spec(tool) for tool in tools]  # copies of cached specs: ~5 us per tool and episode
        self.parser = TOOL_CALL_PARSERS[parser](tools=self.specs)  # formats with untyped arguments read the specs
        self.max_tool_calls = max_tool_calls
        self.max_output_chars = max_output_chars
        self.num_tool_calls = 0
        self._context: EpisodeContext | None = None

    @property
    def context(self) -> EpisodeContext:
        if self._context is None:
            raise RuntimeError(f"environment {self.name}: step() before reset()")
        return self._context

    def system_prompt(self, example: Example) -> str:
        """The example's own system prompt (if any), then the tool instructions and specs."""
        specs = "\n".join(json.dumps(spec["function"]) for spec in self.specs)
        own = [m.text for m in example.prompt if m.role == "system"]
        return "\n\n".join([*own, TOOL_INSTRUCTIONS.format(specs=specs, call_format=self.parser.call_format)])

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        self._context = ctx
        self.num_tool_calls = 0
        rest = [m for m in example.prompt if m.role != "system"]
        return [Message(role="system", content=self.system_prompt(example)), *rest]

    async def step(self, action: str) -> StepResult:
        calls = self.parser.parse(action)
        if not calls:
            return StepResult(terminated=True, info={"num_tool_calls": self.num_tool_calls})
        if self.num_tool_calls + len(calls) > self.max_tool_calls:
            return StepResult(
                truncated=True, info={"stop": "max_tool_calls", "num_tool_calls": self.num_tool_calls + len(calls)}
            )
        self.num_tool_calls += len(calls)
        outputs = [await self._run(call) for call in calls]
        calls_info = [
            {"name": c.name, "arguments": c.arguments} if isinstance(c, ToolCall) else {"error": c.message}
            for c in calls
        ]
        return StepResult(
            observation=[Message(role="tool", content=output) for output in outputs],
            info={"tool_calls": calls_info},
        )

    async def _run(self, call: ToolCall | ToolCallError) -> str:
        if isinstance(call, ToolCallError):
            return f"error: {call.message}"
        return await call_tool(self.tools, call, max_chars=self.max_output_chars)
