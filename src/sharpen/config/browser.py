"""The browser environment's section (``environment.type = "browser"``): MiniWoB++ tasks in headless Chromium.

Pydantic only. Task names are checked against the installed ``miniwob`` package when the environment is built
(`sharpen.environments.registry`), not here.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from sharpen.config.episodes import EpisodeLimitsSection, ToolParserName

_TASK_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")


class BrowserEnvironmentConfig(EpisodeLimitsSection):
    """Web tasks of MiniWoB++ (the ``miniwob`` package's local pages; needs ``pip install 'sharpen[browser]'`` and
    the Debian packages chromium and chromium-driver). The policy sees the task and the page (as text with element
    ids, as a screenshot, or both) and acts with tool calls: ``click(id)``, ``type(id, text)`` (``click_at(x, y)``,
    ``type_at(x, y, text)`` on a screenshot alone), ``press(key)``, ``scroll(dx, dy)``, ``done()``. The reward is the
    task's own: 1 solved, 0 failed."""

    type: Literal["browser"] = "browser"
    max_turns: int = Field(default=4, ge=1)
    """Policy turns per episode (each turn's token limit is rollout.max_new_tokens)."""
    tasks: list[str] = Field(default_factory=lambda: ["click-button"], min_length=1)
    """MiniWoB task names (the ``miniwob`` package's ``html/miniwob/<name>.html``), for ``data.type =
    "environment"``: task instances cycle through them, each with its own seed."""
    observation: Literal["text", "screenshot", "both"] = "text"
    """What the policy sees of the page: ``text``, lines ``[id] tag "text"``; ``screenshot``, the task's instruction
    and a PNG of MiniWoB's 160x210-pixel task area, acted on by pixel coordinates (``click_at``, ``type_at``);
    ``both``, the text and the screenshot, acted on by element ids. Screenshots need a vision-language model
    (model.path, e.g. a Qwen2-VL folder on the ``hf`` engine or an Idefics3 folder on ``hf`` or ``vllm``)."""
    tool_parser: ToolParserName = "hermes"
    """How actions are read from a turn: ``hermes``, ``<tool_call>{json}</tool_call>`` blocks (Hermes, Qwen 2.5/3);
    ``json``, a turn that is one JSON object with ``name`` and ``parameters``; ``llama3_json``, ``qwen3_coder``,
    ``mistral``, ``harmony``: those families' formats; ``auto``, the format the model's chat template renders
    (hermes for a template without tool calls)."""
    pool_size: int = Field(default=2, ge=1)
    """Browsers kept running and shared by the episodes (each about 150 MB and one busy core while it works);
    episodes beyond this many wait for one to come free."""
    call_timeout_s: float = Field(default=10.0, gt=0.0)
    """Wall clock of one browser call (a reset, an action, reading the page); a browser that takes longer is
    killed and replaced, and its episode abstains (infra_error)."""
    js_heap_mb: int = Field(default=256, ge=16)
    """Cap of a page's JavaScript heap (V8's old space), so a runaway page cannot take the host's memory."""
    memory_mb: int = Field(default=1024, ge=64)
    """Each browser's memory limit in MiB (chromedriver and every Chromium process together, a cgroup where this
    process may make one): a page that needs more gets its browser killed, and the episode abstains."""
    max_page_chars: int = Field(default=2000, ge=100)
    """Characters of the page text shown to the policy; the rest is cut with a note."""
    instructions: str = ""
    """The system prompt; empty: the default, which explains element ids and lists the tools as JSON schema (a
    small model does better with a short prompt of its own and ``demonstration``)."""
    demonstration: bool = False
    """Start every episode with one worked example (a page as text and the right tool call, as a user turn and an
    assistant turn), which shows a small model the action format; not with ``observation = "screenshot"``."""
    chromium: str = "chromium"
    """The Chromium executable (a name on PATH or a path)."""
    chromedriver: str = "chromedriver"
    """The chromedriver executable matching ``chromium``."""

    @model_validator(mode="after")
    def _check_demonstration(self) -> BrowserEnvironmentConfig:
        if self.demonstration and self.observation == "screenshot":
            raise ValueError(
                'demonstration = true shows a page as text with element ids, which observation = "screenshot" does '
                'not show nor act on; use observation = "both" or demonstration = false'
            )
        return self

    @field_validator("tasks")
    @classmethod
    def _check_tasks(cls, value: list[str]) -> list[str]:
        bad = [name for name in value if not _TASK_NAME.fullmatch(name)]
        if bad:
            raise ValueError(
                f"tasks {bad} are not MiniWoB task names (lower-case words joined by '-', e.g. click-button)"
            )
        return value
