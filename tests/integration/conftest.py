"""Fixtures for tests/integration: a real Kubernetes control plane (tests/k8senv), one per session.

    python tests/integration/k8senv.py build                 # once per machine (~40 min cold)
    .venv/bin/pytest tests/integration -m integration        # then the tests

Fixture API (stable; tests/integration/test_operator_*.py code against it):

``k8s`` (session scope) -> ``k8senv.ControlPlane``, already started:
    k8s.names              ["home", "region-a", "region-b"] (DDILOCO_K8SENV_CLUSTERS=n changes
                           the count; the first is always "home", then region-a, region-b, ...)
    k8s.home               == k8s.clusters["home"]
    k8s.clusters[name]     k8senv.Cluster, frozen:
        .name              "home" | "region-a" | ...
        .kubeconfig        Path of an admin kubeconfig (context = name, namespace default)
        .server            "https://127.0.0.1:<port>"
        .token             admin bearer token (group system:masters); never log or print it
        .ca_file           Path of the CA that signed the apiserver cert
        .api_client()      a new kubernetes.client.ApiClient for this cluster
        .api(method, path, body=None)   one JSON request, stdlib only
    k8s.bin("helm")        Path of a built binary: kubectl, helm, kwok, etcd, kube-apiserver, ...
    k8s.bindir             on PATH for the whole session, so `kubectl` and `helm` are ours
                           (they still need --kubeconfig; KUBECONFIG is not set)
    k8s.kubectl(name, *args, input=None, check=True) -> CompletedProcess[str]
    k8s.frozen(name)       context manager: that cluster's kube-apiserver SIGSTOPped within it
                           (connects succeed, nothing answers), always continued after it
    k8s.node_names(name)   fake nodes of a cluster: "<name>-gpu-0", "<name>-gpu-1"; kwok keeps
                           them Ready and runs their pods. Labels: type=kwok,
                           topology.kubernetes.io/region=<name>, topology.kubernetes.io/zone=
                           <name>-1, nvidia.com/gpu.present=true; capacity nvidia.com/gpu=8,
                           cpu=32, memory=256Gi, pods=110. No taints.
    k8senv.KUBE_VERSION    "v1.37.2" (import k8senv works once this conftest has loaded)
    k8senv.wait_until(what, probe, timeout=60) -> probe()'s first truthy result; exceptions
                           from probe count as "not yet"; TimeoutError names `what`

``k8s_bindir`` (session scope) -> Path of the built binaries, without starting anything (for
    tests that start their own plane); skips or fails like ``k8s``.

``k8s_namespace`` (function scope) -> str: a fresh namespace with this name exists in every
    cluster and its ``default`` ServiceAccount exists; it is deleted (not awaited) afterwards.
    Delete your own custom resources first, while your operator still runs, if they hold
    finalizers.

Pods on the fake nodes: kwok marks them Running/Ready (with a podIP) a moment after they are
bound, and deletes them at once when they get a deletionTimestamp. Containers never run.
Failure injection (kwok stages): label a Running pod
`pod-container-running-failed.stage.kwok.x-k8s.io=true` and kwok sets it Failed (annotations
`pod-container-running-failed.stage.kwok.x-k8s.io/exit-code`, `/reason`, `/message`, `/delay`
shape it; tested). Labelling a node `node-not-ready.stage.kwok.x-k8s.io=true` sets it NotReady
(untested here; it taints the shared node, so its pods get evicted after 10 s).

``real_plane`` (session scope) -> ``k8senv.ControlPlane`` with two clusters, "home" and
    "region-a", no fake nodes and a real node in each (realnode.py): pods run real containers
    (containerd + runc). Started on first use (~20 s), separate from ``k8s``. Besides the
    ``k8s`` API above:
    real_plane.real_node        realnode.RealNode: .name "home-node" (label
                                ddiloco.dev/real-node=true), .node_ip, .host_ip (the apiserver
                                listens there), .pod_cidr, .run(*argv) inside the node,
                                .ctr(*args) (`ctr -n k8s.io`), .images()
    real_plane.import_image(archive) -> [image names]   OCI or docker-archive tar into the
                                node's containerd (pods: imagePullPolicy IfNotPresent/Never)
    realnode.PROBE_IMAGE        our tiny test image (tests/k8senv/probe: serve/get/kube-api/...)
    Services, cluster DNS (<svc>.<ns>.svc[.cluster.local]), the `kubernetes` Service with
    ServiceAccount tokens, kubectl logs/exec, and PVCs of the default StorageClass `standard`
    (hostPath, chmod 0777, pinned to the node) work. Needs root and Debian's runc and
    containernetworking-plugins: without them it fails (never skips).

``real_regions`` (session scope) -> ``real_plane`` itself, whose region-a is joined to home only
    by a shaped link (wanlink.py, REGION_LINK: 50mbit each way, 40 ms round trip). Each test
    module uses namespaces of its own. Besides the API above:
    real_regions.real_nodes["region-a"]     that region's RealNode
    real_regions.import_image(archive, cluster="region-a")
    real_regions.links["region-a"]          wanlink.RegionLink: .host_ip (where region-a's pods
                                            reach home), .expose(port, host, port) -> "ip:port",
                                            .cut(), .heal(), .bytes_relayed()

``kueue`` (session scope) -> ``kueueenv.Kueue``: Kueue's controller manager (v0.17, built by
    `python tests/integration/kueueenv.py build`) serving the home cluster of ``k8s``, its CRDs
    and webhooks installed; .log, .alive(), .tail(). Started on first use (~10 s).

``real_kueue`` (session scope) -> ``kueueenv.Kueue`` like ``kueue``, serving the home cluster of
    ``real_plane`` instead: Kueue admitting jobs whose pods run real containers. Skips (fails
    in CI) when Kueue is not built, like ``kueue``.

With CI=true a missing build or toolchain fails the session; elsewhere the tests skip with the
command to run. A build that failed is an error everywhere. The build never runs inside pytest.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# --import-mode=importlib puts nothing on sys.path; load the harness and the test helpers of
# this folder by path, once, under their own names, so test modules just `import k8senv` etc.
# (in dependency order)
for _name in (
    "k8senv",
    "kueueenv",
    "realnode",
    "realnode_image",
    "operator_helpers",
    "chart_helpers",
):
    if _name not in sys.modules:
        _spec = importlib.util.spec_from_file_location(
            _name, Path(__file__).with_name(f"{_name}.py")
        )
        assert _spec is not None and _spec.loader is not None
        sys.modules[_name] = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(sys.modules[_name])
import k8senv  # noqa: E402 - registered by path just above
import kueueenv  # noqa: E402 - registered by path just above
import realnode  # noqa: E402 - registered by path just above

NAMESPACE_TIMEOUT_S = 30.0
REGION_LINK = "50mbit,40ms"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _cluster_names() -> list[str]:
    n = int(os.environ.get("DDILOCO_K8SENV_CLUSTERS", len(k8senv.DEFAULT_CLUSTERS)))
    if n < 1:
        raise pytest.UsageError(f"DDILOCO_K8SENV_CLUSTERS must be >= 1, got {n}")
    names = list(k8senv.DEFAULT_CLUSTERS[:n])
    return names + [f"region-{chr(ord('a') + i - 1)}" for i in range(len(names), n)]


@pytest.fixture(scope="session")
def k8s_bindir() -> Path:
    """The built binaries' directory; skips (fails in CI) when they are not built."""
    try:
        if (failed := k8senv.failed_build_log()) is not None and k8senv.find_built() is None:
            pytest.fail(
                f"k8senv: the last build failed, see {failed}; fix it and run "
                f"`{k8senv.BUILD_COMMAND}`",
                pytrace=False,
            )
        bindir = k8senv.find_built()
    except k8senv.BuildFailed as e:
        pytest.fail(f"k8senv: {e}", pytrace=False)
    if bindir is None:
        msg = k8senv.missing_message()
        if _in_ci():
            pytest.fail(f"{msg} [CI=true: the build step must run before pytest]", pytrace=False)
        pytest.skip(msg)
    return bindir


