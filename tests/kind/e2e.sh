#!/usr/bin/env bash
# End to end on a real (kind) cluster, for machines with Docker. Opt-in, not part of CI:
#
#   bash tests/kind/e2e.sh                 # build, load, install, run the CPU demo, clean up
#   KEEP=1 bash tests/kind/e2e.sh          # keep the cluster to look around (kind delete cluster --name ddiloco-e2e)
#   DDILOCO_KIND_REQUIRED=1 bash ...        # no Docker engine is a failure, not a skip
#
# Steps: docker build the image (slim, CPU torch); kind create cluster; kind load the image;
# helm install charts/ddiloco; helm test (the operator's /healthz); kubectl apply the CPU demo
# (deploy/examples/tiny-cpu.yaml, with the image just built); wait until its status counts
# merges; helm test again, now also calling the job's synchronizer /healthz.
# Needs docker (with a running engine), kind, helm and kubectl on PATH.
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER=${CLUSTER:-ddiloco-e2e}
IMAGE=${IMAGE:-ddiloco:e2e}
JOB=tiny-cpu
NS=ddiloco-system
TIMEOUT_S=${TIMEOUT_S:-900}
CTX="kind-$CLUSTER"

skip() {
  echo "SKIP tests/kind/e2e.sh: $*"
  if [[ ${DDILOCO_KIND_REQUIRED:-0} == 1 ]]; then exit 1; fi
  exit 0
}
for tool in docker kind helm kubectl; do
  command -v "$tool" >/dev/null || skip "$tool is not installed"
done
docker info >/dev/null 2>&1 || skip "no Docker engine runs here (docker info failed)"

say() { echo "kind e2e: $* (t=${SECONDS}s)"; }
dump() {
  say "FAILED; state of the cluster follows"
  kubectl --context "$CTX" get ddj,pods,pvc -A -o wide || true
  kubectl --context "$CTX" describe ddj "$JOB" || true
  kubectl --context "$CTX" -n "$NS" logs deployment/ddiloco-operator --tail=80 || true
  kubectl --context "$CTX" logs "statefulset/$JOB-synchronizer" --tail=80 || true
}
cleanup() {
  if [[ ${KEEP:-0} != 1 ]]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
}
trap 'dump' ERR
trap 'cleanup' EXIT

say "building $IMAGE"
docker build -t "$IMAGE" .

if ! kind get clusters | grep -qx "$CLUSTER"; then
  say "creating kind cluster $CLUSTER"
  kind create cluster --name "$CLUSTER" --config tests/kind/kind-config.yaml --wait 120s
fi
say "loading $IMAGE into the cluster"
kind load docker-image "$IMAGE" --name "$CLUSTER"

say "installing the chart"
helm upgrade --install ddiloco charts/ddiloco --kube-context "$CTX" -n "$NS" --create-namespace \
  --set image.repository="${IMAGE%%:*}" --set image.tag="${IMAGE##*:}" \
  --set image.pullPolicy=Never --wait --timeout 180s
helm test ddiloco --kube-context "$CTX" -n "$NS" --logs

say "starting the CPU demo job"
sed "s|^  image: .*|  image: $IMAGE\n  imagePullPolicy: Never|" deploy/examples/tiny-cpu.yaml \
  | kubectl --context "$CTX" apply -f -

say "waiting for merges (up to ${TIMEOUT_S}s)"
deadline=$((SECONDS + TIMEOUT_S))
merges=0
until [[ ${merges:-0} -ge 3 ]]; do
  if ((SECONDS > deadline)); then
    echo "no merges after ${TIMEOUT_S}s" >&2
    false
  fi
  sleep 10
  merges=$(kubectl --context "$CTX" get ddj "$JOB" -o jsonpath='{.status.merges}')
  kubectl --context "$CTX" get ddj "$JOB" --no-headers
done

say "helm test, now also calling the synchronizer"
helm upgrade ddiloco charts/ddiloco --kube-context "$CTX" -n "$NS" --reuse-values \
  --set tests.synchronizerUrl="https://$JOB-synchronizer.default.svc:8470" --set tests.synchronizerTrustSecret="$JOB-trust"
helm test ddiloco --kube-context "$CTX" -n "$NS" --logs

kubectl --context "$CTX" get ddj "$JOB" \
  -o jsonpath='{"merges="}{.status.merges}{" version="}{.status.globalVersion}{" tokens="}{.status.tokensMerged}{" goodput="}{.status.goodput}{"\n"}'
kubectl --context "$CTX" delete ddj "$JOB" --wait --timeout 120s
say "PASSED"
