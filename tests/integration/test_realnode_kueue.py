"""Preempted by a real Kueue while its learners run in real containers: what kwok cannot show.

    python tests/integration/k8senv.py build       # the control plane and the real node (once)
    python tests/integration/kueueenv.py build     # Kueue (once)
    python tests/integration/image.py build        # the image (once per project change)
    .venv/bin/pytest tests/integration/test_realnode_kueue.py -s

The operator (the chart, in a real container), Kueue's controller manager (``real_kueue``) and
deploy/examples/tiny-cpu.yaml labelled with a LocalQueue, on the real node of ``real_plane``.
The job waits while its ClusterQueue holds, runs once admitted (on the ResourceFlavor's node
label), and is preempted by a higher-priority Workload that needs the whole quota (a bare
Workload: Kueue admits it and nothing runs, so it costs no CPU). A preemption must look to the
learners like a node's: SIGTERM, every fragment handed over and accepted, exit code 0, read
from the pods' container statuses as they end (a watch) and from each learner's last log line.
The synchronizer, which takes those hand-overs, stops after the last learner pod is gone and
keeps its claim; readmitted, it comes back from that state (every fragment holds at least the
tokens the learners computed, the global version carries on from where it was) and merges
more. Measured times are printed (`-s`), never asserted.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import chart_helpers as c
import k8senv
import pytest
import realnode_image
import yaml

# the module fixture may import a 5 GB image into the node (minutes); the test waits on real pods
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

JOB = "kq-tiny"
KQ = ("kueue.x-k8s.io", "v1beta2")
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
REAL_NODE_LABEL = "ddiloco.dev/real-node"  # on the real node: the flavor's node label
LEARNERS = f"ddiloco.dev/job={JOB},app.kubernetes.io/component=learner"
SYNCS = f"ddiloco.dev/job={JOB},app.kubernetes.io/component=synchronizer"
# tiny-cpu.yaml's requests: the synchronizer's 250m and 512Mi, two learners' 500m and 1Gi each
QUOTA = {"cpu": "1250m", "memory": "3Gi"}
STOPPED = re.compile(
    r"Learner (\S+) stopped: .*'tokens': (\d+),.*; tokens refused or unsent: (\d+)"
)

# One read of the synchronizer's own /v1/status from inside its pod (its token file is there).
STATUS = """
import json, os, ssl, urllib.request
token = open(os.environ["DDILOCO_TOKEN_FILE"]).read().split()[0]
ctx, scheme = None, "http"
if cert := os.environ.get("DDILOCO_TLS_CERT_FILE"):  # the job's CA signed it; not for 127.0.0.1
    ctx, scheme = ssl.create_default_context(cafile=os.path.dirname(cert) + "/ca.crt"), "https"
    ctx.check_hostname = False
req = urllib.request.Request(f"{scheme}://127.0.0.1:8470/v1/status",
                             headers={"Authorization": f"Bearer {token}"})
with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
    print(r.read().decode())
"""


@dataclass
class Env:
    """The plane, the namespace with the operator, and this module's Kueue objects."""

    plane: Any
    ns: str
    image: str
    figures: dict[str, float] = field(default_factory=dict)

    @property
    def flavor(self) -> str:
        return f"rf-{self.ns}"

    @property
    def cq(self) -> str:
        return f"cq-{self.ns}"

    @property
    def low(self) -> str:
        return f"low-{self.ns}"

    @property
    def high(self) -> str:
        return f"high-{self.ns}"

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60.0) -> str:
        return self.plane.kubectl("home", "-n", self.ns, *args, check=check, timeout=timeout).stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def api(self, method: str, path: str, body: Any = None) -> Any:
        return self.plane.home.api(method, path, body)

    def kq(self, plural: str, name: str = "", namespaced: bool = True) -> str:
        base = f"/apis/{KQ[0]}/{KQ[1]}"
        base += f"/namespaces/{self.ns}/{plural}" if namespaced else f"/{plural}"
        return f"{base}/{name}" if name else base

    def job(self) -> dict[str, Any]:
        return self.get("ddj", JOB)

    def workload(self, name: str) -> dict[str, Any]:
        return dict(self.api("GET", self.kq("workloads", name)))


