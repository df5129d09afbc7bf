"""Helpers and fixtures for the operator's integration tests (tests/integration/test_operator_*.py).

    .venv/bin/pytest tests/integration -m integration -k operator

The operator runs as in production: `python -m ddiloco.cli.main operator -n <namespace>` in a
subprocess, on the home cluster's kubeconfig; the regions are reached only through kubeconfig
Secrets made here (certificates inlined, as `kubectl config view --flatten` would). Each test
gets a fresh namespace in every cluster (conftest's `k8s_namespace`) and its own operator
watching only that namespace. Waits are deadlines on conditions, never bare sleeps.

Test files load this module by path (pytest runs with --import-mode=importlib, so nothing
here is importable by name) and import the fixtures they use (`cl`, `operator`,
`crd_installed`, defined here as *_fixture functions).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import k8senv
import kubernetes
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "deploy" / "crds" / "ddiloco.dev_decoupleddilocojobs.yaml"
EXAMPLES = REPO / "deploy" / "examples"
RBAC = REPO / "deploy" / "rbac"
GROUP, VERSION, PLURAL = "ddiloco.dev", "v1alpha1", "decoupleddilocojobs"
RESYNC_S = "0.5"


def forbidden(log: str) -> list[str]:
    """Log lines that report an authorization refusal (HTTP 403 / Forbidden).

    A bare "403" also appears in timestamps (",403]"), so look for the status as the
    kubernetes client and kopf print it."""
    pattern = re.compile(r"Forbidden|\(403\)|status[=:' ]+403|HTTP 403")
    return [line for line in log.splitlines() if pattern.search(line)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- the operator


class _StatusStub(BaseHTTPRequestHandler):
    """Answers GET /<namespace>/<job>/v1/status as a synchronizer that has merged nothing yet:
    the synchronizer pods are kwok's and never run, and the operator calls a job Ready only
    once its synchronizer answered (operator/status.py). GET /<namespace>/<job>/shard-<i>/v1/status
    (the operator's shard_url_template here) answers as shard i of a sharded one: a whole Status owning fragment i at
    version i + 1, so the job's status shows the shards' sum."""

    def do_GET(self) -> None:
        ok = self.path.endswith("/v1/status") and self.headers.get("Authorization", "").startswith(
            "Bearer "
        )
        answer: dict[str, Any] = {"global_version": 0, "merges": 0, "tokens_merged": 0}
        shard = re.search(r"/shard-(\d+)/v1/status$", self.path)
        if shard:
            answer = _shard_status(int(shard.group(1)))
        body = json.dumps(answer).encode()
        override = next((b for p, b in STATUS_OVERRIDES.items() if self.path.startswith(p)), None)
        if override is not None:
            body = override
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) if ok else 0))
        self.end_headers()
        if ok:
            self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def _shard_status(shard: int) -> dict[str, Any]:
    version = shard + 1
    fragment = {"index": shard, "merge": "rda", "version": version, "contributors_pending": 0}
    return {
        "initialized": True,
        "global_version": version,
        "merges": version,
        "tokens_merged": 0,
        "contributions_merged": version,
        "contributions_rejected": 0,
        "mean_contributors": 1.0,
        "mean_staleness": 0.0,
        "bytes_up": 0,
        "bytes_down": 0,
        "goodput": None,
        "fragments": [{**fragment, "shard": shard}],
        "learners": [],
        "xi": {"step": None, "quorum": None, "sync": None},
        "shard": shard,
    }


# "/<namespace>/<job>/" -> the raw body the stub answers for that job instead (a hostile
# or broken synchronizer)
STATUS_OVERRIDES: dict[str, bytes] = {}
_STUB: list[str] = []
_STUB_LOCK = threading.Lock()


def status_stub() -> str:
    """The STATUS_URL_TEMPLATE of one stub synchronizer status endpoint per test session."""
    with _STUB_LOCK:
        if not _STUB:
            server = ThreadingHTTPServer(("127.0.0.1", 0), _StatusStub)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            _STUB.append(f"http://127.0.0.1:{server.server_address[1]}/{{namespace}}/{{name}}")
        return _STUB[0]


@dataclass
class Operator:
    """One `ddiloco operator` process; restartable, killable."""

    kubeconfig: Path
    namespace: str
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    metrics_port: int = 0  # its /metrics (operator/metrics.py), a free port per start

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def scrape(self) -> str:
        """One GET of the operator's /metrics."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return str(r.read().decode())

    @property
    def log(self) -> Path:
        return self.log_dir / f"operator-{self.starts}.log"

    def start(self, timeout: float = 30.0) -> None:
        self.starts += 1
        port, self.metrics_port = free_port(), free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "DDILOCO_OPERATOR_RESYNC_SECONDS": RESYNC_S,
            "DDILOCO_OPERATOR_STATUS_POLL_SECONDS": "1",
            "DDILOCO_OPERATOR_LIVENESS_ENDPOINT": f"http://127.0.0.1:{port}/healthz",
            "DDILOCO_OPERATOR_CLEANUP_TIMEOUT_SECONDS": "10",
            "DDILOCO_OPERATOR_STATUS_URL_TEMPLATE": status_stub(),
            "DDILOCO_OPERATOR_SHARD_URL_TEMPLATE": status_stub() + "/shard-{shard}",
            "DDILOCO_OPERATOR_METRICS_PORT": str(self.metrics_port),
            "DDILOCO_OPERATOR_METRICS_ADDRESS": "127.0.0.1",
            **self.env,
        }
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ddiloco.cli.main",
                    "operator",
                    "-n",
                    self.namespace,
                    "--verbose",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.log_dir,
            )

        def alive() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.tail()}")
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                return r.status == 200

        try:
            k8senv.wait_until("the operator's liveness endpoint", alive, timeout=timeout)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{self.tail()}") from None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, as a crashed or OOM-killed operator."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


