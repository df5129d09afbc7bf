"""The k8senv real node: a real kubelet, containerd and runc run the pods (tests/integration/
realnode.py, fixture `real_plane`).

    python tests/integration/k8senv.py build            # once per machine
    .venv/bin/pytest tests/integration/test_realnode.py

Covers what the operator's pods rely on: the node is Ready with the real kubelet; a container of
our probe image runs, answers on its pod IP, and `kubectl logs`/`exec` reach it; a pod reaches
another through a Service DNS name (<svc>.<ns>.svc.cluster.local and <svc>.<ns>.svc); the
`kubernetes` Service authenticates a pod's ServiceAccount token; a PVC of the default class binds
and its data outlives the pod; the Eviction API stops a real container (after a PDB blocked it);
and `k8senv.py up --real-node` killed with SIGKILL leaves no process, link or mount behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import k8senv
import pytest
import realnode

# Starting the session's node counts against the first test that uses it.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

UID = 10001  # the project's image user (operator/builders.py IMAGE_UID)
POD_TIMEOUT_S = 90.0


@pytest.fixture
def ns(real_plane: k8senv.ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace on the real node's cluster, with its default ServiceAccount."""
    cl = real_plane.home
    name = f"rn-{request.node.name[5:30].replace('_', '-').strip('-')}-{uuid.uuid4().hex[:6]}"
    cl.api("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    k8senv.wait_until(
        f"ServiceAccount {name}/default",
        lambda: cl.api("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default"),
        timeout=30,
    )
    try:
        yield name
    finally:
        with contextlib.suppress(OSError):
            cl.api("DELETE", f"/api/v1/namespaces/{name}")


def pod(
    name: str,
    *containers: tuple[str, list[str]],
    labels: dict[str, str] | None = None,
    volumes: list[dict[str, Any]] | None = None,
    mounts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A pod of probe containers (name, args), non-root like the project's pods."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 20,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": UID,
                "runAsGroup": UID,
                "fsGroup": UID,
            },
            "containers": [
                {
                    "name": cname,
                    "image": realnode.PROBE_IMAGE,
                    "imagePullPolicy": "Never",
                    "args": args,
                    "volumeMounts": mounts or [],
                }
                for cname, args in containers
            ],
            "volumes": volumes or [],
        },
    }


def create(plane: k8senv.ControlPlane, ns: str, body: dict[str, Any]) -> dict[str, Any]:
    return plane.home.api("POST", f"/api/v1/namespaces/{ns}/pods", body)  # type: ignore[no-any-return]


def get_pod(plane: k8senv.ControlPlane, ns: str, name: str) -> dict[str, Any]:
    return plane.home.api("GET", f"/api/v1/namespaces/{ns}/pods/{name}")  # type: ignore[no-any-return]


def wait_phase(plane: k8senv.ControlPlane, ns: str, name: str, *phases: str) -> dict[str, Any]:
    """Wait until the pod is in one of phases (Running means: and Ready); fail fast on Failed."""

    def probe() -> dict[str, Any] | None:
        p = get_pod(plane, ns, name)
        phase = p.get("status", {}).get("phase")
        if phase == "Failed" and "Failed" not in phases:
            logs = plane.kubectl("home", "logs", "-n", ns, name, "--all-containers", check=False)
            raise AssertionError(f"pod {name} Failed: {p['status']}\n{logs.stdout}{logs.stderr}")
        if phase == "Running":
            ready = any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p["status"].get("conditions") or []
            )
            return p if ready and "Running" in phases else None
        return p if phase in phases else None

    try:
        return k8senv.wait_until(  # type: ignore[no-any-return]
            f"pod {ns}/{name} {'/'.join(phases)}", probe, timeout=POD_TIMEOUT_S
        )
    except TimeoutError as e:
        status = json.dumps(get_pod(plane, ns, name).get("status"), indent=1)[:3000]
        raise AssertionError(f"{e}; status: {status}") from e


def logs(plane: k8senv.ControlPlane, ns: str, name: str, container: str | None = None) -> str:
    args = ["logs", "-n", ns, name] + ([f"-c={container}"] if container else [])
    return plane.kubectl("home", *args).stdout


def wait_gone(plane: k8senv.ControlPlane, path: str, timeout: float = POD_TIMEOUT_S) -> None:
    def gone() -> bool:
        try:
            plane.home.api("GET", path)
        except urllib.error.HTTPError as e:
            return e.code == 404
        return False

    k8senv.wait_until(f"{path} deleted", gone, timeout=timeout)


def container_ids(p: dict[str, Any]) -> list[str]:
    return [
        c["containerID"].removeprefix("containerd://")
        for c in p["status"].get("containerStatuses") or []
        if c.get("containerID")
    ]


# --------------------------------------------------------------------------- tests


