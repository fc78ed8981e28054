"""One MiniWoB++ task page in a browser: starting a seeded task instance, reading the page as text, and acting on it.

Owns everything that touches a page through its driver: the MiniWoB protocol (``Math.seedrandom`` seeds the task's
generator, ``core.startEpisodeReal`` draws the instance; ``WOB_DONE_GLOBAL`` and ``WOB_RAW_REWARD_GLOBAL`` say how
it ended), the element ids the policy sees, and the five actions. Every function here is blocking and takes a
selenium driver; `BrowserPool` runs them on its threads. A mistake of the policy (an id that is not on the page, an
element that cannot be typed into) comes back as an error string; anything else raises and is the browser's fault.
It knows nothing of episodes, pools or tool-call text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EPISODE_MAX_MS = 24 * 3600 * 1000
"""MiniWoB ends a task after 10 s by default; a policy on a CPU takes longer than that to think, and a clock would
make replays depend on timing, so the task's own clock is set out of reach (episode length is the loop's limit)."""

# Gives each element the policy may refer to an id (``data-sharpen-id``) the first time it is seen, in document
# order, and lists the visible ones: ids stay put across turns and are the same in every replay of the episode.
_READ_PAGE_JS = """
const root = document.getElementById('area') || document.body;
const controls = new Set(['button', 'a', 'input', 'textarea', 'select', 'option', 'label']);
const lines = [];
function isVisible(el) {
  const style = getComputedStyle(el);
  if (style.display === 'none' || style.visibility === 'hidden') return false;
  const box = el.getBoundingClientRect();
  return box.width > 0 && box.height > 0;
}
function ownText(el) {
  let text = '';
  for (const node of el.childNodes) if (node.nodeType === 3) text += node.textContent;
  return text.replace(/\\s+/g, ' ').trim();
}
function visit(el) {
  if (!(el instanceof HTMLElement) || !isVisible(el)) return;
  const tag = el.tagName.toLowerCase();
  const text = ownText(el);
  if (text || controls.has(tag)) {
    if (!el.dataset.sharpenId) el.dataset.sharpenId = String(window.__sharpenNextId++);
    const parts = ['[' + el.dataset.sharpenId + ']', tag];
    if (tag === 'input') {
      parts.push('type=' + el.type);
      if (el.type === 'checkbox' || el.type === 'radio') parts.push(el.checked ? 'checked' : 'unchecked');
      else parts.push('value=' + JSON.stringify(el.value));
    } else if (tag === 'textarea') {
      parts.push('value=' + JSON.stringify(el.value));
    }
    if (text) parts.push(JSON.stringify(text));
    lines.push(parts.join(' '));
  }
  for (const child of el.children) visit(child);
}
visit(root);
return {task: core.getUtterance(), lines: lines};
"""

_START_JS = """
core.EPISODE_MAX_TIME = arguments[1];
if (core.EP_TIMER !== null) core.endEpisode(0);
for (const el of document.querySelectorAll('[data-sharpen-id]')) delete el.dataset.sharpenId;
window.__sharpenNextId = 1;
Math.seedrandom(arguments[0]);
core.startEpisodeReal();
document.activeElement && document.activeElement.blur && document.activeElement.blur();
return WOB_TASK_READY;
"""

_OUTCOME_JS = "return {done: WOB_DONE_GLOBAL, raw_reward: WOB_RAW_REWARD_GLOBAL, reason: WOB_REWARD_REASON};"

KEYS = ("Enter", "Tab", "Backspace", "Delete", "Escape", "Space", "ArrowUp", "ArrowDown", "ArrowLeft", "ArrowRight")
"""The keys ``press`` accepts (besides single characters)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PageText:
    task: str
    """The task's instruction (MiniWoB's utterance)."""
    lines: tuple[str, ...]
    """One line per visible element that has text or takes input: ``[id] tag [type=..] [value=..] "text"``."""

    def render(self, *, max_chars: int) -> str:
        text = "\n".join(self.lines) if self.lines else "(no visible elements)"
        if len(text) > max_chars:
            text = text[:max_chars] + f"\n[page truncated at {max_chars} characters]"
        return f"Task: {self.task}\nPage:\n{text}"


