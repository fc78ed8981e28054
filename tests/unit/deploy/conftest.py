"""Fixtures of the deploy tests: the rendered value sets, an object finder, and no network.

Python sockets are closed for every test here, so a validator that reached for a schema over the network would
fail, not pass. (Helm runs in a child process, below this patch; it renders and lints a local chart without a
cluster or a repository.)
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from chart_harness import VALUES_FILES, load_values, render_chart


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network access in an offline deploy test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    yield


@pytest.fixture(scope="session")
def rendered_sets() -> dict[str, list[dict[str, Any]]]:
    return {name: render_chart(load_values(path)) for name, path in VALUES_FILES.items()}


@pytest.fixture(scope="session")
def all_components(rendered_sets: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return rendered_sets["all-components-values"]


@pytest.fixture
def find() -> Callable[[list[dict[str, Any]], str, str], dict[str, Any]]:
    def find_object(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
        matches = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
        assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
        return matches[0]

    return find_object
