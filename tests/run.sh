#!/usr/bin/env bash
# The whole test suite on a fresh machine, in one command:
#
#     bash tests/run.sh
#
# 1. a virtual environment in .venv with the project and its dev extras (pip's cache in
#    ~/.cache/pip makes reruns fast);
# 2. ruff (lint and format check);
# 3. Debian's podman, buildah, runc, debootstrap, iptables and CNI plugins, and chromium (the
#    HTML report's test opens it headless) (apt, when missing);
#    the test control plane (kube-apiserver, etcd, KCM, scheduler, kwok, kubectl, helm, and
#    for the real node kubelet, kube-proxy, containerd, CoreDNS) built from Go modules once per
#    machine into ~/.cache/ddiloco/k8senv/; the S3-compatible server of the object-storage
#    tests (VersityGW, tests/s3server.py) into ~/.cache/ddiloco/s3server/; Kueue's controller
#    manager (tests/integration/kueueenv.py) into ~/.cache/ddiloco/kueue/; the image from our
#    Dockerfile on a debootstrap base, cached in /var/lib/containers;
# 4. every test: unit, e2e (real processes) and integration (real apiservers).
# Extra arguments go to pytest, e.g. `bash tests/run.sh -m "not integration"`.
set -euo pipefail
cd "$(dirname "$0")/.."
run_start=$(date +%s)
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Debian packages for the real node and the image build (containers, CNI, debootstrap); apt
# only when one is missing, so a warm machine pays nothing.
DEBS=(podman buildah runc debootstrap iptables containernetworking-plugins conntrack uidmap
      fuse-overlayfs chromium)
missing=()
for deb in "${DEBS[@]}"; do dpkg -s "$deb" >/dev/null 2>&1 || missing+=("$deb"); done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# The builds need only the standard library and the packages above, so they start now, beside
# the virtual environment's downloads: the Go builds (CPU) one after another, the image (mostly
# downloads and disk) beside them. Each runs in a process group of its own, stopped if this
# script fails first; its log is shown when it is done.
builds_log=$(mktemp)
image_log=$(mktemp)
setsid bash -c '
  set -euo pipefail
  for build in tests/integration/k8senv.py tests/s3server.py tests/integration/kueueenv.py; do
    start=$(date +%s)
    "$0" "$build" build
    echo "$(basename "$build" .py) ready after $(( $(date +%s) - start ))s"
  done' "$PY" >"$builds_log" 2>&1 &
builds_pid=$!
setsid "$PY" tests/integration/image.py build >"$image_log" 2>&1 &
image_pid=$!
trap 'kill -- "-$builds_pid" "-$image_pid" 2>/dev/null || true' EXIT
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "environment and lint ready after $(( $(date +%s) - run_start ))s"
for job in builds image; do
  pid_var=${job}_pid log_var=${job}_log
  rc=0
  wait "${!pid_var}" || rc=$?
  cat "${!log_var}"
  rm -f "${!log_var}"
  if [ "$rc" -ne 0 ]; then
    echo "the $job failed (exit $rc)" >&2
    exit "$rc"
  fi
  echo "$job ready $(( $(date +%s) - run_start ))s after the start"
done
trap - EXIT
exec .venv/bin/python -m pytest tests --durations=40 "$@"