def test_node_ready_with_real_kubelet(real_plane: k8senv.ControlPlane) -> None:
    node = real_plane.real_node
    assert node is not None
    nodes = real_plane.home.api("GET", "/api/v1/nodes")["items"]
    assert [n["metadata"]["name"] for n in nodes] == [node.name]  # no kwok nodes
    n = nodes[0]
    assert n["metadata"]["labels"][realnode.NODE_LABEL[0]] == realnode.NODE_LABEL[1]
    info = n["status"]["nodeInfo"]
    assert info["kubeletVersion"] == k8senv.KUBE_VERSION
    assert info["containerRuntimeVersion"] == "containerd://2.4.2"
    assert {"type": "InternalIP", "address": node.node_ip} in n["status"]["addresses"]
    assert node.ready()
    conditions = {c["type"]: c["status"] for c in n["status"]["conditions"]}
    assert conditions["MemoryPressure"] == conditions["DiskPressure"] == "False", conditions
    assert not n["spec"].get("taints"), n["spec"].get("taints")
    assert realnode.PAUSE_IMAGE in node.images()
    print(f"\nreal node {node.name}: {info['osImage']}, kernel {info['kernelVersion']}")


def test_real_container_runs_and_kubectl_reaches_it(
    real_plane: k8senv.ControlPlane, ns: str
) -> None:
    node = real_plane.real_node
    assert node is not None
    t0 = time.monotonic()
    create(real_plane, ns, pod("web", ("web", ["serve"])))
    p = wait_phase(real_plane, ns, "web", "Running")
    started = time.monotonic() - t0
    ip = p["status"]["podIP"]
    assert ip.startswith(node.pod_cidr.rsplit(".", 1)[0] + "."), ip
    # The host reaches the pod IP over the veth; the container logs the request it served.
    assert realnode.get_text(f"http://{ip}:8080/").strip() == "probe web"
    k8senv.wait_until(
        "the request in kubectl logs",
        lambda: re.search(
            rf"GET / from {re.escape(node.host_ip)}:\d+", logs(real_plane, ns, "web")
        ),
        timeout=30,
    )
    text = logs(real_plane, ns, "web")
    assert f"probe: uid={UID} gid={UID}" in text and "probe: serving on [::]:8080" in text, text
    # exec goes apiserver -> kubelet -> containerd's stream server -> runc.
    out = real_plane.kubectl(
        "home", "exec", "-n", ns, "web", "--", "/probe", "read", "/etc/hostname"
    )
    assert "read /etc/hostname: web" in out.stdout, out.stdout + out.stderr
    # A real container: containerd runs a task for it.
    (cid,) = container_ids(get_pod(real_plane, ns, "web"))
    assert cid in node.ctr("tasks", "ls"), cid
    print(f"\npod with the probe image Running/Ready in {started:.1f}s")