@dataclass(kw_only=True, slots=True, frozen=True)
class Outcome:
    is_done: bool
    raw_reward: float
    """The task's reward without MiniWoB's time discount: 1 solved, -1 failed, in between for partial credit."""


def miniwob_html_dir() -> Path:
    """The task pages shipped by the ``miniwob`` package (one ``<task>.html`` each)."""
    import miniwob

    return Path(miniwob.__file__).parent / "html" / "miniwob"


def task_names() -> list[str]:
    return sorted(p.stem for p in miniwob_html_dir().glob("*.html"))


def task_url(task: str) -> str:
    path = miniwob_html_dir() / f"{task}.html"
    if not path.is_file():
        known = task_names()
        raise ValueError(f"unknown MiniWoB task {task!r} ({len(known)} known, e.g. {', '.join(known[:8])}, ...)")
    return path.as_uri()


def start_task(driver: Any, url: str, seed: int) -> None:
    """Draw the task instance of ``seed``, loading the task's page first unless the browser shows it already."""
    if driver.current_url.split("#")[0] != url:
        driver.get(url)
    if not driver.execute_script(_START_JS, seed, EPISODE_MAX_MS):
        raise RuntimeError(f"MiniWoB task at {url} did not become ready")


def read_page(driver: Any) -> PageText:
    data = driver.execute_script(_READ_PAGE_JS)
    return PageText(task=str(data["task"]), lines=tuple(str(line) for line in data["lines"]))


def read_outcome(driver: Any) -> Outcome:
    data = driver.execute_script(_OUTCOME_JS)
    return Outcome(is_done=bool(data["done"]), raw_reward=float(data["raw_reward"] or 0.0))


def click(driver: Any, element_id: int) -> str:
    from selenium.common.exceptions import ElementClickInterceptedException, ElementNotInteractableException

    element = _element(driver, element_id)
    if isinstance(element, str):
        return element
    try:
        element.click()
    except (ElementClickInterceptedException, ElementNotInteractableException) as error:
        return f"error: element [{element_id}] cannot be clicked ({_first_line(error)})"
    return f"clicked [{element_id}]"


def type_text(driver: Any, element_id: int, text: str) -> str:
    from selenium.common.exceptions import ElementNotInteractableException, InvalidElementStateException

    element = _element(driver, element_id)
    if isinstance(element, str):
        return element
    try:
        element.click()
        element.send_keys(text)
    except (ElementNotInteractableException, InvalidElementStateException) as error:
        return f"error: cannot type into element [{element_id}] ({_first_line(error)})"
    return f"typed {json.dumps(text)} into [{element_id}]"


def press(driver: Any, key: str) -> str:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    names = {"Enter": Keys.ENTER, "Tab": Keys.TAB, "Backspace": Keys.BACKSPACE, "Delete": Keys.DELETE}
    names |= {"Escape": Keys.ESCAPE, "Space": Keys.SPACE, "ArrowUp": Keys.ARROW_UP, "ArrowDown": Keys.ARROW_DOWN}
    names |= {"ArrowLeft": Keys.ARROW_LEFT, "ArrowRight": Keys.ARROW_RIGHT}
    if key not in names and len(key) != 1:
        return f"error: unknown key {key!r} (a single character or one of {', '.join(KEYS)})"
    ActionChains(driver).send_keys(names.get(key, key)).perform()
    return f"pressed {key}"


def scroll(driver: Any, dx: int, dy: int) -> str:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.actions.wheel_input import ScrollOrigin

    area = driver.execute_script("const a = document.getElementById('area'); return a && a.getBoundingClientRect();")
    x, y = (10, 60) if not area else (int(area["x"]) + 5, int(area["y"]) + 5)
    ActionChains(driver).scroll_from_origin(ScrollOrigin.from_viewport(x, y), dx, dy).perform()
    return f"scrolled by ({dx}, {dy})"


def _element(driver: Any, element_id: int) -> Any:
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, f'[data-sharpen-id="{int(element_id)}"]')
    if not found:
        return f"error: no element [{element_id}] on the page"
    return found[0]


def _first_line(error: Exception) -> str:
    message = getattr(error, "msg", None) or str(error)
    return message.strip().splitlines()[0] if message.strip() else type(error).__name__
