"""One MiniWoB++ task page in a browser: starting a seeded task instance, reading the page as text, and acting on it.

Owns everything that touches a page through its driver: the MiniWoB protocol (``Math.seedrandom`` seeds the task's
generator, ``core.startEpisodeReal`` draws the instance; ``WOB_DONE_GLOBAL`` and ``WOB_RAW_REWARD_GLOBAL`` say how
it ended), the element ids the policy sees, the screenshot of the task area, and the actions. Every function here is
blocking and takes a selenium driver; `BrowserPool` runs them on its threads. A mistake of the policy (an id that is
not on the page, an element that cannot be typed into, a point outside the screenshot) comes back as an error string;
anything else raises and is the browser's fault.
It knows nothing of episodes, pools or tool-call text.
"""

from __future__ import annotations

import base64
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

_LOADED_JS = "return document.readyState === 'complete' && typeof genProblem === 'function';"
_LOAD_POLL_S = 0.05
_LOAD_WAIT_S = 3.0
"""How long a task page may take to finish loading after the driver's ``get`` returned. Chromedriver's ``get`` can
return after the page's ``core.js`` ran but before the task's own script defined ``genProblem`` (seen once in CI,
right after a wipe's navigation to the blank page); starting the task then fails in the page's JavaScript."""

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

# A page that shows the same pixels for the same state: a caret that does not blink (a Chromium without CSS
# caret-animation hides it instead), no CSS animation or transition, jQuery's animations instant (jQuery UI's date
# pickers and accordions slide otherwise), and a viewport that does not scroll (a wheel over a task's own scrolling
# element still scrolls it), so the task area stays where screenshots and pointer clicks expect it. A blinking caret
# alone made two screenshots of a focused text field differ (measured).
_STILL_CSS = (
    "html { overflow: hidden !important; }"
    " *, *::before, *::after { animation: none !important; transition: none !important;"
    " caret-animation: manual !important; }"
    " @supports not (caret-animation: manual) { * { caret-color: transparent !important; } }"
)
_STILL_JS = f"""
if (!document.getElementById('sharpen-still')) {{
  const style = document.createElement('style');
  style.id = 'sharpen-still';
  style.textContent = {json.dumps(_STILL_CSS)};
  document.head.appendChild(style);
}}
if (window.jQuery) window.jQuery.fx.off = true;
window.scrollTo(0, 0);
"""

_TASK_AREA_JS = """
const area = (document.getElementById('wrap') || document.body).getBoundingClientRect();
return {x: area.x, y: area.y, width: area.width, height: area.height, scroll_x: window.scrollX,
        scroll_y: window.scrollY, view_width: window.innerWidth, view_height: window.innerHeight};
"""
"""MiniWoB's task area, ``#wrap``: 160x210 pixels at the page's top-left corner in every task of the package
(measured on all 130), the crop of MiniWoB's own screenshots; what a task draws outside it is not shown."""

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


def start_task(driver: Any, url: str, seed: int, *, is_still: bool = False) -> None:
    """Draw the task instance of ``seed``, loading the task's page first unless the browser shows it already.
    ``is_still``: for screenshots, also make the page still (`_STILL_JS`) and park the pointer outside the task area
    (another episode's last click would otherwise leave a hover effect on this one's first screenshot)."""
    if driver.current_url.split("#")[0] != url:
        _load(driver, url)
    if is_still:
        driver.execute_script(_STILL_JS)
    if not driver.execute_script(_START_JS, seed, EPISODE_MAX_MS):
        raise RuntimeError(f"MiniWoB task at {url} did not become ready")
    if is_still:
        from selenium.webdriver.common.actions.action_builder import ActionBuilder

        area = driver.execute_script(_TASK_AREA_JS)
        parking = ActionBuilder(driver, duration=0)  # selenium glides the pointer for 250 ms by default
        parking.pointer_action.move_to_location(int(area["view_width"]) - 1, int(area["view_height"]) - 1)
        parking.perform()


def _load(driver: Any, url: str) -> None:
    """Navigate to the task page at ``url`` and wait until its script has run, navigating once more if it has not
    within `_LOAD_WAIT_S`; a page that never loads raises (the browser's fault: the pool replaces it)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.wait import WebDriverWait

    for _ in range(2):
        driver.get(url)
        wait = WebDriverWait(driver, _LOAD_WAIT_S, poll_frequency=_LOAD_POLL_S)
        try:
            wait.until(lambda d: d.execute_script(_LOADED_JS))
            return
        except TimeoutException:
            pass
    raise RuntimeError(f"MiniWoB task page {url} did not finish loading (no genProblem after two navigations)")


def screenshot(driver: Any) -> bytes:
    """The task area as PNG bytes (Chromium's own encoder, no re-encoding here: about 5 ms with the pool's flags)."""
    area = driver.execute_script(_TASK_AREA_JS)
    # the clip is in page coordinates: the viewport's offset is added back
    clip = {"x": area["x"] + area["scroll_x"], "y": area["y"] + area["scroll_y"], "scale": 1}
    clip |= {"width": area["width"], "height": area["height"]}
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "clip": clip})
    return base64.b64decode(shot["data"])


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


def click_at(driver: Any, x: int, y: int) -> str:
    """A pointer click at ``(x, y)`` of the screenshot (pixels from its top-left corner)."""
    from selenium.webdriver.common.actions.action_builder import ActionBuilder

    area = driver.execute_script(_TASK_AREA_JS)
    width, height = int(area["width"]), int(area["height"])
    if not (0 <= x < width and 0 <= y < height):
        return f"error: ({x}, {y}) is outside the screenshot ({width}x{height} pixels, x < {width}, y < {height})"
    clicking = ActionBuilder(driver, duration=0)
    clicking.pointer_action.move_to_location(int(area["x"]) + x, int(area["y"]) + y).click()
    clicking.perform()
    return f"clicked ({x}, {y})"


def type_at(driver: Any, x: int, y: int, text: str) -> str:
    """A click at ``(x, y)`` of the screenshot, then ``text`` typed on the keyboard (into what the click focused)."""
    from selenium.webdriver.common.action_chains import ActionChains

    clicked = click_at(driver, x, y)
    if clicked.startswith("error:"):
        return clicked
    ActionChains(driver).send_keys(text).perform()
    return f"typed {json.dumps(text)} at ({x}, {y})"


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