def test_pod_reaches_pod_through_service_dns(real_plane: k8senv.ControlPlane, ns: str) -> None:
    create(real_plane, ns, pod("server", ("web", ["serve"]), labels={"app": "server"}))
    real_plane.home.api(
        "POST",
        f"/api/v1/namespaces/{ns}/services",
        {
            "metadata": {"name": "hello"},
            "spec": {"selector": {"app": "server"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    )
    wait_phase(real_plane, ns, "server", "Running")
    fqdn, short = f"http://hello.{ns}.svc.cluster.local/", f"http://hello.{ns}.svc/"
    create(
        real_plane,
        ns,
        pod(
            "client",
            ("fqdn", ["get", "-expect", "probe server", fqdn]),
            ("short", ["get", "-expect", "probe server", short]),
        ),
    )
    wait_phase(real_plane, ns, "client", "Succeeded")
    assert f"get {fqdn}: probe server" in logs(real_plane, ns, "client", "fqdn")
    assert f"get {short}: probe server" in logs(real_plane, ns, "client", "short")
    served = logs(real_plane, ns, "server")
    assert served.count("probe: GET / from") >= 2, served


def test_kubernetes_service_accepts_service_account_token(
    real_plane: k8senv.ControlPlane, ns: str
) -> None:
    create(
        real_plane,
        ns,
        pod(
            "api",
            ("by-env", ["kube-api"]),  # KUBERNETES_SERVICE_HOST: the ClusterIP 10.96.0.1
            ("by-dns", ["kube-api", "-url", "https://kubernetes.default.svc"]),
        ),
    )
    wait_phase(real_plane, ns, "api", "Succeeded")
    user = f"system:serviceaccount:{ns}:default"
    assert f"kube-api https://10.96.0.1:443 user={user}" in logs(real_plane, ns, "api", "by-env")
    assert f"user={user}" in logs(real_plane, ns, "api", "by-dns")


def test_pvc_data_survives_the_pod(real_plane: k8senv.ControlPlane, ns: str) -> None:
    cl = real_plane.home
    cl.api(
        "POST",
        f"/api/v1/namespaces/{ns}/persistentvolumeclaims",
        {
            "metadata": {"name": "state"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    claim = k8senv.wait_until(
        "PVC state Bound",
        lambda: (
            c
            if (c := cl.api("GET", f"/api/v1/namespaces/{ns}/persistentvolumeclaims/state"))
            .get("status", {})
            .get("phase")
            == "Bound"
            else None
        ),
        timeout=30,
    )
    assert claim["spec"]["storageClassName"] == realnode.STORAGE_CLASS  # the default class
    pv = claim["spec"]["volumeName"]
    volume = [{"name": "state", "persistentVolumeClaim": {"claimName": "state"}}]
    mount = [{"name": "state", "mountPath": "/data"}]
    secret = uuid.uuid4().hex
    create(
        real_plane,
        ns,
        pod("writer", ("w", ["write", "/data/hello", secret]), volumes=volume, mounts=mount),
    )
    wait_phase(real_plane, ns, "writer", "Succeeded")
    assert f"wrote /data/hello uid={UID} gid={UID}" in logs(real_plane, ns, "writer")
    cl.api("DELETE", f"/api/v1/namespaces/{ns}/pods/writer")
    wait_gone(real_plane, f"/api/v1/namespaces/{ns}/pods/writer")
    create(
        real_plane, ns, pod("reader", ("r", ["read", "/data/hello"]), volumes=volume, mounts=mount)
    )
    wait_phase(real_plane, ns, "reader", "Succeeded")
    assert f"read /data/hello: {secret}" in logs(real_plane, ns, "reader")
    # Deleting the claim deletes its volume and the directory behind it.
    path = Path(cl.api("GET", f"/api/v1/persistentvolumes/{pv}")["spec"]["hostPath"]["path"])
    assert (path / "hello").read_text() == secret
    cl.api("DELETE", f"/api/v1/namespaces/{ns}/pods/reader")
    cl.api("DELETE", f"/api/v1/namespaces/{ns}/persistentvolumeclaims/state")
    wait_gone(real_plane, f"/api/v1/persistentvolumes/{pv}")
    k8senv.wait_until(f"{path} removed", lambda: not path.exists(), timeout=10)


def test_eviction_api_stops_the_real_container(real_plane: k8senv.ControlPlane, ns: str) -> None:
    cl, node = real_plane.home, real_plane.real_node
    assert node is not None
    create(real_plane, ns, pod("victim", ("main", ["sleep"]), labels={"app": "victim"}))
    (cid,) = container_ids(wait_phase(real_plane, ns, "victim", "Running"))
    assert cid in node.ctr("tasks", "ls")
    cl.api(
        "POST",
        f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
        {
            "metadata": {"name": "keep"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "victim"}}},
        },
    )
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": "victim", "namespace": ns},
    }
    path = f"/api/v1/namespaces/{ns}/pods/victim/eviction"
    with pytest.raises(urllib.error.HTTPError) as blocked:
        cl.api("POST", path, eviction)
    assert blocked.value.code == 429
    cl.api("DELETE", f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/keep")
    k8senv.wait_until("the eviction to be accepted", lambda: cl.api("POST", path, eviction), 30)
    t0 = time.monotonic()
    wait_gone(real_plane, f"/api/v1/namespaces/{ns}/pods/victim")
    # The kubelet confirmed the stop: SIGTERM ended `probe sleep` well before the 20 s grace.
    took = time.monotonic() - t0
    assert cid not in node.ctr("tasks", "ls")
    print(f"\nevicted pod gone {took:.1f}s after the eviction")


def test_up_real_node_killed_leaves_nothing(k8s_bindir: Path, tmp_path: Path) -> None:
    """`k8senv.py up --real-node`, then SIGKILL of the launcher: the kernel takes the node down
    (PDEATHSIG, the holder's PID namespace); only its empty cgroups stay, for cleanup_stale()."""
    script = Path(k8senv.__file__).resolve()
    run_dir = tmp_path / "up"
    proc = subprocess.Popen(
        [sys.executable, str(script), "up", "--clusters=1", "--real-node", f"--run-dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        out = "".join(lines)
        assert "Ctrl-C stops everything" in out, out[-3000:]
        m = re.search(r"real node +home-node \((10\.213\.(\d+)\.2),.*--target (\d+) ", out)
        assert m, out
        slot, holder = int(m.group(2)), int(m.group(3))
        assert k8senv.pid_alive(holder)
        kubeconfig = re.search(r"KUBECONFIG=(\S+)", out)
        assert kubeconfig, out
        nodes = subprocess.run(
            [k8s_bindir / "kubectl", f"--kubeconfig={kubeconfig.group(1)}", "get", "nodes"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert re.search(r"home-node +Ready", nodes.stdout), nodes.stdout + nodes.stderr
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    k8senv.wait_until("the node's holder to die", lambda: not k8senv.pid_alive(holder), 15)
    link = f"{realnode.HOST_LINK_PREFIX}{slot}"
    k8senv.wait_until(
        f"link {link} gone",
        lambda: (
            link not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        ),
        timeout=15,
    )
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(run_dir) not in mounts
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(run_dir) in _cmdline(p)]
    assert not left, [_cmdline(p) for p in left]
    # Its cgroups are all that is left, and a later start removes them.
    stale = f"{realnode.CGROUP_PREFIX}{proc.pid}-home"  # the node of cluster "home"
    assert any((c / stale).exists() for c in realnode._cgroup_controllers())
    removed = realnode.cleanup_stale()
    assert any(r.endswith(stale) for r in removed), removed
    assert not any((c / stale).exists() for c in realnode._cgroup_controllers())


def _cmdline(p: Path) -> str:
    try:
        return (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
