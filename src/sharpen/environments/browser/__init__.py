"""The browser environment: MiniWoB++ web tasks in pooled headless Chromium (`BrowserEnvironment`, `BrowserPool`).

Importing this package starts nothing and needs no browser; selenium and miniwob (the ``browser`` extra) are
imported when the environment is built, a browser starts or a task page is looked up.
"""

from sharpen.environments.browser.build import BrowserEnvironmentFactory, build_browser_factory, make_browser_tasks
from sharpen.environments.browser.environment import BrowserEnvironment
from sharpen.environments.browser.pool import BrowserPool, PoolStats

__all__ = [
    "BrowserEnvironment",
    "BrowserEnvironmentFactory",
    "BrowserPool",
    "PoolStats",
    "build_browser_factory",
    "make_browser_tasks",
]
