"""`BrowserEnvironment`: MiniWoB++ web tasks in a pooled headless Chromium, acted on with tool calls.

Owns the episode: the prompt (the tools, the task's instruction and the page: as text with element ids, as a
screenshot of the task area, or both), reading each turn's tool calls with the framework's parser
(`sharpen.environments.tools`), running them on a browser lent by the `BrowserPool`, and the reward (the task's own:
1 solved, 0 failed; MiniWoB's -1 for a wrong answer becomes 0 and its time discount is not applied). A turn without a
valid action gets an error message back, not an end. The task instance is drawn from the example's seed, so every
sample of a group sees the same page and `sharpen replay` sees it again (its screenshots too: the page is kept still,
see `page.start_task`). It does not start, wipe or kill browsers (the pool does: a browser that another episode
used is wiped before this one's call runs on it, `sharpen.environments.browser.isolation`) and does not touch pages
directly (`sharpen.environments.browser.page`).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from typing import Any, Literal

from sharpen.environments.base import EpisodeContext, StepResult
from sharpen.environments.browser import page
from sharpen.environments.browser.pool import BrowserPool, Lease
from sharpen.environments.tools import TOOL_CALL_PARSERS, ToolCall, ToolCallError, call_tool, tool_spec
from sharpen.types import ContentPart, Example, ImagePart, Message, TextPart

INSTRUCTIONS = """You control a web page. Each element has an id in brackets, like [3]. Act with one tool call:
<tool_call>{{"name": "click", "arguments": {{"id": 3}}}}</tool_call>
Tools:
{specs}"""

SCREENSHOT_INSTRUCTIONS = """You control a web page, shown as a screenshot. Point at things by their pixel coordinates
in the screenshot: x to the right and y down from its top-left corner. Act with one tool call:
<tool_call>{{"name": "click_at", "arguments": {{"x": 80, "y": 120}}}}</tool_call>
Tools:
{specs}"""

BOTH_INSTRUCTIONS = """You control a web page, shown as a screenshot and as text where each element has an id in
brackets, like [3]. Act with one tool call:
<tool_call>{{"name": "click", "arguments": {{"id": 3}}}}</tool_call>
Tools:
{specs}"""

Observation = Literal["text", "screenshot", "both"]
Content = str | tuple[ContentPart, ...]


DEMONSTRATION = (
    Message(
        role="user",
        content='Task: Click on the "Okay" button.\nPage:\n[1] div "lorem ipsum"\n[2] button "Cancel"\n'
        '[3] button "Okay"',
    ),
    Message(role="assistant", content='<tool_call>{"name": "click", "arguments": {"id": 3}}</tool_call>'),
)
"""A worked example shown before the task when asked for (``demonstration``): the action format, by example."""


class BrowserEnvironment:
    name = "browser"
    version = "1"

    def __init__(
        self,
        *,
        pool: BrowserPool,
        parser: str = "hermes",
        max_page_chars: int = 2000,
        instructions: str = "",
        demonstration: bool = False,
        observation: Observation = "text",
    ) -> None:
        if parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r} (known: {', '.join(TOOL_CALL_PARSERS)})")
        if observation not in ("text", "screenshot", "both"):
            raise ValueError(f"unknown browser observation {observation!r} (known: text, screenshot, both)")
        if demonstration and observation == "screenshot":
            raise ValueError("the browser's demonstration shows a page as text; it needs observation text or both")
        self.pool = pool
        self.max_page_chars = max_page_chars
        self.instructions = instructions
        self.demonstration = demonstration
        self.observation = observation
        # without element ids (a screenshot alone) the policy points at pixels
        pointing = (self.click_at, self.type_at) if observation == "screenshot" else (self.click, self.type)
        self.tools = {t.__name__: t for t in (*pointing, self.press, self.scroll, self.done)}
        self.parser = TOOL_CALL_PARSERS[parser](tools=[tool_spec(t) for t in self.tools.values()])
        self._url = ""
        self._seed = 0
        self._turns: list[list[ToolCall]] = []
        """The calls of every finished turn: enough to rebuild the page on another browser."""
        self._lease: Lease | None = None
        self._is_done_called = False
        self._num_restores = 0
        """Turns that found the page gone (another episode had the browser) and rebuilt it first."""

    @staticmethod
    def make_tasks(num_tasks: int, *, seed: int, tasks: list[str]) -> list[Example]:
        """``num_tasks`` task instances, cycling through ``tasks``, each with its own page seed drawn from ``seed``."""
        for task in tasks:
            page.task_url(task)  # an unknown task fails here, with the names of known ones
        rng = random.Random(seed)
        examples = []
        for index in range(num_tasks):
            task, page_seed = tasks[index % len(tasks)], rng.getrandbits(31)
            # the prompt names the instance (the episode's real prompt is the page, shown by reset)
            prompt = (Message(role="user", content=f"MiniWoB task {task}, instance {page_seed}"),)
            metadata = {"source": "miniwob", "task": task, "seed": page_seed}
            examples.append(Example(task_key=f"browser/{task}/{index}", prompt=prompt, metadata=metadata))
        return examples

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        task = example.metadata.get("task")
        if not isinstance(task, str):
            raise ValueError(f"browser: example {example.task_key} names no MiniWoB task (metadata 'task')")
        self._url = page.task_url(task)
        seed = example.metadata.get("seed")
        self._seed = int(seed) if isinstance(seed, int) else ctx.seed % (1 << 31)
        self._turns = []
        self._is_done_called = False
        self._num_restores = 0
        # a new episode starts on a wiped browser, even one that served this environment's last episode
        async with self.pool.lease(self, is_new_episode=True) as lease:
            seen = await self._restore(lease)
            shown, _ = await self._show(lease, seen)
        instructions = {"text": INSTRUCTIONS, "screenshot": SCREENSHOT_INSTRUCTIONS, "both": BOTH_INSTRUCTIONS}
        system = self.instructions or instructions[self.observation].format(specs=self._specs())
        demonstration = list(DEMONSTRATION) if self.demonstration else []
        return [Message(role="system", content=system), *demonstration, Message(role="user", content=shown)]

    async def step(self, action: str) -> StepResult:
        started, num_restores_before = time.perf_counter(), self._num_restores
        calls: list[ToolCall | ToolCallError] = self.parser.parse(action)
        if not calls:
            calls = [ToolCallError(message="no tool call found; act with one <tool_call>...</tool_call> block")]
        async with self.pool.lease(self) as lease:
            if lease.browser.owner is not self:  # another episode used this browser since: rebuild the page
                await self._restore(lease)
                self._num_restores += 1
            self._lease = lease
            try:
                outputs, executed = await self._run_calls(calls)
            finally:
                self._lease = None
            self._turns.append(executed)
            outcome = await lease.run(page.read_outcome)
            is_over = outcome.is_done or self._is_done_called
            shown, screenshot_seconds = None, 0.0
            if is_over:
                lease.browser.owner = None  # the first browser to give to a new episode
            else:
                seen = await lease.run(page.read_page)
                shown, screenshot_seconds = await self._show(lease, seen, feedback="\n".join(outputs))
        num_invalid = sum(output.startswith("error:") for output in outputs)
        info: dict[str, Any] = {
            "actions": [c.name if isinstance(c, ToolCall) else "invalid" for c in calls],
            "num_actions": len(calls),
            "num_invalid_actions": num_invalid,
            "step_seconds": round(time.perf_counter() - started, 4),
            "num_page_restores": self._num_restores - num_restores_before,
        }
        if is_over:
            reward = max(outcome.raw_reward, 0.0) if outcome.is_done else 0.0
            info["task_reward"] = outcome.raw_reward if outcome.is_done else None
            return StepResult(reward=reward, terminated=True, info=info)
        assert shown is not None, "a page is shown unless the episode is over"
        observation = Message(role="user", content=shown)
        if self.observation != "text":  # `sharpen replay` compares the digests; the metrics show the cost
            info["image_sha256"] = [hashlib.sha256(image.data).hexdigest() for image in observation.images]
            info["screenshot_seconds"] = screenshot_seconds
        return StepResult(observation=[observation], reward=0.0, info=info)

    async def _show(self, lease: Lease, seen: page.PageText, *, feedback: str | None = None) -> tuple[Content, float]:
        """What the policy is shown of the page ``seen``, after the turn's ``feedback``: the page's text, or the task
        and a screenshot, or both; and the seconds the screenshot took."""
        head = "" if feedback is None else f"{feedback}\n\n"
        if self.observation == "text":
            return head + seen.render(max_chars=self.max_page_chars), 0.0
        started = time.perf_counter()
        screenshot = ImagePart(data=await lease.run(page.screenshot))
        seconds = round(time.perf_counter() - started, 4)
        text = seen.render(max_chars=self.max_page_chars) if self.observation == "both" else f"Task: {seen.task}"
        return (TextPart(text=f"{head}{text}\n"), screenshot), seconds

    async def _run_calls(self, calls: list[ToolCall | ToolCallError]) -> tuple[list[str], list[ToolCall]]:
        outputs: list[str] = []
        executed: list[ToolCall] = []
        for call in calls:
            if isinstance(call, ToolCallError):
                outputs.append(f"error: {call.message}")
                continue
            outputs.append(await call_tool(self.tools, call, max_chars=self.max_page_chars))
            executed.append(call)
            if self._is_done_called or (await self._current().run(page.read_outcome)).is_done:
                break  # the task is over: later calls of the turn would act on the next instance
        return outputs, executed

    async def _restore(self, lease: Lease) -> page.PageText:
        """Show this episode's page on ``lease``'s browser: its seeded instance, then its turns so far, reading the
        page after each (reading gives new elements their ids, so ids come out as they did the first time)."""
        is_still = self.observation != "text"
        await lease.run(lambda driver: page.start_task(driver, self._url, self._seed, is_still=is_still))
        lease.browser.owner = self
        seen = await lease.run(page.read_page)
        self._lease = lease
        try:
            for turn in self._turns:
                for call in turn:
                    await call_tool(self.tools, call, max_chars=self.max_page_chars)
                seen = await lease.run(page.read_page)
        finally:
            self._lease = None
        return seen

    def _current(self) -> Lease:
        assert self._lease is not None, "tools run only inside a step"
        return self._lease

    def _specs(self) -> str:
        return "\n".join(json.dumps(tool_spec(tool)["function"]) for tool in self.tools.values())

    # The tools: their names, docstrings and signatures are what the policy is shown (`tool_spec`).

    async def click(self, id: int) -> str:
        """Click an element.

        Args:
            id: The element's id, from the brackets."""
        return await self._current().run(lambda driver: page.click(driver, id))

    async def type(self, id: int, text: str) -> str:
        """Click an input element and type text into it.

        Args:
            id: The element's id, from the brackets.
            text: What to type."""
        return await self._current().run(lambda driver: page.type_text(driver, id, text))

    async def click_at(self, x: int, y: int) -> str:
        """Click a point of the screenshot.

        Args:
            x: Pixels from the screenshot's left edge.
            y: Pixels from the screenshot's top edge."""
        return await self._current().run(lambda driver: page.click_at(driver, x, y))

    async def type_at(self, x: int, y: int, text: str) -> str:
        """Click a point of the screenshot (an input field) and type text.

        Args:
            x: Pixels from the screenshot's left edge.
            y: Pixels from the screenshot's top edge.
            text: What to type."""
        return await self._current().run(lambda driver: page.type_at(driver, x, y, text))

    async def press(self, key: str) -> str:
        """Press a key (Enter, Tab, Backspace, Escape, an arrow key such as ArrowDown, or one character).

        Args:
            key: The key's name."""
        return await self._current().run(lambda driver: page.press(driver, key))

    async def scroll(self, dx: int, dy: int) -> str:
        """Scroll the page by a number of pixels.

        Args:
            dx: Pixels to the right (negative: left).
            dy: Pixels down (negative: up)."""
        return await self._current().run(lambda driver: page.scroll(driver, dx, dy))

    async def done(self) -> str:
        """Finish the episode (when the task is complete or cannot be done)."""
        self._is_done_called = True
        return "done"
