"""Fixtures of the browser environment's tests: one real headless Chromium per module (about a second to start)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from sharpen.environments.browser.pool import Browser, BrowserPool, start_browser


def _require_chromium() -> None:
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        pytest.fail("chromium and chromedriver are needed (make system-deps installs them)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    _require_chromium()
    started = start_browser(chromium="chromium", chromedriver="chromedriver", js_heap_mb=128)
    yield started
    started.kill()


@pytest.fixture
def pool() -> Iterator[BrowserPool]:
    _require_chromium()
    browsers = BrowserPool(size=1, call_timeout_s=10.0)
    yield browsers
    browsers.close()
