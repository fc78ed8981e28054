"""When `BrowserPool` wipes a browser, with a recording stand-in for the driver (no Chromium): before another
episode's call and before a new episode's reset, never before the same episode's next turn nor on a browser nobody
used; and what a wipe asks of the driver. The real attacks are in tests/integration/test_browser_isolation.py."""

from __future__ import annotations

import asyncio
from typing import Any

from sharpen.environments.browser import isolation
from sharpen.environments.browser.pool import Browser, BrowserPool, chromium_arguments


class RecordingDriver:
    """Records the driver calls a wipe makes; shows two windows (a popup) the first time it is asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.handles = ["main", "popup"]
        self.current = "main"

    @property
    def window_handles(self) -> list[str]:
        return list(self.handles)

    @property
    def switch_to(self) -> Any:
        driver = self

        class SwitchTo:
            def window(self, handle: str) -> None:
                driver.calls.append(("switch", handle))
                driver.current = handle

        return SwitchTo()

    def close(self) -> None:
        self.calls.append(("close", self.current))
        self.handles.remove(self.current)

    def get(self, url: str) -> None:
        self.calls.append(("get", url))

    def execute_script(self, script: str) -> None:
        self.calls.append(("script", script))

    def execute_cdp_cmd(self, command: str, arguments: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((command, arguments))
        return {}


class RecordedBrowser(Browser):
    def kill(self) -> None:  # there is no process to kill
        self.is_dead = True


def recording_pool(*, isolate_episodes: bool = True) -> BrowserPool:
    pool = BrowserPool(size=1, isolate_episodes=isolate_episodes)
    browser = RecordedBrowser(driver=RecordingDriver(), process=None, user_data_dir="/nonexistent")
    pool._start = lambda: browser
    return pool


def wipes(pool: BrowserPool, leases: list[tuple[object, bool]]) -> list[int]:
    """``pool.stats.num_wipes`` after each of ``leases`` (an owner, and whether its episode is new)."""

    async def lend() -> list[int]:
        seen = []
        for owner, is_new_episode in leases:
            async with pool.lease(owner, is_new_episode=is_new_episode) as lease:
                lease.browser.owner = owner  # as the environment does once its page is shown
            seen.append(pool.stats.num_wipes)
        return seen

    try:
        return asyncio.run(lend())
    finally:
        pool.close()


def test_a_browser_is_wiped_before_another_episode_or_a_new_episodes_reset_only() -> None:
    a, b = object(), object()
    leases = [(a, True), (a, False), (a, False), (b, False), (b, False), (b, True), (a, False)]
    # fresh: none; a's turns: none; b's call: one; b's turn: none; b's next episode: one; a again: one
    assert wipes(recording_pool(), leases) == [0, 0, 0, 1, 1, 2, 3]
    assert wipes(recording_pool(isolate_episodes=False), leases) == [0] * len(leases)


def test_a_wipe_closes_popups_leaves_the_page_and_clears_every_store_of_the_file_origin() -> None:
    driver = RecordingDriver()
    isolation.wipe_browser(driver, "file:///profile/blank.html")
    assert driver.handles == ["main"]
    assert driver.calls == [
        ("switch", "popup"),
        ("close", "popup"),
        ("switch", "main"),
        ("get", "file:///profile/blank.html"),  # the page leaves first, so its handlers cannot write again
        ("script", "window.name = ''; sessionStorage.clear();"),
        ("Page.resetNavigationHistory", {}),
        ("Storage.clearDataForOrigin", {"origin": "file://", "storageTypes": "all"}),
        ("Network.clearBrowserCookies", {}),
        ("Network.clearBrowserCache", {}),
    ]


def test_the_isolated_flags_close_loopback_and_webrtc_udp_and_the_naive_control_has_none() -> None:
    flags = chromium_arguments("/profile", js_heap_mb=64)
    assert {"--proxy-bypass-list=<-loopback>", "--host-resolver-rules=MAP * ~NOTFOUND"} <= set(flags)
    assert "--force-webrtc-ip-handling-policy=disable_non_proxied_udp" in flags
    naive = chromium_arguments("/profile", js_heap_mb=64, is_isolated=False)
    assert not [flag for flag in naive if "proxy" in flag or "resolver" in flag or "webrtc" in flag]
    home = isolation.confined_environment("/profile")
    assert home["HOME"] == "/profile" and all(home[k].startswith("/profile/") for k in home if k.startswith("XDG_"))
