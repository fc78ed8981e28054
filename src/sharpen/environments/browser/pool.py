"""`BrowserPool`: headless Chromium processes (driven by selenium through chromedriver) reused across episodes.

Owns the browsers' lives: starting one isolated (its own temporary user-data dir, which is also its home; no
network and no downloads, `sharpen.environments.browser.isolation`, so only ``file://`` pages load; and, where this
process may make cgroups, chromedriver and Chromium in a cgroup of their own with a memory and a process-count limit,
the sandbox's `JobCgroup`), lending it for one environment call at a time (wiping what an episode left in it before
another episode's call, or a new episode's reset, runs on it: `isolation.wipe_browser`), bounding each call by a wall
clock, and killing and replacing a browser that crashed or hung (a crash is reported as `EnvironmentInfraError`:
the episode abstains). It knows nothing of tasks, pages or actions (`sharpen.environments.browser.page`), nor of
episodes (`BrowserEnvironment`).

A browser is lent per call, not per episode: the episode loop never tells an environment that its episode ended
(it may stop one at max_turns), so an episode-long lease would hold a browser forever. Each browser remembers the
last episode it served (``owner``); that episode gets it back when it is free, and an episode that gets another
browser restores its page by replaying its own seeded task and actions.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import tempfile
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from sharpen.environments.base import EnvironmentInfraError
from sharpen.environments.browser import isolation
from sharpen.environments.sandbox.cgroups import (
    ControllerDir,
    JobCgroup,
    close_controller_dirs,
    open_controller_dirs,
    owned_name,
)

T = TypeVar("T")

_POLL_SECONDS = 0.005
"""How often a waiting episode looks for a free browser. Polling works on any event loop: the episode runner
starts a new loop per step, and a browser freed by one loop's episode may be taken by the next loop's."""

# Selenium's driver manager would look up drivers online and send usage statistics; the driver and browser here
# are Debian's, named explicitly, so nothing needs to leave the machine.
_SELENIUM_OFFLINE = {"SE_OFFLINE": "true", "SE_AVOID_STATS": "true"}


def chromium_arguments(user_data_dir: str, *, js_heap_mb: int, is_isolated: bool = True) -> list[str]:
    """Chromium's flags: headless, isolated, offline, small (``is_isolated=False``: with the network open, the
    tests' control that shows an attack works on a browser without sharpen's isolation)."""
    return [
        "--headless=new",
        # Chromium refuses to start as root with its sandbox on (the test machines run as root); the isolation that
        # matters here is the network's and the profile's, below, and the pages are MiniWoB's own local files.
        *(["--no-sandbox"] if os.geteuid() == 0 else []),
        f"--user-data-dir={user_data_dir}",
        *(isolation.isolation_arguments() if is_isolated else []),
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-default-apps",
        "--disable-extensions",
        "--disable-sync",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-gpu",
        "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
        "--renderer-process-limit=1",
        # draw a frame when asked, not at the next 60 Hz tick: a screenshot waits for a frame (33-50 ms a shot
        # without this flag, about 6 ms with it, measured) and so does a pointer action; an idle page draws nothing
        "--disable-frame-rate-limit",
        f"--js-flags=--max-old-space-size={js_heap_mb}",
        "--window-size=400,400",
    ]


@dataclass(kw_only=True, eq=False)
class Browser:
    """One Chromium with its chromedriver (in their own process group, so both die together)."""

    driver: Any
    process: Any
    """chromedriver's ``subprocess.Popen`` (Chromium is its child, in its process group)."""
    user_data_dir: str
    cgroup: JobCgroup | None = None
    """The cgroup chromedriver and Chromium run in (memory and process-count limits); None where none could be
    made."""
    blank_url: str = "about:blank"
    """The page a wipe leaves the browser on (`isolation.BLANK_PAGE` in its profile)."""
    owner: Any = None
    """The episode (an environment object) whose page this browser shows now; None: nobody's."""
    is_clean: bool = True
    """Nothing has run on it since it started or was wiped."""
    is_dead: bool = False

    def kill(self) -> None:
        """Kill chromedriver and Chromium at once (no polite quit: a hung browser would not answer it)."""
        self.is_dead = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the group id is its pid
        if self.cgroup is not None:  # and whatever left the process group (Chromium's zygote may)
            self.cgroup.kill_all()
            self.cgroup.remove()
        with contextlib.suppress(Exception):
            self.process.wait(timeout=5)  # reap it
        shutil.rmtree(self.user_data_dir, ignore_errors=True)


