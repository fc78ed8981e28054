"""Validates KubeRay custom resources (RayCluster, RayJob) against KubeRay's own CRD schemas, offline.

The schemas are the `openAPIV3Schema` of KubeRay's CRDs, vendored under schemas/kuberay/ (source, commit and licence
in its README). They are checked with `jsonschema` as the API server checks a custom resource under strict field
validation: an object schema that neither lists `additionalProperties` nor sets
`x-kubernetes-preserve-unknown-fields` refuses unknown fields. The CRDs' CEL rules and the operator's Go checks are
not evaluated here (see the README).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

SCHEMAS = Path(__file__).resolve().parent / "schemas" / "kuberay"
API_VERSION = "ray.io/v1"
# kind -> schema file
KINDS = {"RayCluster": "raycluster-v1.json", "RayJob": "rayjob-v1.json"}


class KubeRayInvalid(Exception):
    """A KubeRay object that its CRD schema refuses, or a ray.io kind or version without a vendored schema."""


def validate_kuberay(manifest: dict[str, Any]) -> None:
    kind, api_version = manifest.get("kind"), manifest.get("apiVersion")
    name = f"{kind}/{manifest.get('metadata', {}).get('name')}"
    if api_version != API_VERSION or kind not in KINDS:
        raise KubeRayInvalid(f"{name}: no vendored KubeRay schema for apiVersion {api_version!r}, kind {kind!r}")
    error = best_match(_validator(kind).iter_errors(manifest))
    if error is not None:
        path = ".".join(str(part) for part in error.absolute_path)
        raise KubeRayInvalid(f"{name}: {path}: {error.message}")


@cache
def _validator(kind: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(strict_schema(kind))


def strict_schema(kind: str) -> dict[str, Any]:
    return _strict(json.loads((SCHEMAS / KINDS[kind]).read_text()))


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever the API server's strict field validation refuses them."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    # `properties` is a map of field names to schemas (its keys are not keywords): recurse into its values only.
    strict = {key: _strict(value) for key, value in schema.items() if key != "properties"}
    if "properties" in schema:
        strict["properties"] = {field: _strict(sub) for field, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            strict["additionalProperties"] = False
    return strict
