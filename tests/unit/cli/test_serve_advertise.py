"""A served replica's own address (`SHARPEN_ADVERTISE_URL`, set by the Helm chart from the pod's IP): unset means
none; anything but an http(s) URL, or a `$(VAR)` that Kubernetes left unexpanded, stops the server in one line."""

from __future__ import annotations

import pytest

from sharpen.cli.main import EXIT_USER_ERROR, main
from sharpen.cli.serve import advertised_url
from sharpen.config.service import ADVERTISE_URL_ENV


def test_an_unset_or_empty_address_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADVERTISE_URL_ENV, raising=False)
    assert advertised_url(ADVERTISE_URL_ENV) is None
    monkeypatch.setenv(ADVERTISE_URL_ENV, " ")
    assert advertised_url(ADVERTISE_URL_ENV) is None
    monkeypatch.setenv(ADVERTISE_URL_ENV, "http://10.1.2.3:8100/")
    assert advertised_url(ADVERTISE_URL_ENV) == "http://10.1.2.3:8100"


@pytest.mark.parametrize("address", ["10.1.2.3:8100", "http://$(POD_IP):8100"])
def test_a_server_refuses_an_address_that_is_no_url(
    address: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", "cli-advertise-test-token")
    monkeypatch.setenv(ADVERTISE_URL_ENV, address)
    assert main(["serve-sandbox", "--port", "0"]) == EXIT_USER_ERROR
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and ADVERTISE_URL_ENV in lines[0] and "http(s) URL" in lines[0], lines