def start_browser(
    *, chromium: str, chromedriver: str, js_heap_mb: int, cgroup: JobCgroup | None = None, is_isolated: bool = True
) -> Browser:
    """A fresh, isolated headless Chromium (about a second on an idle core); in ``cgroup`` when given: a launcher
    script writes its pid into the group's ``cgroup.procs`` files, then becomes chromedriver, so chromedriver and
    every Chromium process are born inside it. ``is_isolated=False`` starts it with the network open, downloads
    allowed and the caller's home: only the tests' naive-path controls do."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for name, value in _SELENIUM_OFFLINE.items():
        os.environ.setdefault(name, value)
    for path in (chromium, chromedriver):
        if shutil.which(path) is None:
            raise EnvironmentInfraError(
                f"browser environment: {path} not found (install the Debian packages chromium and chromium-driver)"
            )
    user_data_dir = tempfile.mkdtemp(prefix="sharpen-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which(chromium) or chromium
    for argument in chromium_arguments(user_data_dir, js_heap_mb=js_heap_mb, is_isolated=is_isolated):
        options.add_argument(argument)
    environment = None
    if is_isolated:
        options.add_experimental_option("prefs", isolation.download_preferences(user_data_dir))
        environment = isolation.confined_environment(user_data_dir)
    executable = shutil.which(chromedriver) or chromedriver
    if cgroup is not None:
        executable = _cgroup_launcher(user_data_dir, executable, cgroup.procs_files)
    service = Service(executable_path=executable, env=environment, popen_kw={"start_new_session": True})
    driver = None
    try:
        driver = webdriver.Chrome(service=service, options=options)
        if is_isolated:
            isolation.guard_browser(driver)
    except Exception as error:  # any start-up failure is the host's, not the policy's
        if driver is not None and service.process is not None:  # started, then failed to be guarded
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(service.process.pid, signal.SIGKILL)
        shutil.rmtree(user_data_dir, ignore_errors=True)
        if cgroup is not None:
            cgroup.kill_all()
            cgroup.remove()
        raise EnvironmentInfraError(f"browser environment: Chromium did not start: {error}") from error
    process = service.process
    assert process is not None, "a started service has its process"
    blank_url = isolation.write_blank_page(user_data_dir)
    return Browser(driver=driver, process=process, user_data_dir=user_data_dir, cgroup=cgroup, blank_url=blank_url)


def _cgroup_launcher(folder: str, chromedriver: str, procs_files: list[str]) -> str:
    """A shell script in ``folder`` that moves itself into the cgroup (each of ``procs_files``), then execs
    ``chromedriver`` with its arguments."""
    import shlex

    path = os.path.join(folder, "chromedriver-in-cgroup")
    moves = "".join(f"echo $$ > {shlex.quote(name)}\n" for name in procs_files)
    with open(path, "w") as script:
        script.write(f'#!/bin/sh\nset -e\n{moves}exec {shlex.quote(chromedriver)} "$@"\n')
    os.chmod(path, 0o700)
    return path


@dataclass(kw_only=True)
class PoolStats:
    """Counters of a pool's life, for benchmarks and tests."""

    num_started: int = 0
    num_crashed: int = 0
    """Browsers killed because a call failed or ran past its wall clock (each is replaced on demand)."""
    num_calls: int = 0
    num_wipes: int = 0
    """Browsers wiped as they passed to another episode or to a new episode's reset (`isolation.wipe_browser`)."""


