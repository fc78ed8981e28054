"""Renders, lints and validates the Helm chart under deploy/helm/sharpen offline, for the tests beside this file.

Rendering and linting use Helm's own Go code through `helm_python` (the helm-python-sdk wheel bundles it as a
shared library: no helm binary, no download), in a child process: loading the Go runtime starts its threads and
signal handlers, which the rest of the suite (forking sandboxes, SIGALRM timeouts) should not share. Validation uses
`kubernetes_validate` in this process; its wheel ships the JSON schemas of every Kubernetes minor version it
supports, and the strict variant refuses unknown fields. KubeRay's custom resources (apiVersion ray.io/...) are
validated against KubeRay's CRD schemas, vendored under schemas/kuberay/ (kuberay_schemas.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml
from kuberay_schemas import KubeRayInvalid, validate_kuberay

REPO_ROOT = Path(__file__).resolve().parents[3]
CHART = REPO_ROOT / "deploy" / "helm" / "sharpen"
# The Kubernetes release the manifests must be valid for. 1.33 is the first with pod user namespaces on by default,
# which the sandbox pod uses (hostUsers: false).
KUBERNETES_VERSION = "1.33.0"
RELEASE = "sharpen"
NAMESPACE = "sharpen"

# Values sets rendered by the tests: the chart's defaults and each file under ci/ (all components on, GPUs).
VALUES_FILES = {"defaults": None, **{path.stem: path for path in sorted((CHART / "ci").glob("*.yaml"))}}


# Runs in the child: one Helm call, its arguments as JSON on stdin, its result (or Helm's error) as JSON on stdout.
_HELM_CALL = """
import json, sys
import helm_python as helm
call = json.load(sys.stdin)
try:
    if call["operation"] == "render":
        with helm.Chart.load(call["chart"]) as chart:
            result = chart.render(call["values"], **call["options"])
    else:
        result = helm.lint(call["chart"], call["values"], **call["options"])
except helm.HelmError as error:
    json.dump({"error": f"{type(error).__name__}: {error}"}, sys.stdout)
else:
    json.dump({"result": result}, sys.stdout)
"""


class HelmFailed(Exception):
    """Helm refused the chart or its values (a template error, a `required` or `fail` in a template)."""


class ManifestInvalid(Exception):
    """A rendered object that the pinned Kubernetes version's schema refuses (or has no schema for)."""


def load_values(path: Path | None) -> dict[str, Any] | None:
    return None if path is None else yaml.safe_load(path.read_text())


def render_chart(values: dict[str, Any] | None = None, chart: Path = CHART) -> list[dict[str, Any]]:
    """`helm template` of the chart: every non-empty object, in template order."""
    options = {"name": RELEASE, "namespace": NAMESPACE, "is_install": True}
    rendered: dict[str, str] = _call_helm("render", chart, values, options)
    manifests = (text for path, text in sorted(rendered.items()) if not path.endswith("NOTES.txt"))  # not objects
    return [doc for text in manifests for doc in yaml.safe_load_all(text) if doc]


def validate_manifest(manifest: dict[str, Any]) -> None:
    """Strict schema validation against KUBERNETES_VERSION, or KubeRay's CRD schema for a ray.io object. A kind
    without a schema is an error here (the kubernetes-validate command line only warns), so a misspelt kind or
    apiVersion cannot slip through."""
    name = f"{manifest.get('kind')}/{manifest.get('metadata', {}).get('name')}"
    if str(manifest.get("apiVersion", "")).startswith("ray.io/"):
        try:
            validate_kuberay(manifest)
        except KubeRayInvalid as error:
            raise ManifestInvalid(str(error)) from error
        return
    try:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(str(part) for part in error.path)
        raise ManifestInvalid(f"{name}: {path}: {error.message}") from error
    except kubernetes_validate.SchemaNotFoundError as error:
        raise ManifestInvalid(f"{name}: {error.message}") from error


def lint_chart(values: dict[str, Any] | None = None, chart: Path = CHART) -> list[str]:
    """`helm lint --strict` findings of warning level or worse (info, such as a missing icon, is not one)."""
    options = {"strict": True, "kube_version": f"v{KUBERNETES_VERSION}", "namespace": NAMESPACE}
    report = _call_helm("lint", chart, values, options)
    return [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2] + list(report["errors"])


def _call_helm(operation: str, chart: Path, values: dict[str, Any] | None, options: dict[str, Any]) -> Any:
    call = {"operation": operation, "chart": str(chart), "values": values, "options": options}
    process = subprocess.run(
        [sys.executable, "-c", _HELM_CALL], input=json.dumps(call), capture_output=True, text=True, timeout=120
    )
    assert process.returncode == 0, f"helm {operation} crashed: {process.stderr[-2000:]}"
    answer = json.loads(process.stdout)
    if "error" in answer:
        raise HelmFailed(answer["error"])
    return answer["result"]
