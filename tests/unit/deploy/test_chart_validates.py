"""The chart renders, lints and validates strictly against the pinned Kubernetes version, offline, for the default
values and every values file under ci/; a broken manifest or template fails the same checks."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
from chart_harness import (
    CHART,
    KUBERNETES_VERSION,
    VALUES_FILES,
    HelmFailed,
    ManifestInvalid,
    lint_chart,
    load_values,
    render_chart,
    validate_manifest,
)


@pytest.mark.parametrize("values_name", sorted(VALUES_FILES))
def test_every_rendered_manifest_is_valid(values_name: str, rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    manifests = rendered_sets[values_name]
    assert manifests
    for manifest in manifests:
        validate_manifest(manifest)


@pytest.mark.parametrize("values_name", sorted(VALUES_FILES))
def test_helm_lint_strict_is_clean(values_name: str) -> None:
    assert lint_chart(load_values(VALUES_FILES[values_name])) == []


def test_the_validator_ships_the_pinned_version_offline() -> None:
    # kubernetes_validate reads schemas from its own package data; the pinned version must be among them.
    import kubernetes_validate.utils

    assert KUBERNETES_VERSION in kubernetes_validate.utils.all_versions()


def test_all_components_render_every_kind(all_components: list[dict[str, Any]]) -> None:
    kinds_by_component: dict[str, set[str]] = {}
    for manifest in all_components:
        component = manifest["metadata"]["labels"]["app.kubernetes.io/component"]
        kinds_by_component.setdefault(component, set()).add(manifest["kind"])
    served = {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}
    assert kinds_by_component["sandbox"] == served | {"HorizontalPodAutoscaler"}
    assert kinds_by_component["environment"] == served | {"HorizontalPodAutoscaler", "ConfigMap"}
    assert kinds_by_component["reward-model"] == served
    assert kinds_by_component["judge"] == served
    # KubeRay (the default ray.mode): the RayJob brings its own RayCluster; static mode: test_kuberay.py
    assert kinds_by_component["ray-head"] == {"PodDisruptionBudget"}
    assert kinds_by_component["ray-worker"] == {"PodDisruptionBudget"}
    assert kinds_by_component["ray"] == {"NetworkPolicy"}
    assert kinds_by_component["train"] == {"RayJob", "ConfigMap"}
    assert kinds_by_component["auth"] == {"ServiceAccount", "Secret"}


def test_defaults_render_only_the_sandbox(rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    components = {m["metadata"]["labels"]["app.kubernetes.io/component"] for m in rendered_sets["defaults"]}
    assert components == {"sandbox", "auth"}


def test_existing_secret_replaces_the_generated_one() -> None:
    manifests = render_chart({"auth": {"existingSecret": "my-tokens"}})
    assert not [m for m in manifests if m["kind"] == "Secret"]
    container = next(m for m in manifests if m["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    token = next(e for e in container["env"] if e["name"] == "SHARPEN_SERVICE_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "my-tokens", "key": "service-token"}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"environment": {"enabled": True}}, "environment.recipe"),
        ({"ray": {"enabled": False}, "train": {"enabled": True, "recipe": "[run]\n"}}, "needs ray.enabled"),
    ],
)
def test_missing_required_values_fail_to_render(values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmFailed, match=message):
        render_chart(values)


# --- a broken manifest fails -------------------------------------------------------------------------------------


def _sandbox_deployment(all_components: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = next(m for m in all_components if m["kind"] == "Deployment")
    return copy.deepcopy(deployment)


def test_an_unknown_field_fails_validation(all_components: list[dict[str, Any]]) -> None:
    deployment = _sandbox_deployment(all_components)
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {"httpGet": {"path": "/readyz"}}
    with pytest.raises(ManifestInvalid, match="readinessProbes"):
        validate_manifest(deployment)


def test_a_wrongly_typed_field_fails_validation(all_components: list[dict[str, Any]]) -> None:
    deployment = _sandbox_deployment(all_components)
    deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] = "yes"
    with pytest.raises(ManifestInvalid, match="runAsNonRoot"):
        validate_manifest(deployment)


def test_a_missing_required_field_fails_validation(all_components: list[dict[str, Any]]) -> None:
    deployment = _sandbox_deployment(all_components)
    del deployment["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ManifestInvalid, match="'name' is a required property"):
        validate_manifest(deployment)


def test_an_unknown_api_version_fails_validation(all_components: list[dict[str, Any]]) -> None:
    hpa = copy.deepcopy(next(m for m in all_components if m["kind"] == "HorizontalPodAutoscaler"))
    hpa["apiVersion"] = "autoscaling/v2beta1"  # removed in Kubernetes 1.25
    with pytest.raises(ManifestInvalid, match="Couldn't find schema"):
        validate_manifest(hpa)


def _copy_chart(tmp_path: Path) -> Path:
    chart = tmp_path / "sharpen"
    shutil.copytree(CHART, chart)
    return chart


def test_a_broken_template_fails_validation(tmp_path: Path) -> None:
    chart = _copy_chart(tmp_path)
    template = chart / "templates" / "sandbox.yaml"
    text = template.read_text()
    # policyTypes as a string, not a list: the template renders and parses as YAML; only the schema knows better.
    broken = text.replace("  policyTypes: [Ingress, Egress]", "  policyTypes: Ingress")
    assert broken != text
    template.write_text(broken)
    manifests = render_chart(chart=chart)
    invalid = []
    for manifest in manifests:
        try:
            validate_manifest(manifest)
        except ManifestInvalid as error:
            invalid.append(str(error))
    assert len(invalid) == 1 and "NetworkPolicy/sharpen-sandbox: spec.policyTypes" in invalid[0]


def test_a_template_that_breaks_yaml_fails_lint(tmp_path: Path) -> None:
    chart = _copy_chart(tmp_path)
    template = chart / "templates" / "judge.yaml"
    template.write_text(template.read_text().replace("kind: Service\n", "kind: Service\n  bad-indent: [\n"))
    findings = lint_chart(load_values(VALUES_FILES["all-components-values"]), chart=chart)
    assert any("judge.yaml" in finding for finding in findings)