def helm(env: Env, *args: str, timeout: float = 300) -> None:
    argv = [str(env.plane.bin("helm")), *args, "--kubeconfig", str(env.plane.home.kubeconfig)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"


def create_queues(env: Env) -> None:
    """Flavor (the real node's label), priority classes low (10) and high (1000), a held
    ClusterQueue with room for tiny-cpu and no more, and the LocalQueue `lq`."""
    env.api("POST", env.kq("resourceflavors", namespaced=False), {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
        "metadata": {"name": env.flavor}, "spec": {"nodeLabels": {REAL_NODE_LABEL: "true"}},
    })  # fmt: skip
    for name, value in ((env.low, 10), (env.high, 1000)):
        env.api("POST", env.kq("workloadpriorityclasses", namespaced=False), {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
            "metadata": {"name": name}, "value": value,
        })  # fmt: skip
    env.api("POST", env.kq("clusterqueues", namespaced=False), {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
        "metadata": {"name": env.cq},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": env.ns}},
            "resourceGroups": [{
                "coveredResources": sorted(QUOTA),
                "flavors": [{"name": env.flavor, "resources": [
                    {"name": k, "nominalQuota": v} for k, v in sorted(QUOTA.items())]}],
            }],
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "stopPolicy": "Hold",
        },
    })  # fmt: skip
    env.api("POST", env.kq("localqueues"), {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
        "metadata": {"name": "lq"}, "spec": {"clusterQueue": env.cq},
    })  # fmt: skip


def delete_queues(env: Env) -> None:
    """The cluster-scoped objects (not awaited: the namespace's deletion takes the rest)."""
    for plural, name in (
        ("clusterqueues", env.cq),
        ("resourceflavors", env.flavor),
        ("workloadpriorityclasses", env.low),
        ("workloadpriorityclasses", env.high),
    ):
        with contextlib.suppress(OSError):
            env.api("DELETE", env.kq(plural, name, namespaced=False))


@pytest.fixture(scope="module")
def env(
    real_plane: Any, real_kueue: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Env]:
    tag = realnode_image.on_node(real_plane, tmp_path_factory)
    ns = f"t-realkueue-{uuid.uuid4().hex[:6]}"
    real_plane.create_namespace(ns)
    e = Env(real_plane, ns, tag)
    release = f"dd-{uuid.uuid4().hex[:5]}"
    repo, version = tag.rsplit(":", 1)
    try:
        t0 = time.monotonic()
        helm(
            e, "install", release, str(c.CHART), "-n", ns,
            "--set", f"image.repository={repo}", "--set", f"image.tag={version}",
            "--set", "image.pullPolicy=Never", "--set", f"operator.watchNamespaces={{{ns}}}",
            "--set-string", "operator.env.DDILOCO_OPERATOR_STATUS_POLL_SECONDS=2",
            "--wait", "--timeout", "240s",
        )  # fmt: skip
        e.figures["helm_install_wait_s"] = round(time.monotonic() - t0, 1)
        create_queues(e)
        yield e
    finally:
        if e.figures:
            print("\nreal-node Kueue figures: " + json.dumps(e.figures, indent=1))
        with contextlib.suppress(subprocess.SubprocessError):
            e.kubectl("delete", "ddj", "--all", "--wait=true", "--timeout=90s", check=False)
        with contextlib.suppress(subprocess.SubprocessError):
            helm(e, "uninstall", release, "-n", ns, "--wait", "--timeout", "60s", timeout=120)
        delete_queues(e)
        real_plane.kubectl("home", "delete", "namespace", ns, "--wait=false", check=False)
        assert real_kueue.alive(), f"kueue exited during the test:\n{real_kueue.tail()}"


