"""Smoke tests of the k8senv control plane: is what the `k8s` fixture starts a real Kubernetes?

    python tests/integration/k8senv.py build            # once per machine
    .venv/bin/pytest tests/integration/test_k8senv.py

Covers what the operator relies on: the pinned server version, CRDs with schema validation and
a status subresource, Deployments scheduled onto kwok's fake GPU nodes, the eviction API with a
PodDisruptionBudget, helm, isolation between clusters, and that nothing outlives the plane.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import k8senv
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

pytestmark = pytest.mark.integration

GROUP = "k8senv.test.ddiloco.dev"
CRD = f"""
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.{GROUP}
spec:
  group: {GROUP}
  scope: Namespaced
  names: {{plural: widgets, singular: widget, kind: Widget}}
  versions:
  - name: v1
    served: true
    storage: true
    subresources: {{status: {{}}}}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            required: [gpus]
            properties:
              gpus: {{type: integer, minimum: 0}}
              region: {{type: string}}
          status:
            type: object
            properties:
              phase: {{type: string}}
"""


def _deployment(name: str, replicas: int, gpus: int, region: str) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {"topology.kubernetes.io/region": region},
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "learner",
                            "image": "registry.invalid/learner:0",
                            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                        }
                    ],
                },
            },
        },
    }


def _running_pods(core: client.CoreV1Api, ns: str, app: str) -> list[client.V1Pod]:
    pods = core.list_namespaced_pod(ns, label_selector=f"app={app}").items
    return [
        p
        for p in pods
        if p.status.phase == "Running"
        and p.metadata.deletion_timestamp is None
        and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
    ]


def test_kubectl_reports_pinned_server_version(k8s: k8senv.ControlPlane) -> None:
    assert shutil.which("kubectl") == str(k8s.bin("kubectl"))  # ours, via PATH
    out = subprocess.run(
        ["kubectl", f"--kubeconfig={k8s.home.kubeconfig}", "version", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    versions = json.loads(out.stdout)
    assert versions["serverVersion"]["gitVersion"] == k8senv.KUBE_VERSION
    assert versions["serverVersion"]["gitVersion"].startswith("v1.37.")
    assert versions["clientVersion"]["gitVersion"] == k8senv.KUBE_VERSION
    assert "warning" not in out.stderr.lower()  # no version-skew warning


def test_crd_is_served_and_custom_object_round_trips(
    k8s: k8senv.ControlPlane, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    k8s.kubectl("home", "apply", "-f", "-", input=CRD)
    try:
        k8s.kubectl(
            "home", "wait", "--for=condition=Established", f"crd/widgets.{GROUP}", "--timeout=30s"
        )
        widget = {
            "apiVersion": f"{GROUP}/v1",
            "kind": "Widget",
            "metadata": {"name": "w1", "namespace": ns},
            "spec": {"gpus": 4, "region": "home"},
        }
        # kubectl's discovery cache may lag the new CRD for a moment.
        applied = k8senv.wait_until(
            "kubectl to apply a Widget",
            lambda: (
                k8s.kubectl(
                    "home", "apply", "-f", "-", input=json.dumps(widget), check=False
                ).returncode
                == 0
            ),
        )
        assert applied

        objs = client.CustomObjectsApi(k8s.home.api_client())
        got = objs.get_namespaced_custom_object(GROUP, "v1", ns, "widgets", "w1")
        assert got["spec"] == {"gpus": 4, "region": "home"}

        # The structural schema prunes unknown fields (the client asks for no strict validation;
        # kubectl does, and would refuse the object instead).
        extra = {**widget, "metadata": {"name": "w3"}, "spec": {"gpus": 1, "unknownField": "x"}}
        objs.create_namespaced_custom_object(GROUP, "v1", ns, "widgets", extra)
        assert objs.get_namespaced_custom_object(GROUP, "v1", ns, "widgets", "w3")["spec"] == {
            "gpus": 1
        }
        strict = k8s.kubectl(
            "home",
            "apply",
            "-f",
            "-",
            check=False,
            input=json.dumps({**extra, "metadata": {"name": "w4", "namespace": ns}}),
        )
        assert strict.returncode != 0 and "unknownField" in strict.stderr

        got["status"] = {"phase": "Running"}
        objs.replace_namespaced_custom_object_status(GROUP, "v1", ns, "widgets", "w1", got)
        again = objs.get_namespaced_custom_object(GROUP, "v1", ns, "widgets", "w1")
        assert again["status"] == {"phase": "Running"}
        assert again["spec"] == {"gpus": 4, "region": "home"}

        # A stale resourceVersion is a conflict, as the operator's status writes will see.
        got["spec"]["gpus"] = 2
        with pytest.raises(ApiException) as conflict:
            objs.replace_namespaced_custom_object(GROUP, "v1", ns, "widgets", "w1", got)
        assert conflict.value.status == 409

        bad = {**widget, "metadata": {"name": "w2", "namespace": ns}, "spec": {"gpus": -1}}
        res = k8s.kubectl("home", "apply", "-f", "-", input=json.dumps(bad), check=False)
        assert res.returncode != 0
        assert "spec.gpus" in res.stderr
    finally:
        k8s.kubectl("home", "delete", f"crd/widgets.{GROUP}", "--wait=false", check=False)


def test_deployment_pods_run_on_fake_gpu_nodes(
    k8s: k8senv.ControlPlane, k8s_namespace: str
) -> None:
    api = k8s.home.api_client()
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    apps.create_namespaced_deployment(k8s_namespace, _deployment("learner", 2, 4, "home"))

    pods = k8senv.wait_until(
        "2 learner pods Running",
        lambda: ps if len(ps := _running_pods(core, k8s_namespace, "learner")) == 2 else None,
    )
    for pod in pods:
        assert pod.spec.node_name in k8s.node_names("home")
        assert pod.status.pod_ip
        node = core.read_node(pod.spec.node_name)
        assert node.metadata.annotations["kwok.x-k8s.io/node"] == "fake"
        assert node.metadata.labels["topology.kubernetes.io/region"] == "home"
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
    k8senv.wait_until(
        "deployment available",
        lambda: (
            apps.read_namespaced_deployment("learner", k8s_namespace).status.available_replicas == 2
        ),
    )


def test_scheduler_enforces_gpu_capacity(k8s: k8senv.ControlPlane, k8s_namespace: str) -> None:
    core = client.CoreV1Api(k8s.home.api_client())
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "too-big"},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": "registry.invalid/x:0",
                    "resources": {"limits": {"nvidia.com/gpu": "9"}},
                }
            ]
        },
    }
    core.create_namespaced_pod(k8s_namespace, pod)

    def unschedulable() -> bool:
        p = core.read_namespaced_pod("too-big", k8s_namespace)
        return any(
            c.type == "PodScheduled" and c.reason == "Unschedulable"
            for c in p.status.conditions or []
        )

    k8senv.wait_until("too-big to be Unschedulable", unschedulable)
    p = core.read_namespaced_pod("too-big", k8s_namespace)
    assert p.spec.node_name is None and p.status.phase == "Pending"


def test_eviction_api_respects_pdb_and_evicts(k8s: k8senv.ControlPlane, k8s_namespace: str) -> None:
    ns = k8s_namespace
    api = k8s.home.api_client()
    apps, core, policy = client.AppsV1Api(api), client.CoreV1Api(api), client.PolicyV1Api(api)
    apps.create_namespaced_deployment(ns, _deployment("evictee", 1, 1, "home"))
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "pdb"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "evictee"}}},
    }
    policy.create_namespaced_pod_disruption_budget(ns, pdb)
    (old,) = k8senv.wait_until("evictee Running", lambda: _running_pods(core, ns, "evictee"))
    name = old.metadata.name
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=ns))

    # The disruption controller (KCM) must have counted the pod before the PDB means anything.
    k8senv.wait_until(
        "PDB status",
        lambda: (
            (s := policy.read_namespaced_pod_disruption_budget("pdb", ns).status) is not None
            and s.current_healthy == 1
            and s.disruptions_allowed == 0
        ),
    )
    with pytest.raises(ApiException) as blocked:
        core.create_namespaced_pod_eviction(name, ns, eviction)
    assert blocked.value.status == 429

    policy.patch_namespaced_pod_disruption_budget("pdb", ns, {"spec": {"minAvailable": 0}})
    k8senv.wait_until(
        "PDB to allow one disruption",
        lambda: (
            policy.read_namespaced_pod_disruption_budget("pdb", ns).status.disruptions_allowed == 1
        ),
    )
    core.create_namespaced_pod_eviction(name, ns, eviction)

    def gone() -> bool:
        try:
            core.read_namespaced_pod(name, ns)
        except ApiException as e:
            return e.status == 404
        return False

    k8senv.wait_until(f"evicted pod {name} to be deleted", gone, timeout=30)
    (new,) = k8senv.wait_until("replacement Running", lambda: _running_pods(core, ns, "evictee"))
    assert new.metadata.uid != old.metadata.uid
    assert new.spec.node_name in k8s.node_names("home")


def test_kwok_fails_a_labelled_running_pod(k8s: k8senv.ControlPlane, k8s_namespace: str) -> None:
    """Failure injection for chaos tests: kwok's pod-container-running-failed stage."""
    core = client.CoreV1Api(k8s.home.api_client())
    prefix = "pod-container-running-failed.stage.kwok.x-k8s.io"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "doomed", "annotations": {f"{prefix}/exit-code": "3"}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "learner", "image": "registry.invalid/learner:0"}],
        },
    }
    core.create_namespaced_pod(k8s_namespace, pod)
    k8senv.wait_until(
        "doomed Running",
        lambda: core.read_namespaced_pod("doomed", k8s_namespace).status.phase == "Running",
    )
    core.patch_namespaced_pod("doomed", k8s_namespace, {"metadata": {"labels": {prefix: "true"}}})
    failed = k8senv.wait_until(
        "doomed Failed",
        lambda: (
            (p := core.read_namespaced_pod("doomed", k8s_namespace)).status.phase == "Failed" and p
        ),
    )
    (state,) = [c.state.terminated for c in failed.status.container_statuses]
    assert state is not None and state.exit_code == 3


