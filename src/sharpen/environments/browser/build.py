"""From the browser section to a per-episode factory and to task instances.

Owns the checks that fail before anything slow starts (the ``browser`` extra installed, the tasks known, the
executables present) and the one `BrowserPool` a factory's episodes share; the pool starts no browser until an
episode needs one and kills its browsers when the process exits. It does not run episodes.
"""

from __future__ import annotations

import shutil

from sharpen.config.browser import BrowserEnvironmentConfig
from sharpen.environments.browser import page
from sharpen.environments.browser.environment import BrowserEnvironment
from sharpen.environments.browser.pool import BrowserPool
from sharpen.types import Example


class BrowserEnvironmentFactory:
    """A `BrowserEnvironment` per episode, all sharing one `BrowserPool`; ``close`` ends the pool's browsers (the
    run closes it when it ends; a process that exits without closing it still kills them)."""

    def __init__(self, config: BrowserEnvironmentConfig) -> None:
        self.pool = BrowserPool(
            size=config.pool_size,
            call_timeout_s=config.call_timeout_s,
            chromium=config.chromium,
            chromedriver=config.chromedriver,
            js_heap_mb=config.js_heap_mb,
            memory_mb=config.memory_mb,
        )
        self.config = config

    def __call__(self) -> BrowserEnvironment:
        config = self.config
        return BrowserEnvironment(
            pool=self.pool,
            parser=config.tool_parser,
            max_page_chars=config.max_page_chars,
            instructions=config.instructions,
            demonstration=config.demonstration,
            observation=config.observation,
        )

    def close(self) -> None:
        self.pool.close()


def build_browser_factory(config: BrowserEnvironmentConfig) -> BrowserEnvironmentFactory:
    check_browser_install(config)
    return BrowserEnvironmentFactory(config)


def make_browser_tasks(config: BrowserEnvironmentConfig, *, size: int, seed: int) -> list[Example]:
    check_browser_install(config)
    return BrowserEnvironment.make_tasks(size, seed=seed, tasks=config.tasks)


def check_browser_install(config: BrowserEnvironmentConfig) -> None:
    """One clear error for each thing the environment needs and this host lacks."""
    try:
        import miniwob  # noqa: F401
        import selenium  # noqa: F401
    except ImportError as error:
        raise ValueError(
            f"environment.type = 'browser' needs the browser extra: pip install 'sharpen[browser]' ({error})"
        ) from error
    for task in config.tasks:
        page.task_url(task)
    for executable in (config.chromium, config.chromedriver):
        if shutil.which(executable) is None:
            raise ValueError(
                f"environment.type = 'browser': {executable!r} is not an executable on this host "
                "(install the Debian packages chromium and chromium-driver)"
            )