@pytest.fixture(scope="session")
def k8s(
    k8s_bindir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[k8senv.ControlPlane]:
    bindir = k8s_bindir
    plane = k8senv.ControlPlane(bindir, tmp_path_factory.mktemp("k8senv"), _cluster_names())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
        try:
            plane.start()
            yield plane
        finally:
            plane.stop()
            left = [p.name for p in plane.procs if k8senv.pid_alive(p.pid)]
            if left:
                pytest.fail(f"k8senv: processes left behind after stop(): {left}", pytrace=False)


@pytest.fixture(scope="session")
def real_plane(
    k8s_bindir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[k8senv.ControlPlane]:
    """The home cluster's real node and region-a's behind the shaped link: one plane for every
    real-node test, so the session starts two nodes and imports an image once per node."""
    if problems := realnode.problems():
        pytest.fail("k8senv real node cannot run here: " + "; ".join(problems), pytrace=False)
    plane = k8senv.ControlPlane(
        k8s_bindir, tmp_path_factory.mktemp("realnode"), ["home", "region-a"],
        nodes_per_cluster=0, real_nodes=2, link=REGION_LINK,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{k8s_bindir}{os.pathsep}{os.environ.get('PATH', '')}")
        try:
            plane.start()
            yield plane
        finally:
            plane.stop()
            left = [p.name for p in plane.procs if k8senv.pid_alive(p.pid)]
            for node in plane.real_nodes.values():
                if node.holder_pid and k8senv.pid_alive(node.holder_pid):
                    left.append(f"node holder {node.holder_pid}")
                left += node.leftovers()
            if left:
                pytest.fail(f"k8senv: left behind after stop(): {left}", pytrace=False)


@pytest.fixture(scope="session")
def real_regions(real_plane: k8senv.ControlPlane) -> k8senv.ControlPlane:
    """``real_plane``, named for the tests about its two regions."""
    return real_plane


@pytest.fixture(scope="session")
def kueue(k8s: k8senv.ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Kueue's controller manager in the home cluster of ``k8s`` (kueueenv.Kueue), started on
    first use and kept for the session; skips (fails in CI) when Kueue is not built."""
    yield from _kueue_on(k8s, tmp_path_factory)


@pytest.fixture(scope="session")
def real_kueue(
    real_plane: k8senv.ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """Kueue's controller manager in the home cluster of ``real_plane``, as ``kueue``."""
    yield from _kueue_on(real_plane, tmp_path_factory)


def _kueue_on(
    plane: k8senv.ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """A started kueueenv.Kueue in `plane`'s home cluster until the generator is closed."""
    try:
        bindir = kueueenv.find_built()
    except kueueenv.BuildFailed as e:
        pytest.fail(f"kueueenv: {e}", pytrace=False)
    if bindir is None:
        msg = kueueenv.missing_message()
        if _in_ci():
            pytest.fail(f"{msg} [CI=true: the build step must run before pytest]", pytrace=False)
        pytest.skip(msg)
    kq = kueueenv.Kueue(bindir, plane, plane.names[0], tmp_path_factory.mktemp("kueue"))
    try:
        kq.start()
        yield kq
    finally:
        kq.stop()
        if kq.proc is not None and k8senv.pid_alive(kq.proc.pid):
            pytest.fail("kueueenv: kueue left behind after stop()", pytrace=False)


def _wait_default_sa(k8s: k8senv.ControlPlane, name: str) -> None:
    deadline = time.monotonic() + NAMESPACE_TIMEOUT_S
    pending = set(k8s.names)
    while pending:
        for cl in list(pending):
            try:
                k8s.clusters[cl].api("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")
                pending.discard(cl)
            except OSError:  # 404 until kube-controller-manager creates it
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"no default ServiceAccount in namespace {name} of {pending}")
        if pending:
            time.sleep(0.1)


@pytest.fixture
def k8s_namespace(k8s: k8senv.ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    base = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())
    name = f"t-{base[:40].strip('-')}-{uuid.uuid4().hex[:6]}"
    body = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {"ddiloco.test/namespace": "true"}},
    }
    for cl in k8s.clusters.values():
        cl.api("POST", "/api/v1/namespaces", body)
    try:
        _wait_default_sa(k8s, name)
        yield name
    finally:
        for cl in k8s.clusters.values():
            # The control plane may be gone already (session teardown); nothing to clean then.
            with contextlib.suppress(OSError):
                cl.api("DELETE", f"/api/v1/namespaces/{name}")
