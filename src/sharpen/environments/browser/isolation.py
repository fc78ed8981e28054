"""What keeps a page from reaching the host, the network or a later episode through a pooled browser.

Owns three promises and the means that keep them (each proved by an attack test in
``tests/integration/test_browser_isolation.py``, beside a control that shows the attack works on a browser
without it):

* **No network from page script, by any route.** Every host name resolves to nothing, every proxied request goes
  to a closed port, loopback is proxied too (Chromium sends ``localhost`` and ``127.0.0.1`` around its proxy
  unless told ``<-loopback>``), and WebRTC may send no UDP that does not go through the (dead) proxy, so it
  gathers no candidate and sends no STUN packet (Chromium's own policy flag: it covers every frame, popup and
  worker, which a script injected into pages would not).
* **No download leaves the browser's own disposable profile.** Downloads are denied (``Browser.
  setDownloadBehavior``; the preferences also point any download into the profile and block them), and Chromium
  runs with ``HOME`` and the XDG folders inside the profile, so nothing it writes by default (``~/Downloads``,
  crash reports, dconf) lands in the real home; the profile is deleted with the browser.
* **No state crosses episodes on a reused browser.** `wipe_browser` runs when a browser passes to another
  episode and when an episode's reset starts: it closes extra windows, leaves the page (its JavaScript heap,
  workers and open connections go with it), clears ``window.name``, session storage and the tab's history, and
  clears every kind of storage of the ``file://`` origin (local storage, IndexedDB, Cache Storage, file systems,
  service workers), the cookies and the HTTP cache. All ``file://`` pages share one storage origin in Chromium,
  which is why one task's page could read what another's wrote. Service workers cannot register on ``file://``
  at all (Chromium refuses the scheme), and cookies are not stored for it; both are cleared anyway.

A fresh profile per episode (a new browser, about a second on an idle core) would keep the same promise at several
times the cost of a wipe (`benchmarks/browser.py` measures both); a new browser context per episode
(``Target.createBrowserContext``) is refused through chromedriver's page session ("Not allowed"). This module does
not start, lend or kill browsers (`sharpen.environments.browser.pool`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

BLANK_PAGE = "sharpen-blank.html"
"""A page of the browser's own ``file://`` origin that the wipe passes through (session storage is cleared by
script on a page of its origin; the DevTools protocol clears it only while such a page is shown)."""

_ORIGINS = ("file://",)
"""The storage origins a page can write to: only ``file://`` pages load (the network is closed), and ``data:``
and ``about:blank`` documents are opaque or inherit their opener's origin."""


def isolation_arguments() -> list[str]:
    """Chromium's flags that close the network to page script, WebRTC included."""
    return [
        "--proxy-server=http://127.0.0.1:9",  # the discard port: nothing listens, every proxied request fails
        "--proxy-bypass-list=<-loopback>",  # and loopback is proxied too (Chromium bypasses the proxy for it)
        "--host-resolver-rules=MAP * ~NOTFOUND",  # and no host name resolves
        # WebRTC: no UDP but through the proxy (there is none): no candidate is gathered, no STUN packet sent
        "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
        "--webrtc-ip-handling-policy=disable_non_proxied_udp",
    ]


def download_preferences(user_data_dir: str) -> dict[str, Any]:
    """Chromium's preferences: any download goes into the profile, and downloads are blocked (3: all)."""
    return {
        "download.default_directory": os.path.join(user_data_dir, "downloads"),
        "download.prompt_for_download": False,
        "download_restrictions": 3,
        "savefile.default_directory": os.path.join(user_data_dir, "downloads"),
    }


def confined_environment(user_data_dir: str) -> dict[str, str]:
    """chromedriver's (and so Chromium's) environment: the caller's, with the home and XDG folders in the profile."""
    return os.environ | {
        "HOME": user_data_dir,
        "XDG_CONFIG_HOME": os.path.join(user_data_dir, ".config"),
        "XDG_CACHE_HOME": os.path.join(user_data_dir, ".cache"),
        "XDG_DATA_HOME": os.path.join(user_data_dir, ".local", "share"),
        "XDG_DOWNLOAD_DIR": os.path.join(user_data_dir, "downloads"),
    }


def write_blank_page(user_data_dir: str) -> str:
    """Write `BLANK_PAGE` into the profile; its ``file://`` URL."""
    path = Path(user_data_dir) / BLANK_PAGE
    path.write_text("<!doctype html><title>sharpen</title>")
    return path.as_uri()


def guard_browser(driver: Any) -> None:
    """Deny downloads in a just-started browser (for the whole browser, not one tab)."""
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "deny"})


def wipe_browser(driver: Any, blank_url: str) -> None:
    """Leave nothing of one episode for the next on ``driver``'s browser (see the module's docstring); the browser
    then shows ``blank_url``."""
    handles = driver.window_handles
    if len(handles) > 1:  # popups a page opened: close all but the first window
        for handle in handles[1:]:
            driver.switch_to.window(handle)
            driver.close()
        driver.switch_to.window(handles[0])
    driver.get(blank_url)
    driver.execute_script("window.name = ''; sessionStorage.clear();")
    driver.execute_cdp_cmd("Page.resetNavigationHistory", {})
    for origin in _ORIGINS:
        driver.execute_cdp_cmd("Storage.clearDataForOrigin", {"origin": origin, "storageTypes": "all"})
    driver.execute_cdp_cmd("Network.clearBrowserCookies", {})
    driver.execute_cdp_cmd("Network.clearBrowserCache", {})
