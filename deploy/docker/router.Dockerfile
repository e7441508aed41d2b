# syntax=docker/dockerfile:1
#
# omni-router: the torch-free gateway, with Kubernetes service discovery.
# Build from the repository root (the build context):
#   docker build -f deploy/docker/router.Dockerfile -t omni-router:dev .

ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

# Build stage: wheels for the project and every dependency, so the runtime stage installs
# offline and carries neither the sources nor a build backend.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY router ./router
COPY worker ./worker
# `k8s` adds lightkube for `--service-discovery k8s`. Not `worker`: the router never imports torch.
RUN pip wheel --wheel-dir /wheels ".[k8s]"

FROM ${PYTHON_IMAGE}
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels "omni-router[k8s]"
# Bytecode was compiled at install time; at run time the root filesystem is read-only.
ENV PYTHONDONTWRITEBYTECODE=1

# A numeric, non-root user, so Kubernetes' runAsNonRoot can verify it from the image.
# /var/lib/omni-router is where the state volume (update journal, fleet weights record)
# is mounted; owning it lets the image also run with a plain `docker run`.
RUN groupadd --system --gid 10001 omni \
    && useradd --system --uid 10001 --gid omni --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin omni \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/omni-router
USER 10001:10001

EXPOSE 30000
# Exec form: omni-router is PID 1 and receives SIGTERM itself (graceful drain).
ENTRYPOINT ["omni-router"]
CMD ["--host", "0.0.0.0", "--port", "30000", "--state-dir", "/var/lib/omni-router"]
