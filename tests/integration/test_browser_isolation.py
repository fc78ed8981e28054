"""The browser environment keeps its promises, proved by attack: hostile local pages try to pass state to a later
episode on a reused browser, to save a file outside the browser's disposable profile, and to reach a listener on
this host over TCP (fetch, WebSocket, EventSource, an image, a beacon) and over UDP (WebRTC). Each attack is run
twice: on a browser without sharpen's isolation (the naive-path control, which shows the attack works and the test
would see it) and on sharpen's (the defence, which shows nothing gets through)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sharpen.environments.base import EpisodeContext
from sharpen.environments.browser import BrowserEnvironment, BrowserPool
from sharpen.environments.browser.pool import Browser, start_browser

pytestmark = pytest.mark.slow

# Episode A's page: stores "A" everywhere a page can keep something, opens a popup and grows the tab's history.
_WRITER = """<!doctype html><script>
window.stored = (async () => {
  localStorage.setItem('k', 'A');
  sessionStorage.setItem('k', 'A');
  window.name = 'A';
  document.cookie = 'k=A';
  await new Promise((done, fail) => {
    const open = indexedDB.open('db', 1);
    open.onupgradeneeded = () => open.result.createObjectStore('s');
    open.onerror = () => fail(open.error);
    open.onsuccess = () => {
      const writing = open.result.transaction('s', 'readwrite');
      writing.objectStore('s').put('A', 'k');
      writing.oncomplete = () => { open.result.close(); done(); };
    };
  });
  await (await caches.open('c')).put('https://cache.invalid/k', new Response('A'));
  let worker = 'registered';
  try { await navigator.serviceWorker.register('worker.js'); } catch (error) { worker = String(error); }
  window.open('about:blank');
  for (let i = 0; i < 5; i++) history.pushState({}, '', '?' + i);
  return worker;
})();
</script>"""

# Episode B's page: what it finds of episode A.
_READER = """<!doctype html><script>
window.found = (async () => {
  const idb = await new Promise((done) => {
    const open = indexedDB.open('db', 1);
    open.onupgradeneeded = () => open.result.createObjectStore('s');
    open.onsuccess = () => {
      const got = open.result.transaction('s').objectStore('s').get('k');
      got.onsuccess = () => { open.result.close(); done(got.result ?? null); };
    };
  });
  const cached = await (await caches.open('c')).match('https://cache.invalid/k');
  return {
    localStorage: localStorage.getItem('k'), sessionStorage: sessionStorage.getItem('k'), name: window.name,
    cookie: document.cookie, indexedDB: idb, cache: cached ? await cached.text() : null,
    history: history.length,
  };
})();
</script>"""

_AWAIT = "const done = arguments[arguments.length - 1]; window[arguments[0]].then(done, (e) => done(String(e)));"


def visit(driver: Any, url: str, promise: str) -> Any:
    """Load ``url`` and wait for the page's own ``window[promise]``."""
    driver.get(url)
    return driver.execute_async_script(_AWAIT, promise)


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[str, str]:
    """The writer's and the reader's ``file://`` URLs (two files: all ``file://`` pages share one storage origin)."""
    (tmp_path / "writer.html").write_text(_WRITER)
    (tmp_path / "reader.html").write_text(_READER)
    return (tmp_path / "writer.html").as_uri(), (tmp_path / "reader.html").as_uri()


def leaked(pool: BrowserPool, hostile: tuple[str, str], *, is_new_episode: bool) -> tuple[str, dict[str, Any], int]:
    """Episode A's page on the pool's one browser, then episode B's: what the writer said of its service worker,
    what the reader found, and how many windows B's call saw."""
    writer, reader = hostile

    async def episodes() -> tuple[str, dict[str, Any], int]:
        async with pool.lease(episode_a := object(), is_new_episode=is_new_episode) as lease:
            worker = await lease.run(lambda driver: visit(driver, writer, "stored"))
        async with pool.lease(object(), is_new_episode=is_new_episode) as lease:
            assert lease.browser.owner is not episode_a
            found = await lease.run(lambda driver: visit(driver, reader, "found"))
            num_windows = await lease.run(lambda driver: len(driver.window_handles))
        return worker, found, num_windows

    try:
        result = asyncio.run(episodes())
        assert pool.stats.num_started == 1  # one browser, reused
        return result
    finally:
        pool.close()


