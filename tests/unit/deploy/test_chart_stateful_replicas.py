"""The sandbox and environment pods hold state (relay sessions, episodes) behind one Service: each pod advertises
its own address, which the server accepts once Kubernetes has expanded it, on the port its Service and its
NetworkPolicy admit. The client side is tests/unit/environments/test_remote_fleet_behind_service.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
from chart_harness import RELEASE

from sharpen.cli.serve import advertised_url
from sharpen.config.service import ServiceConfig

ADVERTISE_ENV = ServiceConfig().advertise_url_env


def _expand(env: list[dict[str, Any]], pod_ip: str) -> dict[str, str]:
    """The container's variables as Kubernetes sets them: a fieldRef from the pod, $(NAME) only from those above."""
    values: dict[str, str] = {}
    for variable in env:
        if variable.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            values[variable["name"]] = pod_ip
        elif "value" in variable:
            values[variable["name"]] = re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), variable["value"])
    return values


@pytest.mark.parametrize("component", ["sandbox", "environment"])
def test_each_pod_advertises_its_own_address_on_its_service_port(
    component: str, all_components: list[dict[str, Any]], find: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"{RELEASE}-{component}"
    pod = find(all_components, "Deployment", name)["spec"]["template"]
    container = pod["spec"]["containers"][0]
    port = container["ports"][0]["containerPort"]
    expanded = _expand(container["env"], pod_ip="10.1.2.3")
    assert expanded[ADVERTISE_ENV] == f"http://10.1.2.3:{port}"
    monkeypatch.setenv(ADVERTISE_ENV, expanded[ADVERTISE_ENV])
    assert advertised_url(ADVERTISE_ENV) == f"http://10.1.2.3:{port}", "the server takes the expanded address"

    service = find(all_components, "Service", name)["spec"]
    assert service["ports"][0]["port"] == port and service["ports"][0]["targetPort"] == "http"
    # A pinned call reaches the pod at its own IP, not through the Service: the policy must admit it by the pod's
    # labels and port, which it does for both paths alike.
    policy = find(all_components, "NetworkPolicy", name)["spec"]
    labels = pod["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert [p["port"] for p in policy["ingress"][0]["ports"]] == [port]
