# syntax=docker/dockerfile:1
# One image for every part of decoupled-diloco: `ddiloco synchronizer`, `ddiloco learner` and
# `ddiloco operator` are its entry points (the operator's pods name the subcommand).
#
#   docker build -t ddiloco:0.1.0 .                                    # slim: CPU torch (~1 GB)
#   docker build -t ddiloco:0.1.0-cuda --build-arg TORCH_FLAVOR=cu128 .  # CUDA learners
#   docker run --rm ddiloco:0.1.0 operator --help
#
# The CUDA flavour differs only in the torch wheel: PyTorch's CUDA wheels bring their own CUDA
# runtime libraries, so both flavours share this Debian base and the node's driver does the
# rest (NVIDIA container toolkit). The operator and the synchronizer need no CUDA: run them from
# the slim image, the learners from either. Pin the base by digest in production
# (`python:3.11.14-slim-bookworm@sha256:...`); the tag below is exact.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---------------------------------------------------------------------------- build stage
FROM ${PYTHON_IMAGE} AS build

# cpu (default), or a CUDA build of torch such as cu126 / cu128 (PyTorch's wheel indexes).
ARG TORCH_FLAVOR=cpu
ARG TORCH_VERSION=2.15.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/ddiloco
ENV PATH=/opt/ddiloco/bin:$PATH

# torch first and alone, from the flavour's index, so that the project's install below finds
# it satisfied and never pulls the default (CUDA) wheel from PyPI into the slim image.
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_FLAVOR}" \
        "torch==${TORCH_VERSION}"

WORKDIR /src
# Only what the package is built from (see pyproject.toml's package-dir): tests, docs and
# charts never enter the image, and editing them does not invalidate this layer.
COPY pyproject.toml README.md ./
COPY cli/ cli/
COPY synchronizer/ synchronizer/
COPY learner/ learner/
COPY operator/ operator/
COPY local/ local/
COPY simulator/ simulator/
# The project's own dependencies are ranges in pyproject.toml, resolved at build time.
# hadolint ignore=DL3013
RUN pip install ".[train,operator]" \
    && python -c "import ddiloco.operator.handlers, ddiloco.synchronizer.server, ddiloco.learner.cli"

# ---------------------------------------------------------------------------- runtime stage
FROM ${PYTHON_IMAGE} AS runtime

ARG TORCH_FLAVOR=cpu
LABEL org.opencontainers.image.title="ddiloco" \
      org.opencontainers.image.description="Decoupled DiLoCo: synchronizer, learner and Kubernetes operator" \
      org.opencontainers.image.source="https://github.com/decoupled-diloco/decoupled-diloco" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.ddiloco.torch-flavor="${TORCH_FLAVOR}"

# A fixed numeric user, so that `runAsNonRoot: true` can verify it and volumes can be given to
# it with `fsGroup: 10001`.
RUN groupadd --gid 10001 ddiloco \
    && useradd --uid 10001 --gid 10001 --no-log-init --create-home --home-dir /home/ddiloco ddiloco

COPY --from=build /opt/ddiloco /opt/ddiloco
ENV PATH=/opt/ddiloco/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/ddiloco

USER 10001:10001
WORKDIR /home/ddiloco
# The synchronizer's port (h2c and HTTP/1.1) and the operator's liveness port.
EXPOSE 8470 8080
ENTRYPOINT ["ddiloco"]
CMD ["--help"]