def test_web_storage_indexeddb_cache_window_name_popups_and_history_leak_across_episodes_without_the_wipe(
    hostile: tuple[str, str],
) -> None:
    worker, found, num_windows = leaked(BrowserPool(size=1, isolate_episodes=False), hostile, is_new_episode=True)
    assert found["localStorage"] == found["sessionStorage"] == found["name"] == "A"
    assert found["indexedDB"] == found["cache"] == "A"
    assert found["history"] >= 6 and num_windows == 2
    # the routes Chromium closes itself on file://, even without the wipe: no cookie is stored, no worker registers
    assert found["cookie"] == "" and "protocol" in worker and "not supported" in worker


@pytest.mark.parametrize("is_new_episode", [True, False], ids=["new-episode-reset", "another-episode-call"])
def test_a_reused_browser_is_wiped_before_another_episode_runs_on_it(
    hostile: tuple[str, str], is_new_episode: bool
) -> None:
    pool = BrowserPool(size=1)
    _, found, num_windows = leaked(pool, hostile, is_new_episode=is_new_episode)
    assert found == {
        "localStorage": None, "sessionStorage": None, "name": "", "cookie": "", "indexedDB": None, "cache": None,
        "history": 2,  # the blank page the wipe left, and the reader
    }  # fmt: skip
    assert num_windows == 1 and pool.stats.num_wipes == 1


def test_a_miniwob_pages_globals_and_storage_are_gone_in_the_next_episode_on_the_same_page() -> None:
    """Without the wipe the next episode of a task reuses its loaded page (its JavaScript heap included)."""
    [example] = BrowserEnvironment.make_tasks(1, seed=0, tasks=["click-test-2"])
    context = EpisodeContext(seed=0, sample_index=0, max_turns=4, max_tokens=4096)
    plant = "window.planted = 'A'; localStorage.setItem('k', 'A');"
    look = "return [window.planted ?? null, localStorage.getItem('k')];"

    def next_episode_sees(pool: BrowserPool) -> list[Any]:
        async def episodes() -> list[Any]:
            first, second = BrowserEnvironment(pool=pool), BrowserEnvironment(pool=pool)
            await first.reset(example, context)
            async with pool.lease(first) as lease:
                await lease.run(lambda driver: driver.execute_script(plant))
            await second.reset(example, context)
            async with pool.lease(second) as lease:
                return await lease.run(lambda driver: driver.execute_script(look))

        try:
            return asyncio.run(episodes())
        finally:
            pool.close()

    assert next_episode_sees(BrowserPool(size=1, isolate_episodes=False)) == ["A", "A"]
    assert next_episode_sees(BrowserPool(size=1)) == [None, None]


@pytest.fixture
def browser_factory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    """Starts browsers (killed at the end) with ``HOME`` and the working directory in ``tmp_path``."""
    (tmp_path / "home").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_DOWNLOAD_DIR", raising=False)
    monkeypatch.chdir(tmp_path / "cwd")
    started: list[Browser] = []

    def start(*, is_isolated: bool) -> Browser:
        browser = start_browser(
            chromium="chromium", chromedriver="chromedriver", js_heap_mb=128, is_isolated=is_isolated
        )
        started.append(browser)
        return browser

    yield start
    for browser in started:
        browser.kill()


def download(browser: Browser, folder: Path, name: str) -> None:
    """A page that saves ``name`` (an ``<a download>`` of a data: URL, clicked by script)."""
    page = folder / "download.html"
    script = f"const a = document.createElement('a'); a.href = 'data:text/plain,LEAK'; a.download = '{name}';"
    page.write_text(f"<!doctype html><body><script>{script} document.body.appendChild(a); a.click();</script>")
    browser.driver.get(page.as_uri())


def saved(roots: list[Path], name: str, *, wait_s: float) -> list[Path]:
    deadline = time.monotonic() + wait_s
    while True:
        found = [path for root in roots for path in root.rglob(f"{name}*")]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_a_download_lands_in_home_without_isolation_and_nowhere_with_it(browser_factory: Any, tmp_path: Path) -> None:
    home = tmp_path / "home"
    real_downloads = Path(pwd.getpwuid(os.getuid()).pw_dir) / "Downloads"  # HOME is the test's own by now
    isolated = browser_factory(is_isolated=True)
    download(isolated, tmp_path, name := f"leak-{uuid.uuid4().hex}.txt")
    assert saved([tmp_path, Path(isolated.user_data_dir), real_downloads], name, wait_s=2.0) == []
    assert list(home.iterdir()) == []  # nor does Chromium's own writing (crash reports, dconf) reach the home

    naive = browser_factory(is_isolated=False)
    download(naive, tmp_path, name := f"leak-{uuid.uuid4().hex}.txt")
    assert saved([home], name, wait_s=10.0) == [home / "Downloads" / name]


