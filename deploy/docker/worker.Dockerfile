# syntax=docker/dockerfile:1
#
# omni-worker: serves a Llama / Qwen2 checkpoint mounted at /models, on CUDA or CPU.
# Build from the repository root (the build context):
#   docker build -f deploy/docker/worker.Dockerfile -t omni-worker:dev .
#
# The default base is PyTorch's CUDA runtime image, and its torch build is kept. For a
# much smaller CPU-only image (the cpu-demo overlay), build on a plain Python base; a CPU
# build of torch is then installed from PyTorch's CPU index:
#   docker build -f deploy/docker/worker.Dockerfile \
#       --build-arg BASE_IMAGE=python:3.12.8-slim-bookworm -t omni-worker:dev .

ARG BUILD_IMAGE=python:3.12.8-slim-bookworm
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

# Build stage: the project's own wheel (pure Python) and nothing else.
FROM ${BUILD_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY router ./router
COPY worker ./worker
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE}
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1
# torch is pinned to the build already in the base image through a constraint, so
# resolving the `worker` extra can neither upgrade it nor replace the CUDA build with
# PyPI's; the remaining dependencies (safetensors, tokenizers, aiohttp, pydantic,
# tenacity, prometheus-client) come from the index as pyproject.toml declares them.
# The project itself is installed from its wheel file, never looked up on the index.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    set -eux; \
    if ! python -c "import torch" 2>/dev/null; then \
        pip install --index-url "${TORCH_CPU_INDEX}" "torch>=2.4"; \
    fi; \
    python -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
        > /tmp/torch-constraint.txt; \
    pip install --constraint /tmp/torch-constraint.txt "$(echo /wheels/omni_router-*.whl)[worker]"; \
    rm /tmp/torch-constraint.txt; \
    python -c "import safetensors, tokenizers, torch, worker.cli"; \
    omni-worker --version
# Bytecode was compiled at install time; at run time the root filesystem is read-only.
# HOME and with it every cache (Hugging Face, torch, Triton) point into /tmp, the one
# writable place (an emptyDir in Kubernetes, `--tmpfs /tmp` with `docker run --read-only`).
ENV PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache

# A numeric, non-root user, so Kubernetes' runAsNonRoot can verify it from the image.
# /models is the mount point of the model volume (read-only).
RUN groupadd --system --gid 10001 omni \
    && useradd --system --uid 10001 --gid omni --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin omni \
    && install -d -m 0755 /models
USER 10001:10001
WORKDIR /tmp

EXPOSE 30000
# Exec form: omni-worker is PID 1 and receives SIGTERM itself (graceful drain).
ENTRYPOINT ["omni-worker"]
CMD ["--model-path", "/models/checkpoint", "--host", "0.0.0.0", "--port", "30000"]