# ---------------------------------------------------------------------------------------------
class LearnerWatch:
    """Every learner pod of the job as the apiserver last showed it (a watch, so the final
    status a kubelet writes before the pod is removed is seen too), by uid: its name, phase,
    the learner container's exit code once it terminated, and whether it was deleted."""

    def __init__(self, env: Env) -> None:
        from kubernetes import client, watch

        self.core = client.CoreV1Api(env.plane.home.api_client())
        self.ns = env.ns
        self.watch = watch.Watch()
        self.pods: dict[str, dict[str, Any]] = {}
        self.errors: list[str] = []
        self.closed = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.closed:
            try:
                for ev in self.watch.stream(
                    self.core.list_namespaced_pod, self.ns, label_selector=LEARNERS,
                    timeout_seconds=120,
                ):  # fmt: skip
                    self._seen(ev["type"], ev["object"])
            except Exception as e:  # the connection dropped: watch again
                self.errors.append(repr(e))
                time.sleep(0.2)

    def _seen(self, kind: str, pod: Any) -> None:
        row = {"name": pod.metadata.name, "phase": pod.status.phase, "deleted": kind == "DELETED"}
        for st in pod.status.container_statuses or []:
            if st.name != "learner":
                continue
            done = (st.state and st.state.terminated) or (
                st.last_state and st.last_state.terminated
            )
            if done is not None:
                row["exit_code"], row["reason"] = done.exit_code, done.reason
        with self.lock:
            old = self.pods.get(pod.metadata.uid, {})
            self.pods[pod.metadata.uid] = {
                **old,
                **row,
                "deleted": old.get("deleted") or row["deleted"],
            }

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            return {uid: dict(row) for uid, row in self.pods.items()}

    def close(self) -> None:
        self.closed = True
        self.watch.stop()
        self.thread.join(10)


class LogFollower:
    """`kubectl logs -f` of one pod's container until it ends: what its process wrote last."""

    def __init__(self, env: Env, pod: str, container: str) -> None:
        argv = [
            str(env.plane.bin("kubectl")), f"--kubeconfig={env.plane.home.kubeconfig}",
            "-n", env.ns, "logs", "-f", pod, "-c", container,
        ]  # fmt: skip
        self.pod = pod
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
        self.proc.wait()

    def ended(self, timeout: float) -> list[str]:
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.proc.kill()
        return self.lines


def running_ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status", {})
    if st.get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
        return False
    return any(c_["type"] == "Ready" and c_["status"] == "True" for c_ in st.get("conditions", []))