# --------------------------------------------------------------------------- cluster access


class Clusters:
    """kubernetes API clients per cluster of the control plane, for the test's own checks."""

    def __init__(self, plane: Any, namespace: str) -> None:
        self.plane, self.ns = plane, namespace
        self.api = {name: cl.api_client() for name, cl in plane.clusters.items()}

    def core(self, cluster: str = "home") -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.api[cluster])

    def apps(self, cluster: str = "home") -> kubernetes.client.AppsV1Api:
        return kubernetes.client.AppsV1Api(self.api[cluster])

    def custom(self) -> kubernetes.client.CustomObjectsApi:
        return kubernetes.client.CustomObjectsApi(self.api["home"])

    def job(self, name: str) -> dict[str, Any]:
        return self.custom().get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def pods(self, cluster: str, job: str) -> list[Any]:
        """The job's learner pods in one cluster."""
        return (
            self.core(cluster)
            .list_namespaced_pod(
                self.ns, label_selector=f"ddiloco.dev/job={job},app.kubernetes.io/component=learner"
            )
            .items
        )

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.plane.kubectl("home", "-n", self.ns, *args, input=input, check=check)

    def close(self) -> None:
        for client in self.api.values():
            client.close()


def condition(job: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(
        (c for c in (job.get("status") or {}).get("conditions") or [] if c["type"] == type_), {}
    )


def wait_condition(
    cl: Clusters,
    name: str,
    type_: str,
    status: str = "True",
    reason: str | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Wait for a job condition; return the job. The timeout message shows the conditions."""
    last: dict[str, Any] = {}

    def probe() -> dict[str, Any] | None:
        nonlocal last
        last = cl.job(name)
        c = condition(last, type_)
        ok = c.get("status") == status and (reason is None or c.get("reason") == reason)
        return last if ok else None

    try:
        return k8senv.wait_until(f"{type_}={status} ({reason}) on {name}", probe, timeout)
    except TimeoutError as e:
        conds = (last.get("status") or {}).get("conditions")
        raise TimeoutError(f"{e}; conditions: {json.dumps(conds, indent=1)}") from None


def flat_kubeconfig(cluster: Any) -> str:
    """The cluster's kubeconfig with the CA inlined: a Secret cannot point at our files."""
    cfg = json.loads(Path(cluster.kubeconfig).read_text())
    for entry in cfg["clusters"]:
        ca = entry["cluster"].pop("certificate-authority", None)
        if ca:
            entry["cluster"]["certificate-authority-data"] = base64.b64encode(
                Path(ca).read_bytes()
            ).decode()
    return yaml.safe_dump(cfg)


def token_kubeconfig(cluster: Any, token: str, namespace: str) -> str:
    """A kubeconfig for `cluster` as the holder of `token`, CA inlined."""
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": cluster.name,
                    "cluster": {
                        "server": cluster.server,
                        "certificate-authority-data": base64.b64encode(
                            cluster.ca_file.read_bytes()
                        ).decode(),
                    },
                }
            ],
            "users": [{"name": "sa", "user": {"token": token}}],
            "contexts": [
                {
                    "name": "sa",
                    "context": {"cluster": cluster.name, "user": "sa", "namespace": namespace},
                }
            ],
            "current-context": "sa",
        }
    )


def kubeconfig_secret(
    cl: Clusters, secret: str, cluster: str | None, text: str | None = None
) -> None:
    """Create or replace a kubeconfig Secret in the home namespace (for `cluster`, or `text`)."""
    content = text if text is not None else flat_kubeconfig(cl.plane.clusters[cluster])
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": secret},
        "type": "Opaque",
        "stringData": {"kubeconfig": content},
    }
    core = cl.core()
    try:
        core.create_namespaced_secret(cl.ns, body)
    except ApiException as e:
        if e.status != 409:
            raise
        core.replace_namespaced_secret(secret, cl.ns, body)


