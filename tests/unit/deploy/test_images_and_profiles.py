"""The deployment data around the chart: a Dockerfile for every image the chart names (no Docker engine here, so
the checks read them), and the sandbox's seccomp profile."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from chart_harness import CHART, REPO_ROOT

DOCKER = REPO_ROOT / "deploy" / "docker"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
PROFILE = json.loads((REPO_ROOT / "deploy" / "seccomp" / "sharpen-sandbox.json").read_text())


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines if line and line[0] != "#"]


def test_every_image_in_the_values_has_a_dockerfile() -> None:
    assert set(VALUES["images"]) == {path.name.removesuffix(".Dockerfile") for path in DOCKER.glob("*.Dockerfile")}


def test_every_templated_image_key_is_in_the_values() -> None:
    keys = set()
    for template in (CHART / "templates").glob("*.yaml"):
        keys |= set(re.findall(r'"sharpen\.image" \(dict "root" \S+ "key" "(\w+)"\)', template.read_text()))
    assert keys == set(VALUES["images"])


@pytest.mark.parametrize("dockerfile", sorted(DOCKER.glob("*.Dockerfile")), ids=lambda path: path.name)
def test_dockerfiles_run_as_the_charts_user(dockerfile: Path) -> None:
    instructions = _instructions(dockerfile)
    assert next(i for i, _ in instructions if i != "ARG") == "FROM"
    user = [arguments for instruction, arguments in instructions if instruction == "USER"]
    uid, gid = VALUES["podSecurity"]["runAsUser"], VALUES["podSecurity"]["runAsGroup"]
    assert user[-1] == f"{uid}:{gid}"  # numeric, so runAsNonRoot can verify it without reading /etc/passwd
    copied = {source for i, arguments in instructions if i == "COPY" for source in arguments.split()[:-1]}
    ignore = (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text().splitlines()
    assert ignore[1] == "*"  # the context is the repository root: only what is listed after this goes in
    kept = {line.removeprefix("!") for line in ignore if line.startswith("!")}
    assert copied <= kept  # what the image copies must survive its .dockerignore
    assert {"pyproject.toml", "src"} <= copied


@pytest.mark.parametrize("dockerfile", sorted(DOCKER.glob("*.Dockerfile")), ids=lambda path: path.name)
def test_images_pin_torch_as_the_project_does(dockerfile: Path) -> None:
    runs = " ".join(arguments for instruction, arguments in _instructions(dockerfile) if instruction == "RUN")
    pinned = re.search(r'"torch==([\w.]+)"', (REPO_ROOT / "pyproject.toml").read_text())
    assert pinned and ("-c constraints.txt" in runs or f"torch=={pinned.group(1)}" in runs)
    assert "bubblewrap" in runs  # the sandbox backend (and the unshare probe) in both images


def test_the_gpu_image_starts_from_cuda() -> None:
    instructions = _instructions(DOCKER / "gpu.Dockerfile")
    base = next(arguments for instruction, arguments in instructions if instruction == "ARG" and "CUDA" in arguments)
    assert "nvidia/cuda:" in base


def test_the_sandbox_profile_lets_bubblewrap_build_namespaces() -> None:
    denied = {name for rule in PROFILE["syscalls"] if rule["action"] != "SCMP_ACT_ALLOW" for name in rule["names"]}
    assert PROFILE["defaultAction"] == "SCMP_ACT_ALLOW"
    assert not denied & {"unshare", "clone", "clone3", "setns", "mount", "umount2", "pivot_root", "prctl", "seccomp"}
    # and keeps RuntimeDefault's refusals of kernel, module, clock, keyring, tracing and BPF access
    assert {
        "kexec_load",
        "init_module",
        "finit_module",
        "delete_module",
        "bpf",
        "perf_event_open",
        "ptrace",
        "keyctl",
        "add_key",
        "clock_settime",
        "reboot",
        "swapon",
        "open_by_handle_at",
        "userfaultfd",
        "io_uring_setup",
    } <= denied
    assert all(rule["action"] == "SCMP_ACT_ERRNO" and rule["errnoRet"] == 1 for rule in PROFILE["syscalls"])


def test_the_chart_points_at_the_shipped_profile() -> None:
    path = VALUES["sandbox"]["seccompProfile"]["localhostProfile"]
    assert path == "profiles/sharpen-sandbox.json"
    assert (REPO_ROOT / "deploy" / "seccomp" / Path(path).name).is_file()