def wait_running(env: Env, timeout: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The synchronizer pod and both learner pods, all Running and Ready."""

    def probe() -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        syncs = [p for p in env.get("pods", "-l", SYNCS)["items"] if running_ready(p)]
        learners = [p for p in env.get("pods", "-l", LEARNERS)["items"] if running_ready(p)]
        return (syncs[0], learners) if len(syncs) == 1 and len(learners) == 2 else None

    return k8senv.wait_until("the synchronizer and 2 learners Running and Ready", probe, timeout)


def sync_status(env: Env, pod: str) -> dict[str, Any]:
    """The synchronizer's GET /v1/status, read inside its pod."""
    out = env.kubectl("exec", pod, "-c", "synchronizer", "--", "python", "-c", STATUS)
    return dict(json.loads(out))


def condition(job: dict[str, Any], type_: str) -> dict[str, Any]:
    conds = (job.get("status") or {}).get("conditions") or []
    return next((c_ for c_ in conds if c_["type"] == type_), {})


def wait_condition(
    env: Env, type_: str, status: str = "True", reason: str | None = None, timeout: float = 60
) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        job = env.job()
        cond = condition(job, type_)
        ok = cond.get("status") == status and (reason is None or cond.get("reason") == reason)
        return job if ok else None

    try:
        return k8senv.wait_until(f"{type_}={status} ({reason})", probe, timeout)
    except TimeoutError as e:
        conds = env.job().get("status", {}).get("conditions")
        raise TimeoutError(f"{e}; conditions {conds}\n{diagnose(env)}") from None


def diagnose(env: Env) -> str:
    """The operator's last log lines (without its probes) and the namespace's events, for a
    failure message."""
    logs = env.kubectl("logs", "-l", "app.kubernetes.io/component=operator", "--tail=400",
                       check=False)  # fmt: skip
    lines = [ln for ln in logs.splitlines() if "/healthz" not in ln][-40:]
    events = env.kubectl("get", "events", "--sort-by=.lastTimestamp", check=False)[-2500:]
    return "\n".join(["operator:", *lines, "events:", events])


def admitted(wl: dict[str, Any]) -> bool:
    conds = (wl.get("status") or {}).get("conditions") or []
    return any(c_["type"] == "Admitted" and c_["status"] == "True" for c_ in conds)


def fragment_tokens(status: dict[str, Any]) -> dict[int, int]:
    """Per fragment, the tokens behind accepted contributions: merged, or durable in its
    open round."""
    return {f["index"]: f["tokens_merged"] + f["tokens_pending"] for f in status["fragments"]}


def test_preempted_by_kueue_learners_exit_0_and_the_job_resumes_from_its_state(env: Env) -> None:
    body = yaml.safe_load((c.REPO / "deploy" / "examples" / "tiny-cpu.yaml").read_text())
    body["metadata"]["name"] = JOB
    body["metadata"]["labels"] = {QUEUE_LABEL: "lq", PRIORITY_LABEL: env.low}
    body["spec"]["image"] = env.image
    body["spec"]["imagePullPolicy"] = "Never"
    body["spec"]["training"]["maxSteps"] = 1_000_000  # runs until the module deletes it
    env.plane.kubectl("home", "-n", env.ns, "apply", "-f", "-", input=yaml.safe_dump(body))

    # queued: the ClusterQueue holds, nothing runs
    queued = wait_condition(env, "Suspended", reason="Queued", timeout=60)
    assert queued["status"]["phase"] == "Suspended"
    assert not env.get("pods", "-l", f"ddiloco.dev/job={JOB}")["items"]
    wl = f"ddiloco-{JOB}"
    assert env.workload(wl)["spec"]["priority"] == 10

    watch = LearnerWatch(env)
    try:
        run_preempt_and_resume(env, watch)
    finally:
        watch.close()


def run_preempt_and_resume(env: Env, watch: LearnerWatch) -> None:
    wl = f"ddiloco-{JOB}"
    # admitted: Kueue lets it run, its learners on the flavor's node label
    t0 = time.monotonic()
    env.plane.kubectl("home", "patch", "clusterqueue", env.cq, "--type=merge",
                      "-p", json.dumps({"spec": {"stopPolicy": "None"}}))  # fmt: skip
    sync, learners = wait_running(env, timeout=240)
    env.figures["admitted_to_pods_ready_s"] = round(time.monotonic() - t0, 1)
    wait_condition(env, "Suspended", status="False", reason="Admitted", timeout=30)
    for p in learners:
        assert p["spec"]["nodeSelector"].get(REAL_NODE_LABEL) == "true", p["spec"]["nodeSelector"]
        assert p["status"]["containerStatuses"][0]["containerID"].startswith("containerd://")
    logs = {p["metadata"]["name"]: LogFollower(env, p["metadata"]["name"], "learner")
            for p in learners}  # fmt: skip

    def merged(at_least: int) -> Any:
        def probe() -> int | None:
            v = env.job().get("status", {}).get("globalVersion") or 0
            return v if v >= at_least else None

        return probe

    k8senv.wait_until("4 merges in the job's status", merged(4), timeout=180)
    env.figures["admitted_to_4_merges_s"] = round(time.monotonic() - t0, 1)
    before = sync_status(env, sync["metadata"]["name"])
    claim_uid = env.get("pvc", f"state-{JOB}-synchronizer-0")["metadata"]["uid"]

    # preempted: a Workload of priority 1000 that needs the whole quota
    t0 = time.monotonic()
    env.api("POST", env.kq("workloads"), {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": "urgent"},
        "spec": {
            "queueName": "lq",
            "priorityClassRef": {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                 "name": env.high},
            "priority": 1000,
            "podSets": [{"name": "main", "count": 1, "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "c", "image": "none", "resources": {"requests": QUOTA}}],
            }}}],
        },
    })  # fmt: skip
    evicted = wait_condition(env, "Suspended", reason="Preempted", timeout=60)
    assert evicted["status"]["phase"] == "Suspended"
    assert "Evicted by Kueue" in condition(evicted, "Suspended")["message"]
    uids = {p["metadata"]["uid"] for p in learners}

    def learners_gone() -> dict[str, dict[str, Any]] | None:
        seen = watch.snapshot()
        return seen if all(seen.get(u, {}).get("deleted") for u in uids) else None

    seen = k8senv.wait_until("both learner pods deleted", learners_gone, timeout=120)
    env.figures["preempted_to_learners_gone_s"] = round(time.monotonic() - t0, 1)
    ended = {seen[u]["name"]: (seen[u].get("exit_code"), seen[u].get("reason")) for u in uids}
    print(f"\nlearner pods as they ended: {ended}")
    assert all(code == 0 for code, _ in ended.values()), ended
    computed = 0  # tokens the learners trained on, all handed over and accepted
    for name, follower in logs.items():
        lines = follower.ended(timeout=30)
        stops = [m for line in lines if (m := STOPPED.search(line))]
        assert stops, f"{name} logged no stop line; its last lines:\n" + "\n".join(lines[-15:])
        print(stops[-1][0])
        assert stops[-1][3] == "0", stops[-1][0]  # every hand-over accepted: none refused or unsent
        computed += int(stops[-1][2])
    k8senv.wait_until("the synchronizer pod gone",
                      lambda: not env.get("pods", "-l", SYNCS)["items"] or None, timeout=60)  # fmt: skip
    k8senv.wait_until("the urgent Workload admitted", lambda: admitted(env.workload("urgent")),
                      timeout=60)  # fmt: skip
    assert not env.workload(wl)["status"].get("admission")
    assert env.get("pvc", f"state-{JOB}-synchronizer-0")["metadata"]["uid"] == claim_uid

    # readmitted: the urgent Workload is gone; the job comes back from the synchronizer's state
    t0 = time.monotonic()
    env.api("DELETE", env.kq("workloads", "urgent"))
    sync = k8senv.wait_until(
        "the synchronizer Ready",
        lambda: next((p for p in env.get("pods", "-l", SYNCS)["items"] if running_ready(p)), None),
        timeout=180,
    )
    # read at once, before the new learners hand much over (nothing below depends on that)
    after = sync_status(env, sync["metadata"]["name"])
    print(f"\nglobal version {before['global_version']} before the preemption, "
          f"{after['global_version']} at the readmission; tokens per fragment "
          f"{fragment_tokens(before)} -> {fragment_tokens(after)}; the learners computed "
          f"{computed}")  # fmt: skip
    assert before["global_version"] >= 4
    assert after["global_version"] >= before["global_version"]
    # every fragment holds every token the learners handed over (each fragment sees them all)
    assert all(t >= computed > 0 for t in fragment_tokens(after).values()), (computed, after)
    _, learners = wait_running(env, timeout=240)
    env.figures["readmitted_to_pods_ready_s"] = round(time.monotonic() - t0, 1)
    assert uids.isdisjoint(p["metadata"]["uid"] for p in learners)
    back = wait_condition(env, "Ready", timeout=60)
    assert back["status"]["readyLearners"] == 2
    assert condition(back, "Suspended")["status"] == "False"
    k8senv.wait_until(
        "merges after the readmission", merged(after["global_version"] + 2), timeout=180
    )
    env.figures["readmitted_to_2_more_merges_s"] = round(time.monotonic() - t0, 1)
    # a preemption is not a learner failure: nothing was replaced
    assert all(g["replaced"] == 0 for g in env.job()["status"]["groups"])