def test_clusters_are_isolated(k8s: k8senv.ControlPlane, k8s_namespace: str) -> None:
    assert len(k8s.names) >= 2, "needs two clusters (DDILOCO_K8SENV_CLUSTERS >= 2)"
    a, b = k8s.names[:2]
    assert k8s.clusters[a].server != k8s.clusters[b].server
    k8s.kubectl(
        a, "-n", k8s_namespace, "create", "configmap", "only-here", f"--from-literal=cluster={a}"
    )
    assert (
        k8s.kubectl(
            a,
            "-n",
            k8s_namespace,
            "get",
            "configmap",
            "only-here",
            "-o",
            "jsonpath={.data.cluster}",
        ).stdout
        == a
    )
    missing = k8s.kubectl(b, "-n", k8s_namespace, "get", "configmap", "only-here", check=False)
    assert missing.returncode != 0 and "NotFound" in missing.stderr
    for name in (a, b):
        nodes = json.loads(k8s.kubectl(name, "get", "nodes", "-o", "json").stdout)["items"]
        assert sorted(n["metadata"]["name"] for n in nodes) == k8s.node_names(name)
        assert {n["metadata"]["labels"]["topology.kubernetes.io/region"] for n in nodes} == {name}


def test_helm_installs_a_chart_with_kube_version_constraint(
    k8s: k8senv.ControlPlane, k8s_namespace: str, tmp_path: Path
) -> None:
    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(
        textwrap.dedent("""\
        apiVersion: v2
        name: probe
        version: 0.1.0
        kubeVersion: ">=1.37.0-0 <1.38.0-0"
        """)
    )
    (chart / "templates" / "cm.yaml").write_text(
        textwrap.dedent("""\
        apiVersion: v1
        kind: ConfigMap
        metadata: {name: probe}
        data: {kube: "{{ .Capabilities.KubeVersion.Version }}"}
        """)
    )
    assert shutil.which("helm") == str(k8s.bin("helm"))
    subprocess.run(
        [
            "helm",
            "install",
            "probe",
            str(chart),
            "--namespace",
            k8s_namespace,
            f"--kubeconfig={k8s.home.kubeconfig}",
            "--wait",
            "--timeout=60s",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=90,
    )
    kube = k8s.kubectl(
        "home", "-n", k8s_namespace, "get", "configmap", "probe", "-o", "jsonpath={.data.kube}"
    ).stdout
    assert kube == k8senv.KUBE_VERSION


def test_children_die_with_their_parent(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a SIGKILLed test session leaves no control-plane process behind."""
    script = textwrap.dedent(f"""\
        import sys, time
        sys.path.insert(0, {str(Path(k8senv.__file__).parent)!r})
        import k8senv
        p = k8senv.spawn(["sleep", "600"], __import__("pathlib").Path({str(tmp_path)!r}) / "s.log")
        print(p.pid, flush=True)
        time.sleep(600)
        """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert k8senv.pid_alive(child)
    parent.kill()
    parent.wait()
    k8senv.wait_until("the orphan to die", lambda: not k8senv.pid_alive(child), timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_launcher_starts_and_stops_cleanly_on_ctrl_c(k8s_bindir: Path, tmp_path: Path) -> None:
    """`k8senv.py up` as a developer runs it: ready, usable, and Ctrl-C leaves nothing running."""
    up = subprocess.Popen(
        [
            sys.executable,
            k8senv.__file__,
            "up",
            "--clusters",
            "1",
            "--nodes",
            "1",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert up.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not lines or "ready; Ctrl-C" not in lines[-1]:
            line = up.stdout.readline()
            assert line, f"launcher exited early:\n{''.join(lines)}"
            lines.append(line)
            assert time.monotonic() < deadline, "".join(lines)
        kubeconfig = tmp_path / "run" / "home.kubeconfig"
        assert f"KUBECONFIG={kubeconfig}" in "".join(lines)
        children = _children(up.pid)
        assert len(children) == 5, children  # etcd, kube-apiserver, KCM, scheduler, kwok
        nodes = subprocess.run(
            [
                str(k8s_bindir / "kubectl"),
                f"--kubeconfig={kubeconfig}",
                "get",
                "nodes",
                "-o",
                "name",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
        assert nodes.split() == ["node/home-gpu-0"]
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=60)
        assert up.returncode == 0, "".join(lines) + out
        assert "k8senv: stopped" in out
        assert [p for p in children if k8senv.pid_alive(p)] == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_logs_and_run_dir_keep_the_token_private(k8s: k8senv.ControlPlane) -> None:
    token = k8s.home.token
    logs = list(k8s.run_dir.rglob("*.log"))
    assert len(logs) >= 1 + 4 * len(k8s.names)  # etcd + 4 per cluster
    leaking = [str(p) for p in logs if token in p.read_text(errors="replace")]
    assert leaking == [], "admin token found in logs"
    for cl in k8s.clusters.values():
        assert cl.kubeconfig.stat().st_mode & 0o077 == 0
    assert token not in repr(k8s.home)


def _children(pid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                kids.append(int(d.name))
    return sorted(kids)
