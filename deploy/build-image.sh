#!/usr/bin/env bash
# Build the one ddiloco image from this repository's Dockerfile and, with --push, push it to
# your registry: the image every job's `spec.image` and the chart's `image.repository` name.
#
#   deploy/build-image.sh registry.example.com/ml/ddiloco:0.1.0 --push              # CPU torch
#   deploy/build-image.sh registry.example.com/ml/ddiloco:0.1.0-cuda --cuda cu128 --push
#   deploy/build-image.sh ddiloco:0.1.0 && kind load docker-image ddiloco:0.1.0      # no registry
#   deploy/build-image.sh ddiloco:0.1.0 --cuda cu126 --dry-run    # print the commands only
#
# --cuda FLAVOR builds the CUDA variant (a PyTorch wheel index name: cu126, cu128, ...); the
# rest of the image is the same. Uses docker, else podman (DDILOCO_IMAGE_TOOL picks one).
set -euo pipefail
usage() { echo "usage: $0 IMAGE[:TAG] [--cuda FLAVOR] [--push] [--dry-run]" >&2; exit 2; }
[ $# -ge 1 ] || usage
image=$1; shift
case "$image" in -*|"") usage ;; esac
flavor=cpu push=0 dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) [ $# -ge 2 ] || usage; flavor=$2; shift 2 ;;
    --push) push=1; shift ;;
    --dry-run) dry=1; shift ;;
    *) usage ;;
  esac
done
case "$flavor" in cpu|cu[0-9]*) ;; *) echo "$0: --cuda $flavor: give a CUDA wheel flavour such as cu128" >&2; exit 2 ;; esac
tool=${DDILOCO_IMAGE_TOOL:-$(command -v docker || command -v podman || true)}
if [ -z "$tool" ] && [ "$dry" = 0 ]; then
  echo "$0: neither docker nor podman is installed" >&2; exit 1
fi
tool=${tool:-docker}
root=$(cd "$(dirname "$0")/.." && pwd)
run() { echo "+ $*"; [ "$dry" = 1 ] || "$@"; }
run "$tool" build -t "$image" --build-arg "TORCH_FLAVOR=$flavor" "$root"
if [ "$push" = 1 ]; then
  run "$tool" push "$image"
fi
