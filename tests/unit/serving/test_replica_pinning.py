"""`ReplicaClient.pin`: what a session or an episode is pinned to. The address its replica advertised (a pod behind a
Kubernetes Service) when the answer carries one, else the URL called; an advertised address takes pinned calls only
and is refused, in one line, when it is not an http(s) URL. The fleet behind a round-robin proxy is
tests/unit/environments/test_remote_fleet_behind_service.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sharpen.config.service import RemoteConfig
from sharpen.serving.replicas import ReplicaClient, ReplicaLost, ServiceRequestError

SERVICE = "http://sharpen-environment:8200"


@pytest.fixture
def client() -> Iterator[ReplicaClient]:
    client = ReplicaClient(RemoteConfig(urls=[SERVICE], token_env=None), what="environment")
    yield client
    client.close()


def test_an_answer_without_an_address_pins_to_the_url_called(client: ReplicaClient) -> None:
    assert client.pin(SERVICE, {"episode_id": "e1"}) == SERVICE


def test_an_advertised_address_takes_pinned_calls_only(client: ReplicaClient) -> None:
    pod = client.pin(SERVICE, {"episode_id": "e1", "replica_url": "http://10.0.0.7:8200/"})
    assert pod == "http://10.0.0.7:8200"
    assert client.replica(pod).url == pod
    assert [r.url for r in client.replicas] == [SERVICE]
    assert {client.pick(avoid=set()).url for _ in range(4)} == {SERVICE}  # type: ignore[union-attr]
    with pytest.raises(ReplicaLost, match="no longer one of"):
        client.replica("http://10.0.0.8:8200")


def test_an_advertised_address_that_is_a_configured_url_is_that_replica() -> None:
    urls = ["http://10.0.0.7:8200", "http://10.0.0.8:8200"]
    with_two = ReplicaClient(RemoteConfig(urls=urls, token_env=None), what="sandbox")
    try:
        assert with_two.pin(urls[0], {"replica_url": urls[1]}) == urls[1]
        assert with_two.replica(urls[1]) is with_two.replicas[1]
    finally:
        with_two.close()


@pytest.mark.parametrize("advertised", ["10.0.0.7:8200", "", 7])
def test_an_advertised_address_that_is_no_url_is_refused(client: ReplicaClient, advertised: object) -> None:
    with pytest.raises(ServiceRequestError, match=r"advertises .* not an http"):
        client.pin(SERVICE, {"replica_url": advertised})
