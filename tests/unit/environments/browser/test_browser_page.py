"""Reading a fixed page as text with element ids, and acting on it, in a real headless Chromium."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharpen.environments.browser import page
from sharpen.environments.browser.pool import Browser

FIXED_PAGE = """<!DOCTYPE html>
<html><head><script>
var core = {getUtterance: function () { return '  Type   your name, then submit. '.replace(/\\s+/g, ' ').trim(); }};
</script></head>
<body>
<div id="query">ignored: the task comes from core.getUtterance</div>
<div id="area">
  <p>Your   <b>name</b>:</p>
  <input type="text" id="name">
  <label><input type="checkbox" id="agree"> I agree</label>
  <div style="display: none"><button>Hidden</button></div>
  <button id="submit" onclick="document.getElementById('name').value += '!'">Submit</button>
</div>
</body></html>
"""

EXPECTED_LINES = (
    '[1] p "Your :"',
    '[2] b "name"',
    '[3] input type=text value=""',
    '[4] label "I agree"',
    "[5] input type=checkbox unchecked",
    '[6] button "Submit"',
)


@pytest.fixture
def fixed_page(browser: Browser, tmp_path: Path) -> Browser:
    path = tmp_path / "fixed.html"
    path.write_text(FIXED_PAGE)
    browser.driver.get(path.as_uri())
    browser.driver.execute_script("window.__sharpenNextId = 1;")
    return browser


def test_the_page_reads_as_one_line_per_visible_element_with_text_or_input(fixed_page: Browser) -> None:
    text = page.read_page(fixed_page.driver)
    assert text.task == "Type your name, then submit."
    assert text.lines == EXPECTED_LINES
    assert text.render(max_chars=1000) == "Task: Type your name, then submit.\nPage:\n" + "\n".join(EXPECTED_LINES)
    cut = text.render(max_chars=20)
    assert cut.endswith("[page truncated at 20 characters]") and '[6] button "Submit"' not in cut


def test_ids_stay_with_their_elements_and_new_elements_get_new_ones(fixed_page: Browser) -> None:
    driver = fixed_page.driver
    page.read_page(driver)
    driver.execute_script(
        "const b = document.createElement('button'); b.textContent = 'Cancel';"
        "document.getElementById('area').prepend(b);"
    )
    lines = page.read_page(driver).lines
    assert lines[0] == '[7] button "Cancel"'
    assert lines[1:] == EXPECTED_LINES


def test_actions_change_the_page_and_mistakes_come_back_as_errors(fixed_page: Browser) -> None:
    driver = fixed_page.driver
    page.read_page(driver)
    assert page.type_text(driver, 3, "Ada") == 'typed "Ada" into [3]'
    assert page.click(driver, 5) == "clicked [5]"
    assert page.click(driver, 6) == "clicked [6]"
    lines = page.read_page(driver).lines
    assert '[3] input type=text value="Ada!"' in lines
    assert "[5] input type=checkbox checked" in lines
    assert page.press(driver, "Tab") == "pressed Tab"
    assert page.scroll(driver, 0, 40) == "scrolled by (0, 40)"

    assert page.click(driver, 99) == "error: no element [99] on the page"
    assert page.press(driver, "Hyper").startswith("error: unknown key 'Hyper'")
    driver.execute_script("document.getElementById('submit').style.display = 'none';")
    assert page.click(driver, 6).startswith("error: element [6] cannot be clicked")


# A task page whose own script defines `genProblem` only a moment after the page has loaded: what chromedriver's `get`
# returned to once in CI (core.js had run, the task's script had not), so starting the task failed in the page.
LATE_TASK_PAGE = """<!DOCTYPE html>
<html><head><script>
var WOB_TASK_READY = true;
var core = {EP_TIMER: null, getUtterance: function () { return 'late'; },
            startEpisodeReal: function () { genProblem(); }};
Math.seedrandom = function () {};
setTimeout(function () { window.genProblem = function () { document.title = 'started'; }; }, DELAY_MS);
</script></head><body><div id="area"><button>ONE</button></div></body></html>
"""


def test_starting_a_task_waits_for_its_script_and_a_page_that_never_loads_raises(
    browser: Browser, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    late = tmp_path / "late.html"
    late.write_text(LATE_TASK_PAGE.replace("DELAY_MS", "300"))
    driver = browser.driver
    page.start_task(driver, late.as_uri(), seed=1)
    assert driver.title == "started"

    never = tmp_path / "never.html"
    never.write_text(LATE_TASK_PAGE.replace("DELAY_MS", "60000"))
    monkeypatch.setattr(page, "_LOAD_WAIT_S", 0.2)
    with pytest.raises(RuntimeError, match=r"never\.html did not finish loading \(no genProblem after two"):
        page.start_task(driver, never.as_uri(), seed=1)
