# syntax=docker/dockerfile:1
# One image for every part of decoupled-diloco: `ddiloco synchronizer`, `ddiloco learner` and
# `ddiloco operator` are its entry points (the operator's pods name the subcommand).
#
#   docker build -t ddiloco:0.1.0 .                                    # slim: CPU torch (~1 GB)
#   docker build -t ddiloco:0.1.0-cuda --build-arg TORCH_FLAVOR=cu128 .  # CUDA learners
#   docker build -t ddiloco:0.1.0 --build-arg TORCH_INDEX_URL=https://pypi.org/simple .
#   docker run --rm ddiloco:0.1.0 operator --help
#
# The CUDA flavour differs only in the torch wheel: PyTorch's CUDA wheels bring their own CUDA
# runtime libraries, so both flavours share this Debian base and the node's driver does the
# rest (NVIDIA container toolkit). The operator and the synchronizer need no CUDA: run them from
# the slim image, the learners from either. Pin the base by digest in production
# (`python:3.11.14-slim-bookworm@sha256:...`); the tag below is exact.
#
# TORCH_INDEX_URL replaces PyTorch's index for the flavour (where it cannot be reached, e.g.
# behind a proxy of PyPI alone). PyPI's Linux torch is the CUDA build: it runs on CPU too but
# brings ~3 GB of nvidia-* wheels (needed to import it) and triton (~1 GB, GPU kernels only),
# which the cpu flavour drops. tests/integration/image.py builds this file with buildah on a
# Debian base made by debootstrap, from PyPI; its figures are in tests/integration/IMAGE.md.
#
# Layers, for rebuilds: torch and the third-party requirements are installed in the runtime
# stage first, keyed only on the torch arguments and on the dependency lists of pyproject.toml
# (the `requirements` stage extracts them); the project itself is a wheel built in the `build`
# stage and installed with --no-deps on top, so editing the sources rebuilds that small layer
# only.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---------------------------------------------------------------------- requirements stage
# The third-party requirements of ".[train,operator]" without torch (installed alone, from its
# index, so that nothing pulls PyPI's CUDA wheel into the slim image). Only these lines key
# the dependency layer: editing pyproject.toml's other tables does not reinstall anything.
FROM ${PYTHON_IMAGE} AS requirements
WORKDIR /src
COPY pyproject.toml ./
RUN python -c 'import re, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; reqs = p["dependencies"] + p["optional-dependencies"]["train"] + p["optional-dependencies"]["operator"]; print("\n".join(r for r in reqs if not re.match(r"torch\b", r)))' \
        > /requirements.txt

# ----------------------------------------------------------------------------- build stage
# The project as a wheel; its build tools never reach the runtime image.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/build \
    && /opt/build/bin/pip install "setuptools==84.2.1" "wheel==0.48.0"
WORKDIR /src
# Only what the package is built from (see pyproject.toml's package-dir): tests, docs and
# charts never enter the image, and editing them does not invalidate this layer.
COPY pyproject.toml README.md ./
COPY cli/ cli/
COPY synchronizer/ synchronizer/
COPY wire/ wire/
COPY learner/ learner/
COPY operator/ operator/
COPY local/ local/
COPY simulator/ simulator/
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .

# --------------------------------------------------------------------------- runtime stage
FROM ${PYTHON_IMAGE} AS runtime

# cpu (default), or a CUDA build of torch such as cu126 / cu128 (PyTorch's wheel indexes).
ARG TORCH_FLAVOR=cpu
ARG TORCH_VERSION=2.15.0
# Empty: https://download.pytorch.org/whl/${TORCH_FLAVOR}. Any other index serving torch.
ARG TORCH_INDEX_URL=
LABEL org.opencontainers.image.title="ddiloco" \
      org.opencontainers.image.description="Decoupled DiLoCo: synchronizer, learner and Kubernetes operator" \
      org.opencontainers.image.source="https://github.com/decoupled-diloco/decoupled-diloco" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.ddiloco.torch-flavor="${TORCH_FLAVOR}" \
      dev.ddiloco.torch-version="${TORCH_VERSION}"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# A fixed numeric user, so that `runAsNonRoot: true` can verify it and volumes can be given to
# it with `fsGroup: 10001`.
RUN groupadd --gid 10001 ddiloco \
    && useradd --uid 10001 --gid 10001 --no-log-init --create-home --home-dir /home/ddiloco ddiloco

RUN python -m venv /opt/ddiloco
ENV PATH=/opt/ddiloco/bin:$PATH

# torch first and alone, from the flavour's index (or TORCH_INDEX_URL). The cpu flavour has no
# use for triton (GPU kernels; torch imports and trains without it): dropped if the wheel
# pulled it in, in the same layer so that it costs nothing.
RUN pip install --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/${TORCH_FLAVOR}}" \
        "torch==${TORCH_VERSION}" \
    && if [ "${TORCH_FLAVOR}" = cpu ]; then pip uninstall --yes triton; fi

# The project's own dependencies are ranges in pyproject.toml, resolved at build time.
COPY --from=requirements /requirements.txt /opt/ddiloco/requirements.txt
RUN pip install --requirement /opt/ddiloco/requirements.txt

# The project last, without dependencies: the only layer a source change rebuilds.
COPY --from=build /wheels/ /tmp/wheels/
RUN pip install --no-deps /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels \
    && python -c "import ddiloco.operator.handlers, ddiloco.synchronizer.server, ddiloco.learner.cli"

ENV HOME=/home/ddiloco
USER 10001:10001
WORKDIR /home/ddiloco
# The synchronizer's port (h2c and HTTP/1.1), its upload port (HTTP/1.1 update bodies,
# synchronizer/upload_port.py) and the operator's liveness port.
EXPOSE 8470 8471 8080 9400
ENTRYPOINT ["ddiloco"]
CMD ["--help"]