def state_volume(
    cl: Clusters, job: str, size: str = "50Gi", shard: int = 0, claim: str | None = None
) -> str:
    """A PersistentVolume pre-bound to a synchronizer shard's claim (the StatefulSet's
    `state-<job>-synchronizer-<shard>`, or `claim`): the control plane has no storage
    provisioner, and a synchronizer pod is scheduled only once its claim is bound."""
    name = f"{cl.ns}-{job}-{shard}"[:63].rstrip("-")
    cl.core().create_persistent_volume(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Delete",
                "storageClassName": "",
                "hostPath": {"path": f"/tmp/ddiloco-test/{name}"},
                "claimRef": {
                    "namespace": cl.ns,
                    "name": claim or f"state-{job}-synchronizer-{shard}",
                },
            },
        }
    )
    return name


def job_manifest(name: str, groups: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "DecoupledDiLoCoJob",
        "metadata": {"name": name},
        "spec": {
            "image": "ddiloco:test",
            "training": {"model": "tiny", "maxSteps": 100},
            "synchronizer": {"storage": {"size": "1Gi", "storageClassName": ""}},
            "learnerGroups": groups,
            "failurePolicy": {"backoffSeconds": 0.5, "maxReplacementsPerSlot": 5},
        },
    }
    body["spec"].update(spec)
    return body


def remote(name: str, replicas: int, secret: str | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "replicas": replicas,
        "cluster": {"kubeconfigSecret": {"name": secret or f"{name}-kubeconfig"}},
        "syncUrl": "https://ddiloco-sync.home.example:8470",  # pods never run: any URL
        "resources": {"limits": {"nvidia.com/gpu": 1}},
    }


def pods_by_slot(cl: Clusters, clusters: list[str], job: str) -> dict[str, list[Any]]:
    """Pods of the job in the given clusters, by learner id (hot spares, which hold no slot
    and have no learner id, are left out)."""
    out: dict[str, list[Any]] = {}
    for name in clusters:
        for p in cl.pods(name, job):
            if lid := p.metadata.labels.get("ddiloco.dev/learner-id"):
                out.setdefault(lid, []).append(p)
    return out


def running_uids(cl: Clusters, clusters: list[str], job: str) -> dict[str, str]:
    """learner id -> uid of its Running, Ready pod; only when every slot has exactly one."""
    out: dict[str, str] = {}
    for lid, pods in pods_by_slot(cl, clusters, job).items():
        live = [
            p for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp
        ]
        if len(pods) == 1 and live:
            out[lid] = live[0].metadata.uid
    return out


def slot_pod(cl: Clusters, cluster: str, job: str, learner_id: str) -> str:
    """The name of the pod of one learner slot (`<job>-<group>-<index>-<tag>`, the tag a hash
    of the job's uid: builders.learner_pod_name), found by its learner-id label."""
    pods = pods_by_slot(cl, [cluster], job).get(learner_id) or []
    if len(pods) != 1:
        raise LookupError(f"{len(pods)} pods for slot {learner_id} of {job} in {cluster}")
    return str(pods[0].metadata.name)


def untagged(name: str) -> str:
    """A slot pod's name without its tag: `<job>-<group>-<index>`."""
    return name.rsplit("-", 1)[0]


# --------------------------------------------------------------------------- credentials


def job_key(cl: Clusters, job: str) -> list[str]:
    """The job key's lines, newest first, as the home `<job>-token` Secret holds them."""
    data = cl.core().read_namespaced_secret(f"{job}-token", cl.ns).data["token"]
    return [x.strip() for x in base64.b64decode(data).decode().splitlines() if x.strip()]


def job_secret_names(cl: Clusters, cluster: str, job: str) -> set[str]:
    """The names of the job's Secrets in one cluster (listed by label: the test may list
    Secrets, the operator never does)."""
    found = cl.core(cluster).list_namespaced_secret(cl.ns, label_selector=f"ddiloco.dev/job={job}")
    return {s.metadata.name for s in found.items}


def learner_credentials(
    cl: Clusters, cluster: str, job: str, group: str
) -> tuple[str, dict[str, str]]:
    """A group's learner credentials Secret in its cluster: (name, decoded items)."""
    found = (
        cl.core(cluster)
        .list_namespaced_secret(
            cl.ns,
            label_selector=(
                f"ddiloco.dev/job={job},ddiloco.dev/group={group},"
                "app.kubernetes.io/component=learner-tokens"
            ),
        )
        .items
    )
    if len(found) != 1:
        raise LookupError(f"{len(found)} credentials Secrets of group {group} in {cluster}")
    data = {k: base64.b64decode(v).decode() for k, v in (found[0].data or {}).items()}
    return str(found[0].metadata.name), data