class BrowserPool:
    """Up to ``size`` browsers, started on demand and kept for later episodes. Calls made through `lease` run on the
    pool's own threads (one per browser), so a blocking selenium call never holds the event loop or the default
    executor; each is bounded by ``call_timeout_s``, after which the browser is killed and the call raises
    `EnvironmentInfraError`."""

    def __init__(
        self,
        *,
        size: int = 1,
        call_timeout_s: float = 10.0,
        chromium: str = "chromium",
        chromedriver: str = "chromedriver",
        js_heap_mb: int = 256,
        memory_mb: int = 1024,
        max_pids: int = 256,
        isolate_episodes: bool = True,
    ) -> None:
        """``memory_mb`` and ``max_pids``: each browser's cgroup limits (chromedriver and every Chromium process
        together), where this process may make cgroups (`has_cgroup_limits`); a browser that runs out is killed by
        the kernel, and its call fails like any crash. ``isolate_episodes=False`` lends a browser to the next
        episode as the last one left it (no wipe): only the benchmark's baseline and the tests' naive-path control
        do, since then one episode's page may read what another's stored."""
        if size < 1:
            raise ValueError(f"browser pool size must be >= 1, got {size}")
        self.size, self.call_timeout_s = size, call_timeout_s
        self.memory_mb, self.max_pids = memory_mb, max_pids
        self.isolate_episodes = isolate_episodes
        self._cgroup_dirs: list[ControllerDir] = open_controller_dirs(owned_name(f"browsers-{id(self)}"))
        self._num_cgroups = 0
        self._start = lambda: start_browser(
            chromium=chromium, chromedriver=chromedriver, js_heap_mb=js_heap_mb, cgroup=self._new_cgroup()
        )
        self._lock = threading.Lock()
        self._idle: list[Browser] = []
        self._alive: list[Browser] = []  # idle and lent
        self._num_alive = 0  # idle + lent + starting
        # a thread per browser, and as many again for calls still stuck in a browser that was just killed
        self._executor = ThreadPoolExecutor(max_workers=2 * size, thread_name_prefix="sharpen-browser")
        self.stats = PoolStats()
        self._finalizer = weakref.finalize(self, _close_all, self._alive, self._idle, self._executor, self._cgroup_dirs)
        atexit.register(self._finalizer)

    @property
    def has_cgroup_limits(self) -> bool:
        """Whether browsers run under the memory limit (a cgroup memory controller this process may write)."""
        return any(d.controller == "memory" for d in self._cgroup_dirs)

    def _new_cgroup(self) -> JobCgroup | None:
        if not self._cgroup_dirs:
            return None
        with self._lock:
            self._num_cgroups += 1
            name = f"browser-{self._num_cgroups}"
        memory_bytes = self.memory_mb << 20
        return JobCgroup(self._cgroup_dirs, name, max_pids=self.max_pids, memory_bytes=memory_bytes, cpu_fraction=1.0)

    @contextlib.asynccontextmanager
    async def lease(self, owner: Any, *, is_new_episode: bool = False) -> AsyncIterator[Lease]:
        """A browser for ``owner`` until the block ends: the one that last served it if that one is free, else a
        free one, else a new one while the pool has room, else the first to come free. A browser that served
        another owner since it was wiped, or any used browser when ``is_new_episode``, is wiped first (its
        ``owner`` is then None: it shows nobody's page)."""
        browser = await self._acquire(owner)
        try:
            if self.isolate_episodes and not browser.is_clean and (is_new_episode or browser.owner is not owner):
                await self.run(browser, lambda driver: isolation.wipe_browser(driver, browser.blank_url))
                browser.owner, browser.is_clean = None, True
                self.stats.num_wipes += 1
            browser.is_clean = False
            yield Lease(self, browser)
        finally:
            self._release(browser)

    async def _acquire(self, owner: Any) -> Browser:
        while True:
            with self._lock:
                if self._idle:
                    mine = [b for b in self._idle if b.owner is owner]
                    unowned = [b for b in self._idle if b.owner is None]
                    browser = (mine or unowned or self._idle)[0]
                    self._idle.remove(browser)
                    return browser
                may_start = self._num_alive < self.size
                if may_start:
                    self._num_alive += 1
            if may_start:
                starting = self._executor.submit(self._start)
                try:
                    browser = await asyncio.wrap_future(starting)
                except BaseException:
                    with self._lock:
                        self._num_alive -= 1
                    # cancelled while Chromium starts (the episode's clock ran out): kill it once it is up
                    starting.add_done_callback(lambda done: done.exception() is None and done.result().kill())
                    raise
                self.stats.num_started += 1
                with self._lock:
                    self._alive.append(browser)
                return browser
            await asyncio.sleep(_POLL_SECONDS)

    def _release(self, browser: Browser) -> None:
        with self._lock:
            if browser.is_dead:
                self._num_alive -= 1
                self._alive.remove(browser)
            else:
                self._idle.append(browser)

    async def run(self, browser: Browser, function: Callable[[Any], T]) -> T:
        """``function(driver)`` on a pool thread, within the wall clock; a failure or a timeout kills the browser."""
        self.stats.num_calls += 1
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, function, browser.driver)
        try:
            return await asyncio.wait_for(future, timeout=self.call_timeout_s)
        except asyncio.CancelledError:  # the episode's own clock ran out: the call may still run on this browser
            self._kill(browser)
            raise
        except TimeoutError:
            self._kill(browser)
            raise EnvironmentInfraError(
                f"browser environment: a browser call ran past {self.call_timeout_s:g} s; the browser was replaced"
            ) from None
        except Exception as error:  # a dead or broken browser: not the policy's fault (policy errors are returned)
            out_of_memory = browser.cgroup is not None and browser.cgroup.num_oom_kills() > 0
            self._kill(browser)
            why = f"ran out of its {self.memory_mb} MB memory limit" if out_of_memory else "failed"
            raise EnvironmentInfraError(
                f"browser environment: the browser {why} ({type(error).__name__}: {error}); it was replaced"
            ) from error

    def _kill(self, browser: Browser) -> None:
        if not browser.is_dead:
            self.stats.num_crashed += 1
            browser.kill()

    def close(self) -> None:
        """Kill every browser (also at exit, and when the pool is garbage-collected)."""
        self._finalizer()


@dataclass(frozen=True)
class Lease:
    """One browser lent to one environment call."""

    pool: BrowserPool
    browser: Browser

    async def run(self, function: Callable[[Any], T]) -> T:
        return await self.pool.run(self.browser, function)


def _close_all(
    alive: list[Browser], idle: list[Browser], executor: ThreadPoolExecutor, cgroup_dirs: list[ControllerDir]
) -> None:
    for browser in alive:
        browser.kill()
    alive.clear()
    idle.clear()
    executor.shutdown(wait=False, cancel_futures=True)
    close_controller_dirs(cgroup_dirs)
