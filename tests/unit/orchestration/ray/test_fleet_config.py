"""What a run's sandbox fleet needs without Ray: the config that asks for one, and a replica client that follows
a fleet's changing URLs (`ReplicaClient.set_urls`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sharpen.config.sandbox import SandboxConfig
from sharpen.config.service import RemoteConfig
from sharpen.serving import ReplicaClient, ReplicaLost


def test_a_remote_sandbox_needs_urls_or_a_fleet() -> None:
    config = SandboxConfig.model_validate({"backend": "remote", "fleet": {"num_replicas": 3, "num_cpus": 0.25}})
    assert config.fleet is not None and config.fleet.num_replicas == 3 and config.fleet.backend == "auto"
    with pytest.raises(ValidationError, match=r"sandbox.remote.urls \(or a sandbox.fleet\)"):
        SandboxConfig(backend="remote")
    with pytest.raises(ValidationError, match=r'set sandbox.backend = "remote"'):
        SandboxConfig.model_validate({"backend": "bwrap", "fleet": {}})
    with pytest.raises(ValidationError, match="num_replicas"):
        SandboxConfig.model_validate({"backend": "remote", "fleet": {"num_replicas": 0}})
    with pytest.raises(ValidationError, match="backend"):  # a fleet's replicas run a local sandbox
        SandboxConfig.model_validate({"backend": "remote", "fleet": {"backend": "remote"}})


def test_client_follows_new_urls_and_keeps_the_replicas_it_had(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", "t")
    client = ReplicaClient(RemoteConfig(urls=["http://a:1", "http://b:1"]), what="sandbox")
    try:
        kept = client.replica("http://b:1")
        kept.num_in_flight = 2
        client.set_urls(["http://b:1", "http://c:1", "http://c:1"])
        assert [r.url for r in client.replicas] == ["http://b:1", "http://c:1"]
        assert client.replica("http://b:1") is kept and kept.num_in_flight == 2
        assert client.pick(avoid=set()) is client.replica("http://c:1")  # the least busy
        with pytest.raises(ReplicaLost, match="http://a:1 is no longer one of this client's replicas"):
            client.call("POST", "/v1/sessions/x/send", {}, pin="http://a:1")
        with pytest.raises(ValueError, match="at least one replica URL"):
            client.set_urls([])
    finally:
        client.close()


def test_an_environment_fleet_stands_for_the_remote_urls_and_remote_alone_still_needs_them() -> None:
    from sharpen.config.environments import GuessNumberEnvironmentConfig

    section = GuessNumberEnvironmentConfig.model_validate({"fleet": {"num_replicas": 3}})
    assert section.fleet is not None and section.fleet.num_replicas == 3 and section.remote is None
    with_settings = GuessNumberEnvironmentConfig.model_validate({"fleet": {}, "remote": {"timeout_s": 5}})
    assert with_settings.remote is not None and with_settings.remote.urls == []
    with pytest.raises(ValidationError, match=r"environment\.remote\.urls \(or an environment\.fleet\)"):
        GuessNumberEnvironmentConfig.model_validate({"remote": {"timeout_s": 5}})