class Listeners:
    """A TCP and a UDP socket on 127.0.0.1 that count what reaches them (each on a thread of its own)."""

    def __init__(self) -> None:
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.num_connections = self.num_datagrams = 0
        self.is_closed = False
        for sock, count in ((self.tcp, self._accept), (self.udp, self._receive)):
            sock.settimeout(0.1)
            threading.Thread(target=self._listen, args=(count,), daemon=True).start()

    def _accept(self) -> None:
        connection, _ = self.tcp.accept()
        connection.close()
        self.num_connections += 1

    def _receive(self) -> None:
        self.udp.recvfrom(2048)
        self.num_datagrams += 1

    def _listen(self, count: Any) -> None:
        while not self.is_closed:
            with contextlib.suppress(TimeoutError):
                count()

    def close(self) -> None:
        self.is_closed = True
        time.sleep(0.2)
        self.tcp.close()
        self.udp.close()


# Every route a page has to the network that needs no user: fetch, WebSocket, EventSource, an image, a beacon (to
# the loopback address and to localhost, which Chromium keeps off its proxy by default), and WebRTC (a STUN server
# and a TURN server over UDP; the ICE candidates it gathers).
_REACH_OUT = """
const done = arguments[arguments.length - 1];
const tcp = arguments[0], udp = arguments[1];
(async () => {
  for (const host of ['127.0.0.1', 'localhost']) {
    fetch(`http://${host}:${tcp}/fetch`, {mode: 'no-cors'}).catch(() => {});
    try { new WebSocket(`ws://${host}:${tcp}/socket`).onerror = () => {}; } catch (error) {}
    try { new EventSource(`http://${host}:${tcp}/events`).onerror = () => {}; } catch (error) {}
    new Image().src = `http://${host}:${tcp}/image`;
    navigator.sendBeacon(`http://${host}:${tcp}/beacon`, 'x');
  }
  const candidates = [];
  const peer = new RTCPeerConnection({iceServers: [
    {urls: `stun:127.0.0.1:${udp}`},
    {urls: `turn:127.0.0.1:${udp}?transport=udp`, username: 'u', credential: 'c'},
  ]});
  peer.onicecandidate = (event) => { if (event.candidate) candidates.push(event.candidate.candidate); };
  peer.createDataChannel('out');
  await peer.setLocalDescription(await peer.createOffer());
  await new Promise((wait) => setTimeout(wait, 2000));
  peer.close();
  return candidates;
})().then(done, (error) => done(String(error)));
"""


def reach_out(browser: Browser, folder: Path, listeners: Listeners) -> list[str]:
    """A page's attempts to reach ``listeners``; the ICE candidates WebRTC gathered."""
    (folder / "page.html").write_text("<!doctype html><title>out</title>")
    browser.driver.get((folder / "page.html").as_uri())
    browser.driver.set_script_timeout(10)
    ports = listeners.tcp.getsockname()[1], listeners.udp.getsockname()[1]
    candidates = browser.driver.execute_async_script(_REACH_OUT, *ports)
    time.sleep(0.5)  # let late connections arrive
    return candidates


def test_page_script_reaches_loopback_tcp_and_udp_without_isolation_and_nothing_with_it(
    browser_factory: Any, tmp_path: Path
) -> None:
    listeners = Listeners()
    try:
        naive = browser_factory(is_isolated=False)
        candidates = reach_out(naive, tmp_path, listeners)
        naive.kill()  # its EventSources would go on reconnecting
        assert listeners.num_connections >= 1 and listeners.num_datagrams >= 1  # the STUN or TURN request
        assert any(" typ host " in candidate for candidate in candidates), candidates

        listeners.num_connections = listeners.num_datagrams = 0
        candidates = reach_out(browser_factory(is_isolated=True), tmp_path, listeners)
        assert (listeners.num_connections, listeners.num_datagrams, candidates) == (0, 0, [])
    finally:
        listeners.close()
