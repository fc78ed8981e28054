"""Security and operability properties of every rendered workload: non-root, read-only root filesystem, seccomp,
no capabilities, resources, probes, disruption budgets, autoscaling on queue depth, and network isolation (the
sandbox has no egress at all). Pod templates inside KubeRay's RayCluster and RayJob are checked like any other."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from chart_harness import RELEASE, VALUES_FILES, load_values, render_chart

Finder = Callable[[list[dict[str, Any]], str, str], dict[str, Any]]
WORKLOAD_KINDS = {"Deployment": ("spec", "template"), "Job": ("spec", "template")}
# The one pod that may not run under RuntimeDefault: bubblewrap's namespace and mount calls need a profile of its own.
SANDBOX = f"{RELEASE}-sandbox"


def _pod_templates(manifests: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every pod template: a workload's (named as the workload), and a KubeRay object's head, worker groups and job
    submitter (named "<object>:head", "<object>:worker-<group>", "<object>:submitter")."""
    for manifest in manifests:
        name = manifest["metadata"]["name"]
        if manifest["kind"] in WORKLOAD_KINDS:
            yield name, manifest["spec"]["template"]
        spec = manifest.get("spec", {})
        cluster = {"RayCluster": spec, "RayJob": spec.get("rayClusterSpec")}.get(manifest["kind"])
        if cluster:
            yield f"{name}:head", cluster["headGroupSpec"]["template"]
            for group in cluster.get("workerGroupSpecs", []):
                yield f"{name}:worker-{group['groupName']}", group["template"]
        if manifest["kind"] == "RayJob":
            yield f"{name}:submitter", manifest["spec"]["submitterPodTemplate"]


@pytest.fixture(params=sorted(VALUES_FILES))
def manifests(request: pytest.FixtureRequest, rendered_sets: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return rendered_sets[request.param]


def test_every_container_is_locked_down(manifests: list[dict[str, Any]]) -> None:
    for name, template in _pod_templates(manifests):
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        assert pod["automountServiceAccountToken"] is False, name
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), name
        for container in pod["containers"] + pod.get("initContainers", []):
            context = container["securityContext"]
            where = f"{name}/{container['name']}"
            assert context["runAsNonRoot"] is True, where
            assert context.get("runAsUser", 1) != 0, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context.get("privileged", False) is False, where
            assert context["capabilities"] == {"drop": ["ALL"]}, where
            seccomp = context["seccompProfile"]
            assert seccomp == pod["securityContext"]["seccompProfile"], where
            if name == SANDBOX:
                assert seccomp == {"type": "Localhost", "localhostProfile": "profiles/sharpen-sandbox.json"}
            else:
                assert seccomp == {"type": "RuntimeDefault"}, where
                assert "appArmorProfile" not in context and "procMount" not in context, where


def test_the_sandbox_unmasks_proc_only_inside_a_pod_user_namespace(manifests: list[dict[str, Any]]) -> None:
    for name, template in _pod_templates(manifests):
        for container in template["spec"]["containers"]:
            if container["securityContext"].get("procMount") == "Unmasked":
                assert name == SANDBOX and template["spec"]["hostUsers"] is False


def test_the_sandbox_without_user_namespaces_keeps_proc_masked(find: Finder) -> None:
    manifests = render_chart({"sandbox": {"userNamespace": False}})
    pod = find(manifests, "Deployment", SANDBOX)["spec"]["template"]["spec"]
    assert "hostUsers" not in pod and "procMount" not in pod["containers"][0]["securityContext"]


