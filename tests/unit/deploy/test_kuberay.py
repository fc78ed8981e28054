"""The chart's Ray part, in both modes: KubeRay's RayCluster and RayJob validate against KubeRay's own CRD schemas
(and a broken one fails), satisfy the operator's own checks that the chart could break, probe like KubeRay, never
block a drain, and carry the scheduling knobs; the static mode (Deployments and a Job) keeps working without the
operator."""

from __future__ import annotations

import copy
import re
import shlex
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from chart_harness import (
    CHART,
    RELEASE,
    VALUES_FILES,
    HelmFailed,
    ManifestInvalid,
    load_values,
    render_chart,
    validate_manifest,
)
from kuberay_schemas import KINDS, SCHEMAS, strict_schema

Finder = Callable[[list[dict[str, Any]], str, str], dict[str, Any]]
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@pytest.fixture(scope="module")
def shared_cluster() -> list[dict[str, Any]]:
    return render_chart(load_values(VALUES_FILES["kuberay-cluster-values"]))


@pytest.fixture(scope="module")
def static() -> list[dict[str, Any]]:
    return render_chart(load_values(VALUES_FILES["ray-static-values"]))


def _cluster_specs(manifests: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for manifest in manifests:
        if manifest["kind"] == "RayCluster":
            yield manifest["metadata"]["name"], manifest["spec"]
        elif manifest["kind"] == "RayJob" and "rayClusterSpec" in manifest["spec"]:
            yield manifest["metadata"]["name"], manifest["spec"]["rayClusterSpec"]


def _node_templates(manifests: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(role, pod template) of every Ray node, KubeRay's and the static Deployments'."""
    for _, spec in _cluster_specs(manifests):
        yield "head", spec["headGroupSpec"]["template"]
        for group in spec["workerGroupSpecs"]:
            yield "worker", group["template"]
    for manifest in manifests:
        component = manifest["metadata"]["labels"].get("app.kubernetes.io/component", "")
        if manifest["kind"] == "Deployment" and component.startswith("ray-"):
            yield component.removeprefix("ray-"), manifest["spec"]["template"]


# --- the vendored schemas and the validator -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_vendored_schemas_are_json_schemas_with_their_licence(kind: str) -> None:
    jsonschema.Draft7Validator.check_schema(strict_schema(kind))
    readme = (SCHEMAS / "README.md").read_text()
    assert KINDS[kind] in readme and "59d663aeec13760646da3db9c1cf8cfe883e30b7" in readme
    assert "Apache License" in (SCHEMAS / "LICENSE").read_text()


def test_every_values_set_with_ray_renders_kuberay_or_static_objects(
    rendered_sets: dict[str, list[dict[str, Any]]],
) -> None:
    kinds = {name: {m["kind"] for m in manifests} for name, manifests in rendered_sets.items()}
    assert {"RayJob"} <= kinds["all-components-values"] and "RayCluster" not in kinds["all-components-values"]
    assert {"RayCluster", "RayJob"} <= kinds["kuberay-cluster-values"]
    assert {"Deployment", "Job"} <= kinds["ray-static-values"] and not {"RayCluster", "RayJob"} & kinds[
        "ray-static-values"
    ]


def test_a_wrongly_typed_value_fails_kuberays_schema() -> None:
    values = copy.deepcopy(load_values(VALUES_FILES["all-components-values"]))
    assert values is not None
    # rayStartParams is map[string]string in KubeRay: an unquoted number renders but the operator's schema refuses it
    values["ray"]["workerGroups"]["gpu"]["rayStartParams"] = {"object-store-memory": 10_000_000_000}
    job = next(m for m in render_chart(values) if m["kind"] == "RayJob")
    with pytest.raises(
        ManifestInvalid,
        match=r"workerGroupSpecs\.1\.rayStartParams\.object-store-memory: 10000000000 is not of type .string.",
    ):
        validate_manifest(job)


@pytest.mark.parametrize(
    ("original", "broken", "message"),
    [
        # a string where the CRD wants a boolean
        (
            "enableInTreeAutoscaling: {{ $ray.autoscaling.enabled }}",
            "enableInTreeAutoscaling: {{ $ray.autoscaling.enabled | quote }}",
            "is not of type 'boolean'",
        ),
        # a misspelt field: unknown fields are refused, as under `kubectl apply --validate=strict`
        ("\nworkerGroupSpecs:\n", "\nworkerGroupSpec:\n", "'workerGroupSpec' was unexpected"),
        # a required field left out
        ("    minReplicas: {{ .group.minReplicas }}\n", "", "'minReplicas' is a required property"),
    ],
)
def test_a_broken_kuberay_template_fails_validation(tmp_path: Path, original: str, broken: str, message: str) -> None:
    chart = tmp_path / "sharpen"
    shutil.copytree(CHART, chart)
    template = chart / "templates" / "_ray.tpl"
    text = template.read_text()
    assert text.count(original) == 1
    template.write_text(text.replace(original, broken))
    manifests = render_chart(load_values(VALUES_FILES["all-components-values"]), chart=chart)
    (job,) = [m for m in manifests if m["kind"] == "RayJob"]
    with pytest.raises(ManifestInvalid, match=re.escape(message)):
        validate_manifest(job)


def test_a_kuberay_object_without_a_vendored_schema_fails(all_components: list[dict[str, Any]]) -> None:
    job = copy.deepcopy(next(m for m in all_components if m["kind"] == "RayJob"))
    job["apiVersion"] = "ray.io/v1alpha1"
    with pytest.raises(ManifestInvalid, match="no vendored KubeRay schema"):
        validate_manifest(job)


# --- the operator's own checks (ray-operator/controllers/ray/utils/validation.go) that the chart could break --------


@pytest.mark.parametrize("values_name", sorted(VALUES_FILES))
def test_clusters_pass_the_operators_checks(values_name: str, rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    for name, spec in _cluster_specs(rendered_sets[values_name]):
        assert spec["headGroupSpec"]["template"]["spec"]["containers"], name
        names = [group["groupName"] for group in spec["workerGroupSpecs"]]
        assert len(names) == len(set(names)) and all(DNS_1123.match(n) for n in names), name
        autoscaling = spec.get("enableInTreeAutoscaling", False)
        for group in spec["workerGroupSpecs"]:
            assert 0 <= group["minReplicas"] <= group["maxReplicas"], name
            if not autoscaling:
                assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
            assert "labels" not in group["rayStartParams"], name  # refused by the operator
            assert "resources" not in group  # never both here and in rayStartParams
        templates = [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]
        if spec.get("autoscalerOptions", {}).get("version") == "v2":
            assert all(t["spec"].get("restartPolicy", "Never") == "Never" for t in templates), name
            assert not [e for e in spec["autoscalerOptions"]["env"] if e["name"] == "KUBERAY_GEN_AUTOSCALER_START_CMD"]
        if "gcsFaultToleranceOptions" in spec:
            head_env = {e["name"] for e in spec["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
            assert not head_env & {"REDIS_PASSWORD", "RAY_REDIS_ADDRESS"}, name
            assert "redis-password" not in spec["headGroupSpec"]["rayStartParams"], name


@pytest.mark.parametrize("values_name", sorted(VALUES_FILES))
def test_jobs_pass_the_operators_checks(values_name: str, rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    manifests = rendered_sets[values_name]
    clusters = {m["metadata"]["name"] for m in manifests if m["kind"] == "RayCluster"}
    for cluster in clusters:
        assert len(cluster) <= 53 and DNS_1035.match(cluster)
    for job in (m for m in manifests if m["kind"] == "RayJob"):
        name, spec = job["metadata"]["name"], job["spec"]
        assert len(name) <= 47 and DNS_1035.match(name)
        assert ("rayClusterSpec" in spec) != ("clusterSelector" in spec), name
        if "clusterSelector" in spec:
            assert spec["clusterSelector"]["ray.io/cluster"] in clusters  # a cluster this release renders
            assert "backoffLimit" not in spec and not spec.get("shutdownAfterJobFinishes"), name
        else:
            assert spec["backoffLimit"] >= 0 and spec["shutdownAfterJobFinishes"] is True, name
        assert spec["submissionMode"] == "K8sJobMode"
        submitter = spec["submitterPodTemplate"]["spec"]
        # KubeRay writes the `ray job submit` command into a container that has none
        assert submitter["restartPolicy"] == "Never" and "command" not in submitter["containers"][0]


# --- what the chart promises ---------------------------------------------------------------------------------------


def test_the_rayjob_runs_sharpen_train_on_the_head(all_components: list[dict[str, Any]], find: Finder) -> None:
    job = find(all_components, "RayJob", f"{RELEASE}-train")["spec"]
    assert shlex.split(job["entrypoint"]) == [
        *("sharpen", "train", "/etc/sharpen/train.toml", 'runtime.type="ray"', 'runtime.address="auto"'),
        *('run.name="k8s-smoke"', "--resume", "auto"),
    ]
    head = job["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in head["containers"][0]["volumeMounts"]}
    assert mounts["/etc/sharpen"] == "recipe"
    recipe = next(v for v in head["volumes"] if v["name"] == "recipe")
    find(all_components, "ConfigMap", recipe["configMap"]["name"])
    env = {e["name"]: e for e in job["submitterPodTemplate"]["spec"]["containers"][0]["env"]}
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-auth", "key": "ray-token"}


def test_overrides_are_quoted_for_the_entrypoints_shell(shared_cluster: list[dict[str, Any]], find: Finder) -> None:
    job = find(shared_cluster, "RayJob", f"{RELEASE}-train")["spec"]
    assert shlex.split(job["entrypoint"])[5] == "run.name='it''s a name'"


def test_ray_nodes_probe_like_kuberay(rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    # KubeRay 1.7.0's defaults (utils/constant.go): a busy node survives 10 minutes of failed liveness checks
    templates = [t for manifests in rendered_sets.values() for t in _node_templates(manifests)]
    assert {role for role, _ in templates} == {"head", "worker"}
    for role, template in templates:
        container = template["spec"]["containers"][0]
        liveness, readiness = container["livenessProbe"], container["readinessProbe"]
        timeout = 5 if role == "head" else 2
        assert liveness["httpGet"] == readiness["httpGet"] == {"path": "/api/healthz", "port": "agent"}
        assert (liveness["initialDelaySeconds"], liveness["periodSeconds"], liveness["failureThreshold"]) == (
            30,
            5,
            120,
        )
        assert (readiness["initialDelaySeconds"], readiness["periodSeconds"], readiness["failureThreshold"]) == (
            10,
            5,
            10,
        )
        assert liveness["timeoutSeconds"] == readiness["timeoutSeconds"] == timeout
        assert {"name": "agent", "containerPort": 52365} in container["ports"]


@pytest.mark.parametrize("values_name", ["all-components-values", "kuberay-cluster-values", "ray-static-values"])
def test_disruption_budgets_cover_every_ray_node_and_never_block_a_drain(
    values_name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    manifests = rendered_sets[values_name]
    budgets = [m["spec"] for m in manifests if m["kind"] == "PodDisruptionBudget"]
    for _, template in _node_templates(manifests):
        labels = template["metadata"]["labels"].items()
        (budget,) = [b for b in budgets if b["selector"]["matchLabels"].items() <= labels]
        assert budget["maxUnavailable"] >= 1 and "minAvailable" not in budget


def test_a_budget_that_blocks_drains_is_refused() -> None:
    with pytest.raises(HelmFailed, match=re.escape("ray.pdb.maxUnavailable must be at least 1")):
        render_chart({"ray": {"enabled": True, "pdb": {"maxUnavailable": 0}}})


def test_an_unknown_ray_mode_is_refused() -> None:
    with pytest.raises(HelmFailed, match=re.escape("ray.mode must be kuberay or static")):
        render_chart({"ray": {"enabled": True, "mode": "operator"}})


def test_gcs_fault_tolerance_needs_a_redis_and_reads_its_password_from_a_secret(
    shared_cluster: list[dict[str, Any]], find: Finder
) -> None:
    options = find(shared_cluster, "RayCluster", f"{RELEASE}-ray")["spec"]["gcsFaultToleranceOptions"]
    assert options == {
        "redisAddress": "redis.sharpen-infra.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "sharpen-redis", "key": "password"}}},
    }
    with pytest.raises(HelmFailed, match=re.escape("ray.gcsFaultTolerance.redisAddress")):
        render_chart({"ray": {"enabled": True, "gcsFaultTolerance": {"enabled": True}}})


def test_only_the_autoscaler_holds_an_api_token(all_components: list[dict[str, Any]], find: Finder) -> None:
    spec = find(all_components, "RayJob", f"{RELEASE}-train")["spec"]["rayClusterSpec"]
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]["template"]["spec"]
    assert head["automountServiceAccountToken"] is False
    token = next(v for v in head["volumes"] if v["name"] == "autoscaler-token")
    assert {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}} in token["projected"]["sources"]
    assert all(m["name"] != "autoscaler-token" for m in head["containers"][0]["volumeMounts"])
    autoscaler = spec["autoscalerOptions"]
    assert {
        "name": "autoscaler-token",
        "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
        "readOnly": True,
    } in autoscaler["volumeMounts"]
    assert autoscaler["securityContext"]["readOnlyRootFilesystem"] is True
    # and the head may reach the API server; without the autoscaler nothing does
    policy = find(all_components, "NetworkPolicy", f"{RELEASE}-ray-autoscaler")["spec"]
    assert (
        policy["podSelector"]["matchLabels"].items() <= spec["headGroupSpec"]["template"]["metadata"]["labels"].items()
    )


def test_without_the_autoscaler_no_pod_reaches_the_api_server(shared_cluster: list[dict[str, Any]]) -> None:
    cluster = next(m for m in shared_cluster if m["kind"] == "RayCluster")["spec"]
    assert cluster["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in cluster
    assert not [m for m in shared_cluster if m["metadata"]["name"] == f"{RELEASE}-ray-autoscaler"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    assert all(v["name"] != "autoscaler-token" for v in head["volumes"])


def test_gang_scheduling_labels_reach_the_kuberay_objects(shared_cluster: list[dict[str, Any]]) -> None:
    for manifest in shared_cluster:
        if manifest["kind"] in KINDS:
            assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "sharpen"


# --- scheduling knobs on every pod ----------------------------------------------------------------------------------


def test_scheduling_values_reach_every_pod(all_components: list[dict[str, Any]]) -> None:
    from test_chart_security import _pod_templates

    templates = dict(_pod_templates(all_components))
    assert len(templates) >= 8
    for name, template in templates.items():
        assert template["spec"]["priorityClassName"] == "sharpen", name  # chart-wide
    gpu = templates[f"{RELEASE}-train:worker-gpu"]["spec"]
    assert gpu["runtimeClassName"] == "nvidia" and gpu["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert gpu["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "podAntiAffinity" in gpu["affinity"]
    cpu = templates[f"{RELEASE}-train:worker-cpu"]["spec"]
    assert not {"runtimeClassName", "nodeSelector", "tolerations", "affinity"} & set(cpu)


def test_a_components_scheduling_replaces_the_chart_wide_fields() -> None:
    tolerate = [{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}]
    values = {
        "scheduling": {"nodeSelector": {"pool": "general"}, "schedulerName": "volcano"},
        "sandbox": {"scheduling": {"nodeSelector": {"pool": "sandbox"}, "tolerations": tolerate}},
    }
    pod = next(m for m in render_chart(values) if m["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "sandbox"} and pod["tolerations"] == tolerate
    assert pod["schedulerName"] == "volcano"


# --- static mode ---------------------------------------------------------------------------------------------------


def test_static_mode_starts_ray_from_the_same_parameters(static: list[dict[str, Any]], find: Finder) -> None:
    head = find(static, "Deployment", f"{RELEASE}-ray-head")["spec"]["template"]["spec"]["containers"][0]
    gpu = find(static, "Deployment", f"{RELEASE}-ray-worker-gpu")
    command = gpu["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["ray", "start", "--block", "--disable-usage-stats"]
    assert f"--address={RELEASE}-ray-head:6379" in command and "--num-gpus=8" in command
    assert {"--head", "--port=6379", "--num-cpus=0", "--num-gpus=0"} <= set(head["command"])
    assert (
        gpu["spec"]["replicas"] == 2
        and find(static, "Deployment", f"{RELEASE}-ray-worker-cpu")["spec"]["replicas"] == 1
    )
    assert gpu["spec"]["selector"]["matchLabels"]["sharpen-ray-group"] == "gpu"
