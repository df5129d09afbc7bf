#!/usr/bin/env bash
# Build Kueue's controller manager for the integration tests into OUT, with the files the test
# control plane installs beside it: Kueue's CRDs (crds.yaml) and its webhook configurations
# (webhooks.yaml), both copied from the same Kueue module so they match the binary.
#
#   bash tests/kueue/build.sh OUT
#
# Normally run through `python tests/integration/kueueenv.py build`, which picks OUT inside
# ~/.cache/ddiloco/kueue/, takes a lock and writes the manifest. Kueue's go.mod has no replace
# lines, so this folder's go.mod (a `tool` line and Kueue's requirements, pinned by go.sum)
# builds it as it is; it is kept out of tests/k8senv/ so that a Kueue bump does not rebuild the
# control plane. Needs Go >= 1.26.8 and the Go module proxy. Any change to this file or to
# go.mod / go.sum changes the cache key and triggers a rebuild.
set -euo pipefail

KUEUE_VERSION=v0.17.0   # must match go.mod

OUT=${1:?usage: build.sh OUT}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false"
START=$SECONDS
step() { echo "kueue build: $* (t=$((SECONDS - START))s)"; }

step "go: $(go version)"
cd "$HERE"
step "building the kueue controller manager $KUEUE_VERSION"
go build -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" \
  -o "$OUT/kueue" sigs.k8s.io/kueue/cmd/kueue

step "copying CRDs and webhook configurations from the module"
dir=$(go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)
[[ -n $dir && -d $dir/config/components ]] || { echo "kueue module not in the module cache" >&2; exit 1; }
{
  first=1
  for f in "$dir"/config/components/crd/bases/*.yaml; do
    [[ $first == 1 ]] || echo '---'
    first=0
    echo "# from sigs.k8s.io/kueue@$KUEUE_VERSION config/components/crd/bases/${f##*/}"
    cat "$f"
  done
} > "$OUT/crds.yaml"
cp "$dir/config/components/webhook/manifests.yaml" "$OUT/webhooks.yaml"
chmod 0644 "$OUT/crds.yaml" "$OUT/webhooks.yaml"

ls -l "$OUT"
step "done in $((SECONDS - START))s"
