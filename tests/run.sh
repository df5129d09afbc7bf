#!/usr/bin/env bash
# The whole test suite on a fresh machine, in one command:
#
#     bash tests/run.sh
#
# 1. a virtual environment in .venv with the project and its dev extras (pip's cache in
#    ~/.cache/pip makes reruns fast);
# 2. ruff (lint and format check);
# 3. the test control plane (kube-apiserver, etcd, KCM, scheduler, kwok, kubectl, helm) built
#    from Go modules once per machine into ~/.cache/ddiloco/k8senv/ (cold: tens of minutes);
# 4. every test: unit, e2e (real processes) and integration (real apiservers).
# Extra arguments go to pytest, e.g. `bash tests/run.sh -m "not integration"`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
.venv/bin/ruff check .
.venv/bin/ruff format --check .
start=$(date +%s)
.venv/bin/python tests/integration/k8senv.py build
echo "k8senv ready after $(( $(date +%s) - start ))s"
exec .venv/bin/python -m pytest tests "$@"