def check_own_credential(cl: Clusters, cluster: str, job: str, pod: Any) -> str:
    """Assert that `pod` (a learner or a hot spare) mounts its own credential and nothing of
    the job key: one item of its group's credentials Secret, as the token file, holding what
    the key derives for its learner id (or, a spare, for its pod name). Returns the item."""
    from ddiloco.wire import auth

    volumes = {v.name: v for v in pod.spec.volumes}
    secrets = [v.secret.secret_name for v in volumes.values() if v.secret is not None]
    assert f"{job}-token" not in secrets, (pod.metadata.name, secrets)
    token = volumes["token"].secret
    labels = pod.metadata.labels
    group = labels["ddiloco.dev/group"]
    name, data = learner_credentials(cl, cluster, job, group)
    assert token.secret_name == name
    (item,) = token.items
    if "ddiloco.dev/spare" in labels:  # born a spare: its own pod's item, also promoted
        assert item.key == f"spare.{pod.metadata.name}"
        # which holds its spare credential until the promotion, then its slot's
        if labels.get("ddiloco.dev/role") == "spare":
            kind, who = "spare", pod.metadata.name
        else:
            kind, who = "learner", labels["ddiloco.dev/learner-id"]
    else:
        kind, who = "learner", labels["ddiloco.dev/learner-id"]
        assert item.key == who
    assert item.path == "token"
    mount = next(m for m in pod.spec.containers[0].volume_mounts if m.name == "token")
    assert not mount.sub_path  # a subPath mount would never see a rotation
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    assert env["DDILOCO_TOKEN_FILE"] == f"{mount.mount_path}/token" and "DDILOCO_TOKEN" not in env
    assert data[item.key] == auth.derived_lines(job_key(cl, job), kind, who)
    return str(item.key)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session", name="crd_installed")
def crd_fixture(k8s: Any) -> None:
    k8s.kubectl("home", "apply", "--server-side", "-f", str(CRD_FILE))
    k8s.kubectl(
        "home", "wait", "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{GROUP}"
    )


@pytest.fixture(name="cl")
def cl_fixture(k8s: Any, k8s_namespace: str, crd_installed: None) -> Iterator[Clusters]:
    clusters = Clusters(k8s, k8s_namespace)
    pvs: list[str] = []
    clusters.pvs = pvs  # type: ignore[attr-defined]
    yield clusters
    for pv in pvs:
        with contextlib.suppress(ApiException):
            clusters.core().delete_persistent_volume(pv)
    clusters.close()


@pytest.fixture(name="operator")
def operator_fixture(k8s: Any, cl: Clusters, tmp_path: Path) -> Iterator[Operator]:
    op = Operator(k8s.home.kubeconfig, cl.ns, tmp_path)
    op.start()
    yield op
    try:
        delete_jobs(cl, op)
    finally:
        op.stop()


def delete_jobs(cl: Clusters, op: Operator, timeout: float = 30.0) -> None:
    """Delete every job of the namespace while the operator runs (it holds finalizers); if it
    cannot finish, strip the finalizers so the namespace can go."""
    custom = cl.custom()
    items = custom.list_namespaced_custom_object(GROUP, VERSION, cl.ns, PLURAL)["items"]
    for job in items:
        custom.delete_namespaced_custom_object(
            GROUP, VERSION, cl.ns, PLURAL, job["metadata"]["name"]
        )
    try:
        k8senv.wait_until(
            "jobs deleted",
            lambda: (
                not custom.list_namespaced_custom_object(GROUP, VERSION, cl.ns, PLURAL)["items"]
            ),
            timeout,
        )
    except TimeoutError:
        for job in custom.list_namespaced_custom_object(GROUP, VERSION, cl.ns, PLURAL)["items"]:
            custom.patch_namespaced_custom_object(
                GROUP,
                VERSION,
                cl.ns,
                PLURAL,
                job["metadata"]["name"],
                {"metadata": {"finalizers": None}},
            )
        if op.running():
            raise


def create_job(cl: Clusters, body: dict[str, Any], volume: bool = True) -> str:
    name = body["metadata"]["name"]
    if volume:
        shards = body["spec"].get("synchronizer", {}).get("shards", 1)
        for i in range(shards):
            cl.pvs.append(state_volume(cl, name, shard=i))  # type: ignore[attr-defined]
    cl.custom().create_namespaced_custom_object(
        GROUP, VERSION, cl.ns, PLURAL, body, field_validation="Strict"
    )
    return name


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0
