# syntax=docker/dockerfile:1
# sharpen's CPU image: the sandbox, environment and reward-model servers (`sharpen serve-sandbox | serve-env |
# serve-rm`). Build from the repository root:
#   docker build -f deploy/docker/cpu.Dockerfile -t REGISTRY/sharpen-cpu:0.1.0 .
FROM python:3.11-slim-bookworm

# bubblewrap isolates model-written code; Debian's build is not setuid, so it works only through unprivileged user
# namespaces (see the sandbox comment in deploy/helm/sharpen/templates/sandbox.yaml).
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /opt/sharpen
COPY pyproject.toml constraints.txt README.md ./
COPY src ./src
# torch first and pinned, as `make install` does; TORCH_INDEX_URL may name an index of CPU-only wheels, which keeps
# the image free of CUDA libraries it would never use.
ARG TORCH_INDEX_URL=""
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0 \
    && pip install -c constraints.txt .

# The chart runs every container as this uid with a read-only root filesystem; /tmp (HOME) is an emptyDir.
RUN groupadd --gid 10001 sharpen && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home sharpen
USER 10001:10001
ENV HOME=/tmp
ENTRYPOINT ["sharpen"]
