#!/usr/bin/env bash
# Build the k8senv binaries (the integration-test Kubernetes control plane) into OUT.
#
#   bash tests/k8senv/build.sh OUT
#
# Builds kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet, kube-proxy
# (kube/go.mod), etcd and etcdctl (etcd/go.mod), kwok and helm (`go install pkg@version`), and
# assembles kwok's stage configuration from the kwok module in the Go module cache. For the real
# node (tests/integration/realnode.py): containerd, containerd-shim-runc-v2, ctr
# (containerd/go.mod), CoreDNS (coredns/go.mod, a main with only the plugins we use), and our own
# pause and probe programs packed as OCI image archives (pause/, probe/, ociimage/). Needs Go >= 1.26.8 and the Go module
# proxy; Go's own caches (GOCACHE, GOMODCACHE) stay where `go env` says, never in the repo.
# Normally run through `python tests/integration/k8senv.py build`, which picks OUT inside
# ~/.cache/ddiloco/k8senv/, takes a lock and writes the manifest; see tests/k8senv/README.md.
# Any change to this file (e.g. a version bump below) changes the cache key and triggers a rebuild.
set -euo pipefail

KUBE_VERSION=v1.37.2     # must match kube/go.mod
CONTAINERD_VERSION=v2.4.2  # must match containerd/go.mod
COREDNS_VERSION=v1.15.0    # must match coredns/go.mod
# Image names realnode.py uses (PAUSE_IMAGE, PROBE_IMAGE there).
PAUSE_IMAGE=ddiloco.local/k8senv/pause:v1
PROBE_IMAGE=ddiloco.local/k8senv/probe:v1
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

# kube-apiserver, KCM, scheduler, kubectl, kubelet, kube-proxy: one `go build`, so shared packages
# compile once.
step "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet, kube-proxy $KUBE_VERSION"
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
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
)

step "building etcd, etcdctl"
(
  cd "$HERE/etcd"
  # Name the outputs: for package paths ending in /v3 go would call both binaries "v3".
  go build -trimpath -ldflags "-s -w" -o "$OUT/etcd" go.etcd.io/etcd/server/v3
  go build -trimpath -ldflags "-s -w" -o "$OUT/etcdctl" go.etcd.io/etcd/etcdctl/v3
)

# containerd with CGO_ENABLED=0: btrfs needs cgo anyway; devmapper, zfs and tracing are not used.
step "building containerd, containerd-shim-runc-v2, ctr $CONTAINERD_VERSION"
(
  cd "$HERE/containerd"
  go build -trimpath -tags no_btrfs,no_devmapper,no_zfs,no_tracing \
    -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" \
    -o "$OUT/" github.com/containerd/containerd/v2/cmd/containerd \
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
    github.com/containerd/containerd/v2/cmd/ctr
)

step "building coredns $COREDNS_VERSION"
(
  cd "$HERE/coredns"
  go build -trimpath -ldflags "-s -w" -o "$OUT/coredns" .
)

# Our own programs (no dependencies) and the two images the real node imports.
step "building pause, probe, ociimage and their images"
for m in pause probe ociimage; do
  (cd "$HERE/$m" && go build -trimpath -ldflags "-s -w" -o "$OUT/$m" .)
done
"$OUT/ociimage" -o "$OUT/pause.oci.tar" -name "$PAUSE_IMAGE" -entrypoint /pause \
  -user 65535:65535 "$OUT/pause=/pause"
"$OUT/ociimage" -o "$OUT/probe.oci.tar" -name "$PROBE_IMAGE" -entrypoint /probe -mkdir /tmp \
  "$OUT/probe=/probe"

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
for b in kubelet kube-proxy; do
  v=$("$OUT/$b" --version)
  [[ $v == "Kubernetes $KUBE_VERSION" ]] || { echo "$b: expected Kubernetes $KUBE_VERSION" >&2; exit 1; }
done
# (no `| grep -q`: grep exits at the first match and, under pipefail, the writer's SIGPIPE fails
# the build.)
v=$("$OUT/containerd" --version)
echo "$v"
[[ $v == *" $CONTAINERD_VERSION"* ]] || { echo "containerd: expected $CONTAINERD_VERSION" >&2; exit 1; }
v=$("$OUT/coredns" -version)
echo "$v"
[[ $v == *"CoreDNS-${COREDNS_VERSION#v}"* ]] || { echo "coredns: expected $COREDNS_VERSION" >&2; exit 1; }
[[ $("$OUT/kubectl" version --client) == *"$KUBE_VERSION"* ]]
v=$("$OUT/etcd" --version)
echo "${v%%$'\n'*}"
"$OUT/kwok" --version 2>/dev/null || true
"$OUT/helm" version --short
ls -l "$OUT"
step "done in $((SECONDS - START))s"
