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
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The image build is mostly downloads and disk, the Go builds below are CPU: they run side by
# side, and the image's log is shown when it is done (or failed).
image_log=$(mktemp)
image_start=$(date +%s)
.venv/bin/python tests/integration/image.py build >"$image_log" 2>&1 &
image_pid=$!
trap 'kill "$image_pid" 2>/dev/null || true' EXIT  # a failed Go build stops it too
start=$(date +%s)
.venv/bin/python tests/integration/k8senv.py build
echo "k8senv ready after $(( $(date +%s) - start ))s"
start=$(date +%s)
.venv/bin/python tests/s3server.py build
echo "s3server ready after $(( $(date +%s) - start ))s"
start=$(date +%s)
.venv/bin/python tests/integration/kueueenv.py build
echo "kueue ready after $(( $(date +%s) - start ))s"
image_rc=0
wait "$image_pid" || image_rc=$?
trap - EXIT
cat "$image_log"
rm -f "$image_log"
if [ "$image_rc" -ne 0 ]; then
  echo "image build failed (exit $image_rc)" >&2
  exit "$image_rc"
fi
echo "image ready after $(( $(date +%s) - image_start ))s (built beside the Go builds)"
exec .venv/bin/python -m pytest tests --durations=40 "$@"
