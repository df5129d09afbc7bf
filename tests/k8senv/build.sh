#!/usr/bin/env bash
# Build the k8senv binaries (the integration-test Kubernetes control plane) into OUT.
#
#   bash tests/k8senv/build.sh OUT
#
# Builds kube-apiserver, kube-controller-manager, kube-scheduler, kubectl (kube/go.mod), etcd and
# etcdctl (etcd/go.mod), kwok and helm (`go install pkg@version`), and assembles kwok's stage
# configuration from the kwok module in the Go module cache. Needs Go >= 1.26.8 and the Go module
# proxy; Go's own caches (GOCACHE, GOMODCACHE) stay where `go env` says, never in the repo.
# Normally run through `python tests/integration/k8senv.py build`, which picks OUT inside
# ~/.cache/ddiloco/k8senv/, takes a lock and writes the manifest; see tests/k8senv/README.md.
# Any change to this file (e.g. a version bump below) changes the cache key and triggers a rebuild.
set -euo pipefail

KUBE_VERSION=v1.37.2     # must match kube/go.mod
KWOK_VERSION=v0.8.0
HELM_VERSION=v3.22.0

OUT=${1:?usage: build.sh OUT}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false"
START=$SECONDS

step() { echo "k8senv build: $* (t=$((SECONDS - START))s)"; }

step "go: $(go version)"

# kube-apiserver, KCM, scheduler, kubectl: one `go build`, so shared packages compile once.
step "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl $KUBE_VERSION"
(
  cd "$HERE/kube"
  minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
  date=$(go list -m -f '{{.Time.Format "2006-01-02T15:04:05Z"}}' k8s.io/kubernetes)
  ldf="-s -w"
  # Both version packages are stamped, as k8s's hack/lib/version.sh does; without this the
  # binaries report v0.0.0-master and helm's kubeVersion checks cannot parse the server version.
  for kv in "gitVersion=$KUBE_VERSION" gitMajor=1 "gitMinor=$minor" gitTreeState=clean "buildDate=$date"; do
    ldf="$ldf -X k8s.io/component-base/version.$kv -X k8s.io/client-go/pkg/version.$kv"
  done
  go build -trimpath -ldflags "$ldf" -o "$OUT/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl
)

step "building etcd, etcdctl"
(
  cd "$HERE/etcd"
  # Name the outputs: for package paths ending in /v3 go would call both binaries "v3".
  go build -trimpath -ldflags "-s -w" -o "$OUT/etcd" go.etcd.io/etcd/server/v3
  go build -trimpath -ldflags "-s -w" -o "$OUT/etcdctl" go.etcd.io/etcd/etcdctl/v3
)

# `go install pkg@version` runs outside any main module; cd away from ours to make that explicit.
cd "$OUT"
step "building kwok $KWOK_VERSION"
GOBIN="$OUT" GOFLAGS=-buildvcs=false go install -trimpath \
  -ldflags "-s -w" \
  "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"

step "building helm $HELM_VERSION"
GOBIN="$OUT" GOFLAGS=-buildvcs=false go install -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
  "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"

# kwok >= v0.8.0 has no built-in stages: standalone kwok needs them in --config. The stock ones
# ship inside the kwok module; concatenate the ones we use (they are not copied into the repo).
step "assembling kwok stages"
kwok_dir=$(GOFLAGS=-buildvcs=false go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" \
  | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
stages="$kwok_dir/kustomize/stage"
{
  first=1
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml \
           pod/chaos/pod-container-running-failed.yaml node/chaos/node-not-ready.yaml; do
    [[ $first == 1 ]] || echo '---'
    first=0
    echo "# from sigs.k8s.io/kwok@$KWOK_VERSION kustomize/stage/$f"
    cat "$stages/$f"
  done
} > "$OUT/kwok-stages.yaml"

step "checking versions"
v=$("$OUT/kube-apiserver" --version)
echo "$v"
[[ $v == "Kubernetes $KUBE_VERSION" ]] || { echo "expected Kubernetes $KUBE_VERSION" >&2; exit 1; }
"$OUT/kubectl" version --client | grep -q "$KUBE_VERSION"
"$OUT/etcd" --version | head -1
"$OUT/kwok" --version 2>/dev/null || true
"$OUT/helm" version --short
ls -l "$OUT"
step "done in $((SECONDS - START))s"