def test_every_container_has_requests_and_limits(manifests: list[dict[str, Any]]) -> None:
    for name, template in _pod_templates(manifests):
        for container in template["spec"]["containers"]:
            resources = container["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[kind]), f"{name}: {kind}"


def test_gpus_are_requested_where_configured(all_components: list[dict[str, Any]]) -> None:
    expected = {"judge": 2, "reward-model": 1, "train:worker-gpu": 8, "train:head": 0, "train:worker-cpu": 0}
    templates = dict(_pod_templates(all_components))
    for component, gpus in expected.items():
        resources = templates[f"{RELEASE}-{component}"]["spec"]["containers"][0]["resources"]
        if gpus:
            assert resources["limits"]["nvidia.com/gpu"] == gpus == resources["requests"]["nvidia.com/gpu"]
        else:
            assert "nvidia.com/gpu" not in resources["limits"]


def test_every_deployment_has_probes_and_a_disruption_budget(manifests: list[dict[str, Any]]) -> None:
    budgets = [m for m in manifests if m["kind"] == "PodDisruptionBudget"]
    for manifest in manifests:
        if manifest["kind"] != "Deployment":
            continue
        name = manifest["metadata"]["name"]
        for container in manifest["spec"]["template"]["spec"]["containers"]:
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                assert probe in container, f"{name}: {probe}"
        pod_labels = manifest["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()]
        assert len(covering) == 1, f"{name}: {len(covering)} PodDisruptionBudgets"


def test_services_use_their_servers_real_health_routes(all_components: list[dict[str, Any]], find: Finder) -> None:
    def probe_paths(component: str) -> tuple[str, str]:
        container = find(all_components, "Deployment", f"{RELEASE}-{component}")["spec"]["template"]["spec"]
        probes = container["containers"][0]
        return probes["livenessProbe"]["httpGet"]["path"], probes["readinessProbe"]["httpGet"]["path"]

    assert probe_paths("sandbox") == ("/healthz", "/readyz")
    assert probe_paths("environment") == ("/healthz", "/readyz")
    assert probe_paths("reward-model") == ("/healthz", "/readyz")  # sharpen serve-rm, on the same service shell
    assert probe_paths("judge") == ("/health", "/health")  # vllm serve


def test_every_service_selects_pods_and_a_named_port(manifests: list[dict[str, Any]]) -> None:
    templates = [m["spec"]["template"] for m in manifests if m["kind"] == "Deployment"]
    for service in (m for m in manifests if m["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        selected = [t for t in templates if selector <= t["metadata"]["labels"].items()]
        assert len(selected) == 1, service["metadata"]["name"]
        port_names = {p["name"] for c in selected[0]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names


def test_queue_servers_scale_on_queue_depth(all_components: list[dict[str, Any]], find: Finder) -> None:
    for component in ("sandbox", "environment"):
        hpa = find(all_components, "HorizontalPodAutoscaler", f"{RELEASE}-{component}")
        assert hpa["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-{component}"
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "sharpen_queue_depth"
        # an HPA owns the replica count: a Deployment that also sets one would fight it on every upgrade
        assert "replicas" not in find(all_components, "Deployment", f"{RELEASE}-{component}")["spec"]


def test_the_sandbox_has_no_egress_and_admits_only_clients(all_components: list[dict[str, Any]], find: Finder) -> None:
    policy = find(all_components, "NetworkPolicy", SANDBOX)["spec"]
    deployment = find(all_components, "Deployment", SANDBOX)
    assert policy["podSelector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert "Egress" in policy["policyTypes"] and policy["egress"] == []
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8100}]
    client = next(peer for peer in rule["from"] if "podSelector" in peer)
    assert client == {"podSelector": {"matchLabels": {"sharpen-client": "true"}}}


def test_every_pod_is_under_a_network_policy(manifests: list[dict[str, Any]]) -> None:
    policies = [m["spec"] for m in manifests if m["kind"] == "NetworkPolicy"]
    for name, template in _pod_templates(manifests):
        labels = template["metadata"]["labels"].items()
        covering = [p for p in policies if p["podSelector"]["matchLabels"].items() <= labels]
        assert covering, name
        assert all(set(p["policyTypes"]) == {"Ingress", "Egress"} for p in covering), name


def test_callers_of_the_sandbox_carry_the_client_label(all_components: list[dict[str, Any]]) -> None:
    clients = {name for name, t in _pod_templates(all_components) if t["metadata"]["labels"].get("sharpen-client")}
    ray = ("train:head", "train:worker-gpu", "train:worker-cpu", "train:submitter")
    assert clients == {f"{RELEASE}-{c}" for c in ("environment", *ray)}


def test_tokens_come_from_the_secret(all_components: list[dict[str, Any]], find: Finder) -> None:
    secret = find(all_components, "Secret", f"{RELEASE}-auth")
    assert set(secret["data"]) == {"service-token", "ray-token"}
    for name, template in _pod_templates(all_components):
        for container in template["spec"]["containers"]:
            for variable in container.get("env", []):
                if variable["name"] in {"SHARPEN_SERVICE_TOKEN", "RAY_AUTH_TOKEN"}:
                    assert variable["valueFrom"]["secretKeyRef"]["name"] == f"{RELEASE}-auth", name


def test_the_training_job_runs_sharpen_on_the_ray_cluster(find: Finder) -> None:
    # the static mode's driver; the RayJob's is in test_kuberay.py
    manifests = render_chart(load_values(VALUES_FILES["ray-static-values"]))
    job = find(manifests, "Job", f"{RELEASE}-train")["spec"]
    container = job["template"]["spec"]["containers"][0]
    script, *positional = container["args"]
    assert 'sharpen train /etc/sharpen/train.toml \'runtime.type="ray"\' \'runtime.address="auto"\' "$@"' in script
    assert positional == ["train", 'run.name="k8s-static"']
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    address = next(v["value"] for v in container["env"] if v["name"] == "RAY_ADDRESS")
    assert address == f"{RELEASE}-ray-head:6379"
    find(manifests, "Service", f"{RELEASE}-ray-head")


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


def test_memory_backed_volumes_fit_in_the_memory_limit(manifests: list[dict[str, Any]]) -> None:
    # a tmpfs emptyDir is charged to the pod's memory: a /dev/shm as large as the limit would get the pod killed
    for name, template in _pod_templates(manifests):
        pod = template["spec"]
        in_memory = sum(
            _bytes(v["emptyDir"]["sizeLimit"])
            for v in pod["volumes"]
            if v.get("emptyDir", {}).get("medium") == "Memory"
        )
        limit = sum(_bytes(c["resources"]["limits"]["memory"]) for c in pod["containers"])
        assert in_memory <= limit // 2, name
