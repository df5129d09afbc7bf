"""Jobs in real pods: the chart and a DecoupledDiLoCoJob on the real node (realnode.py), with the
image built from our Dockerfile (image.py). Nothing here is played by kwok: the operator, the
synchronizer and the learners are containers that containerd started with runc.

    python tests/integration/k8senv.py build      # kubelet, containerd, CoreDNS, ... (once)
    python tests/integration/image.py build       # the image (once per project change)
    .venv/bin/pytest tests/integration/test_realnode_jobs.py -s

The tests run in file order and share one job (module scope): install the chart (operator
Running and Ready, `helm test`), run deploy/examples/tiny-cpu.yaml, evict a learner with the
Eviction API, delete the synchronizer pod, leave a pod as a preempted node would (Failed,
reason Evicted, a DisruptionTarget condition), turn on a hot spare and evict again (the
spare takes the slot), then delete the job; last, a short job runs to the end (Succeeded) and
its trained model is exported in its synchronizer pod and copied out with `kubectl cp`, as
operator/README.md tells users to; then a job with synchronizer.shards 2 trains on two real
synchronizer pods (a StatefulSet, a claim each). Measured times are printed
(`-s`), never asserted; the timeouts are only there so that a broken run ends.
"""

from __future__ import annotations

import calendar
import contextlib
import ipaddress
import json
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import chart_helpers as c
import k8senv
import pytest
import realnode_image
import yaml
from safetensors import safe_open

# the module fixture saves and imports a 5 GB image (minutes); each test waits on real pods
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

JOB = "tiny-cpu"
SYNC_POD_LABEL = "app.kubernetes.io/component=synchronizer"
LEARNER_LABEL = "app.kubernetes.io/component=learner"

# Polls the synchronizer's own /v1/status from inside its pod (its token file is mounted there)
# and prints one JSON line per poll: the host clock (containers share the kernel's) and the
# learners' incarnations and accepted contributions. One exec for a whole measurement.
POLLER = """
import json, os, ssl, sys, time, urllib.request
token = open(os.environ["DDILOCO_TOKEN_FILE"]).read().split()[0]
ctx, scheme = None, "http"
if cert := os.environ.get("DDILOCO_TLS_CERT_FILE"):  # the job's CA signed it; not for 127.0.0.1
    ctx, scheme = ssl.create_default_context(cafile=os.path.dirname(cert) + "/ca.crt"), "https"
    ctx.check_hostname = False
end = time.time() + float(sys.argv[1])
while time.time() < end:
    try:
        req = urllib.request.Request(f"{scheme}://127.0.0.1:8470/v1/status",
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=2, context=ctx) as r:
            s = json.load(r)
        print(json.dumps({"t": time.time(), "version": s["global_version"],
                          "learners": {l["learner_id"]: [l["incarnation"], l["contributions"]]
                                       for l in s["learners"]}}), flush=True)
    except OSError as e:
        print(json.dumps({"t": time.time(), "error": str(e)}), flush=True)
    time.sleep(0.2)
"""


@dataclass
class Run:
    """What the tests share: the plane, the namespace, the release and measured figures."""

    plane: Any
    ns: str
    release: str
    image: str
    figures: dict[str, float] = field(default_factory=dict)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60.0) -> str:
        return self.plane.kubectl("home", "-n", self.ns, *args, check=check, timeout=timeout).stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def pods(self, selector: str) -> list[dict[str, Any]]:
        return self.get("pods", "-l", f"ddiloco.dev/job={JOB},{selector}")["items"]

    def job(self) -> dict[str, Any]:
        return self.get("ddj", JOB)

    def api(self, method: str, path: str, body: Any = None) -> Any:
        return self.plane.home.api(method, path, body)


def running_ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status", {})
    if st.get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
        return False
    conds = {c_["type"]: c_["status"] for c_ in st.get("conditions", [])}
    return conds.get("Ready") == "True"


def real_container(pod: dict[str, Any]) -> str:
    """The container ID the kubelet reports: containerd's, so a real runtime ran it."""
    statuses = pod["status"].get("containerStatuses", [])
    assert statuses, pod["status"]
    cid = statuses[0].get("containerID", "")
    assert cid.startswith("containerd://"), statuses
    return cid


@pytest.fixture(scope="module")
def run(real_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    t0 = time.monotonic()
    tag = realnode_image.on_node(real_plane, tmp_path_factory)
    ns = f"t-realnode-{uuid.uuid4().hex[:6]}"
    real_plane.create_namespace(ns)
    print(f"image ready on the node after {time.monotonic() - t0:.1f}s")
    r = Run(real_plane, ns, f"dd-{uuid.uuid4().hex[:5]}", tag)
    try:
        yield r
    finally:
        if r.figures:  # also kept beside pytest's temporary files, for a run without -s
            print("\nreal-node figures: " + json.dumps(r.figures, indent=1))
            out = tmp_path_factory.getbasetemp() / "realnode-figures.json"
            out.write_text(json.dumps(r.figures, indent=1))
        with contextlib.suppress(subprocess.SubprocessError):
            r.kubectl("delete", "ddj", "--all", "--wait=true", "--timeout=90s", check=False)
        helm = k8senv_helm(real_plane)
        subprocess.run(
            [helm, "uninstall", r.release, "-n", ns, "--wait", "--timeout", "60s",
             "--kubeconfig", str(real_plane.home.kubeconfig)],
            capture_output=True, timeout=120, check=False,
        )  # fmt: skip
        real_plane.kubectl("home", "delete", "namespace", ns, "--wait=false", check=False)


def k8senv_helm(plane: Any) -> str:
    return str(plane.bin("helm"))


def helm(r: Run, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    argv = [k8senv_helm(r.plane), *args, "--kubeconfig", str(r.plane.home.kubeconfig)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def sync_pod(r: Run) -> dict[str, Any]:
    pods = [p for p in r.pods(SYNC_POD_LABEL) if not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return pods[0]


def learner_pods(r: Run) -> dict[str, dict[str, Any]]:
    """Learner id -> its live (not terminating, not failed) pod."""
    out: dict[str, dict[str, Any]] = {}
    for p in r.pods(LEARNER_LABEL):
        if p["metadata"].get("deletionTimestamp") or p["status"].get("phase") in (
            "Failed",
            "Succeeded",
        ):
            continue
        if "ddiloco.dev/learner-id" not in p["metadata"]["labels"]:
            continue  # a hot spare, holding no slot yet
        out[p["metadata"]["labels"]["ddiloco.dev/learner-id"]] = p
    return out


def wait_job_running(r: Run, timeout: float = 240) -> dict[str, dict[str, Any]]:
    def probe() -> dict[str, dict[str, Any]] | None:
        pods = learner_pods(r)
        syncs = [p for p in r.pods(SYNC_POD_LABEL) if running_ready(p)]
        if len(syncs) == 1 and len(pods) == 2 and all(running_ready(p) for p in pods.values()):
            return pods
        return None

    return k8senv.wait_until(
        "the synchronizer and 2 learner pods Running and Ready", probe, timeout
    )


class Poller:
    """A status poller running inside the synchronizer pod (one `kubectl exec`; started again
    in the current synchronizer pod should that container end, e.g. when its pod is replaced)."""

    def __init__(self, r: Run, seconds: float) -> None:
        self.run, self.end = r, time.monotonic() + seconds
        self.proc: subprocess.Popen[str] | None = None
        self.samples: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.closed = False
        self.cv = threading.Condition()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while not self.closed and (left := self.end - time.monotonic()) > 1:
            try:
                pod = sync_pod(self.run)["metadata"]["name"]
            except (AssertionError, subprocess.SubprocessError) as e:
                self.errors.append(repr(e))
                time.sleep(1)
                continue
            argv = [
                str(self.run.plane.bin("kubectl")), f"--kubeconfig={self.run.plane.home.kubeconfig}",
                "-n", self.run.ns, "exec", pod, "--", "python", "-u", "-c", POLLER, str(left),
            ]  # fmt: skip
            self.proc = proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            assert proc.stdout is not None and proc.stderr is not None
            for line in proc.stdout:
                with contextlib.suppress(ValueError), self.cv:
                    self.samples.append(json.loads(line))
                    self.cv.notify_all()
            proc.wait()
            self.errors.append(
                f"exec in {pod} ended ({proc.returncode}): {proc.stderr.read()[-300:]}"
            )
            time.sleep(1)

    def wait(self, what: str, pred: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        seen = 0
        with self.cv:
            while True:
                for s in self.samples[seen:]:
                    if "learners" in s and pred(s):
                        return s
                seen = len(self.samples)
                left = deadline - time.monotonic()
                if left <= 0:
                    last = self.samples[-3:]
                    raise TimeoutError(
                        f"{what}: not within {timeout}s; last {last}; poller: {self.errors[-3:]}"
                    )
                self.cv.wait(min(left, 1.0))

    def close(self) -> None:
        self.closed = True
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------------------------
def test_helm_install_operator_runs_in_a_real_container(run: Run) -> None:
    repo, tag = run.image.rsplit(":", 1)
    t0 = time.monotonic()
    helm(
        run, "install", run.release, str(c.CHART), "-n", run.ns,
        "--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
        "--set", "image.pullPolicy=Never", "--set", f"operator.watchNamespaces={{{run.ns}}}",
        "--wait", "--timeout", "240s",
    )  # fmt: skip
    run.figures["helm_install_wait_s"] = round(time.monotonic() - t0, 1)
    pods = run.get("pods", "-l", "app.kubernetes.io/component=operator")["items"]
    assert len(pods) == 1 and running_ready(pods[0]), [p["status"] for p in pods]
    real_container(pods[0])
    assert pods[0]["spec"]["nodeName"] == run.plane.real_node.name
    t0 = time.monotonic()
    out = helm(run, "test", run.release, "-n", run.ns, "--timeout", "180s").stdout
    run.figures["helm_test_s"] = round(time.monotonic() - t0, 1)
    assert "Phase:          Succeeded" in out or "Succeeded" in out, out


def test_tiny_cpu_example_trains_in_real_pods(run: Run) -> None:
    body = yaml.safe_load((c.REPO / "deploy" / "examples" / "tiny-cpu.yaml").read_text())
    body["spec"]["image"] = run.image
    body["spec"]["imagePullPolicy"] = "Never"
    body["spec"]["training"]["maxSteps"] = 1_000_000  # runs until the last test deletes it
    t0 = time.monotonic()
    run.plane.kubectl("home", "-n", run.ns, "apply", "-f", "-", input=yaml.safe_dump(body))
    pods = wait_job_running(run)
    run.figures["apply_to_pods_ready_s"] = round(time.monotonic() - t0, 1)
    for p in [*pods.values(), sync_pod(run)]:
        real_container(p)
    # the learners name the synchronizer by its Service's DNS name, never by an IP
    for p in pods.values():
        env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}
        host = urlsplit(env["DDILOCO_SYNC_URL"]).hostname or ""
        assert host == f"{JOB}-synchronizer.{run.ns}.svc", env["DDILOCO_SYNC_URL"]
        with pytest.raises(ValueError):
            ipaddress.ip_address(host)

    def merged() -> int | None:
        v = run.job().get("status", {}).get("globalVersion") or 0
        return v if v >= 4 else None

    v1 = k8senv.wait_until("merges in the job's status", merged, timeout=180)
    run.figures["apply_to_4_merges_s"] = round(time.monotonic() - t0, 1)
    v2 = k8senv.wait_until("merges advancing", lambda: (merged() or 0) > v1 or None, timeout=120)
    table = run.kubectl("get", "ddj", JOB)
    print(f"\n{table}")
    assert str(v2) in table or "Running" in table, table
    # `ddiloco status --job` reads the synchronizer's own status through the Kubernetes API
    # (the job's token from its Secret, a port-forward to the real pod, TLS verified against
    # the job's CA): no fallback note, the job's learners and at least the version seen above
    got = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli.main", "status", "--job", JOB, "-n", run.ns,
         "--kubeconfig", str(run.plane.home.kubeconfig), "--json"],
        capture_output=True, text=True, timeout=90, env=run.plane.env(),
    )  # fmt: skip
    assert got.returncode == 0 and not got.stderr.strip(), got.stderr
    st = json.loads(got.stdout)
    assert st["global_version"] >= v2, st["global_version"]
    assert {lr["learner_id"] for lr in st["learners"]} >= set(learner_pods(run)), st["learners"]
    once = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli.main", "status", "--job", JOB, "-n", run.ns,
         "--kubeconfig", str(run.plane.home.kubeconfig), "--once"],
        capture_output=True, text=True, timeout=90, env=run.plane.env(),
    )  # fmt: skip
    assert once.returncode == 0, once.stderr
    assert all(lid in once.stdout for lid in learner_pods(run)), once.stdout
    # both learners reached the synchronizer (through that name): their work was accepted
    poller = Poller(run, 60)
    try:
        poller.wait(
            "both learners' updates accepted",
            lambda s: all(s["learners"].get(lid, [0, 0])[1] > 0 for lid in pods),
            timeout=60,
        )
    finally:
        poller.close()


def _replace_and_rejoin(run: Run, victim_lid: str, disrupt: Any, figure: str) -> float:
    """Disrupt one learner's pod; the operator replaces it, the replacement rejoins (a new
    incarnation) and its updates are accepted; the other learner keeps its pod (same uid)."""
    before = learner_pods(run)
    victim = before[victim_lid]
    others = {lid: p["metadata"]["uid"] for lid, p in before.items() if lid != victim_lid}
    poller = Poller(run, 300)
    try:
        s0 = poller.wait("a status sample", lambda s: victim_lid in s["learners"], timeout=30)
        inc0 = s0["learners"][victim_lid][0]
        t0 = time.time()
        disrupt(victim)

        def gone() -> bool:
            """The old pod's process has ended: the pod is gone, or its container stopped."""
            for p in run.pods(LEARNER_LABEL):
                if p["metadata"]["uid"] == victim["metadata"]["uid"]:
                    statuses = p["status"].get("containerStatuses", [])
                    return bool(statuses) and "terminated" in statuses[0].get("state", {})
            return True

        try:
            k8senv.wait_until(f"{victim['metadata']['name']} gone", gone, timeout=120)
        except TimeoutError as e:  # what the pod and the operator were doing meanwhile
            raise TimeoutError(f"{e}\n{diagnose(run, victim['metadata']['name'])}") from None
        s_gone = poller.wait("a sample after the old pod went", lambda s: s["t"] > time.time() - 1,
                             timeout=30)  # fmt: skip
        c_gone = s_gone["learners"][victim_lid][1]
        first = poller.wait(
            "the replacement's first accepted update",
            lambda s: s["learners"][victim_lid][0] > inc0 and s["learners"][victim_lid][1] > c_gone,
            timeout=240,
        )
        run.figures[figure] = round(first["t"] - t0, 1)
        print(f"\n{figure}: {first['t'] - t0:.1f}s (poll resolution 0.2s)")
    finally:
        poller.close()
    after = wait_job_running(run)
    assert after[victim_lid]["metadata"]["uid"] != victim["metadata"]["uid"]
    real_container(after[victim_lid])
    for lid, uid in others.items():
        assert after[lid]["metadata"]["uid"] == uid, f"{lid} was restarted"
    v = run.job()["status"].get("globalVersion", 0)
    k8senv.wait_until(
        "merges continue",
        lambda: run.job()["status"].get("globalVersion", 0) > v or None,
        timeout=120,
    )
    return t0


def diagnose(run: Run, pod: str) -> str:
    """The pod's state in one line, the events and the operator's last log lines (without
    its liveness probes), for a failure message; the short parts first, so a truncated
    report keeps them."""
    summary = run.kubectl(
        "get", "pod", pod, "--ignore-not-found", "-o",
        "jsonpath=phase={.status.phase} reason={.status.reason} "
        "deletionTimestamp={.metadata.deletionTimestamp} state={.status.containerStatuses[0].state}",
        check=False,
    )  # fmt: skip
    logs = run.kubectl("logs", "-l", "app.kubernetes.io/component=operator", "--tail=1000",
                       check=False)  # fmt: skip
    lines = [ln for ln in logs.splitlines() if "/healthz" not in ln][-40:]
    events = run.kubectl("get", "events", "--sort-by=.lastTimestamp", check=False)[-2500:]
    return "\n".join([f"pod {pod}: {summary}", "operator:", *lines, "events:", events])


def test_evicted_learner_is_replaced_and_rejoins(run: Run) -> None:
    lid = sorted(learner_pods(run))[0]
    _replace_and_rejoin(
        run, lid, lambda pod: evict(run, pod), "eviction_to_first_accepted_update_s"
    )


def test_synchronizer_pod_deleted_comes_back_on_its_volume(run: Run) -> None:
    old = sync_pod(run)
    learners = {lid: p["metadata"]["uid"] for lid, p in learner_pods(run).items()}
    poller = Poller(run, 30)
    try:
        s = poller.wait("versions", lambda s: True, timeout=30)
    finally:
        poller.close()
    v_before = s["version"]
    claim = [v for v in old["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert claim, old["spec"]["volumes"]
    t0 = time.monotonic()
    run.kubectl("delete", "pod", old["metadata"]["name"], "--wait=false")

    def back() -> dict[str, Any] | None:
        pods = [p for p in run.pods(SYNC_POD_LABEL) if running_ready(p)]
        return pods[0] if pods and pods[0]["metadata"]["uid"] != old["metadata"]["uid"] else None

    new = k8senv.wait_until("a new synchronizer pod Ready", back, timeout=180)
    run.figures["synchronizer_delete_to_ready_s"] = round(time.monotonic() - t0, 1)
    assert [v for v in new["spec"]["volumes"] if "persistentVolumeClaim" in v] == claim
    poller = Poller(run, 120)
    try:
        # it resumed from the volume: versions continue from where they were, and grow
        s = poller.wait("versions after the restart", lambda s: True, timeout=30)
        assert s["version"] >= v_before, (s["version"], v_before)
        poller.wait("merges after the restart", lambda s: s["version"] > v_before, timeout=120)
    finally:
        poller.close()
    # the learners carried on: same pods, never restarted
    now = learner_pods(run)
    for lid, uid in learners.items():
        assert now[lid]["metadata"]["uid"] == uid
        assert now[lid]["status"]["containerStatuses"][0]["restartCount"] == 0


def test_pod_left_as_by_a_preempted_node_is_replaced(run: Run) -> None:
    rewrites: list[float] = []

    def write_failed(name: str) -> None:
        # what the kubelet of a node under pressure (or a spot node's shutdown) writes
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        obj = run.get("pod", name)
        msg = "The node was low on resource: memory."
        conditions = [
            c_ for c_ in obj["status"].get("conditions", []) if c_["type"] != "DisruptionTarget"
        ]
        conditions.append(
            {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
             "message": msg, "lastTransitionTime": now}
        )  # fmt: skip
        obj["status"].update(phase="Failed", reason="Evicted", message=msg, conditions=conditions)
        run.api("PUT", f"/api/v1/namespaces/{run.ns}/pods/{name}/status", obj)

    def keep_failed(name: str, uid: str) -> None:
        # A real kubelet that fails a pod has stopped its containers and keeps the phase. The
        # kubelet here still runs the container and may write its cached Running status over
        # ours before the operator has seen it: write it again until the operator acts (the
        # pod is deleted), so what this tests is the operator, not that race.
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            obj = json.loads(run.kubectl("get", "pod", name, "--ignore-not-found", "-o", "json",
                                         check=False) or "{}")  # fmt: skip
            meta = obj.get("metadata", {})
            if meta.get("uid") != uid or meta.get("deletionTimestamp"):
                return
            if obj["status"].get("phase") != "Failed":
                rewrites.append(time.monotonic())
                with contextlib.suppress(Exception):  # a write conflict: the next round
                    write_failed(name)
            time.sleep(0.5)

    def preempted(pod: dict[str, Any]) -> None:
        write_failed(pod["metadata"]["name"])
        threading.Thread(
            target=keep_failed, args=(pod["metadata"]["name"], pod["metadata"]["uid"]), daemon=True
        ).start()

    lid = sorted(learner_pods(run))[-1]
    _replace_and_rejoin(run, lid, preempted, "preempted_to_first_accepted_update_s")
    print(f"the Failed status was written again {len(rewrites)} times (reverted by the kubelet)")


def evict(run: Run, pod: dict[str, Any]) -> None:
    name = pod["metadata"]["name"]
    run.api(
        "POST",
        f"/api/v1/namespaces/{run.ns}/pods/{name}/eviction",
        {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": run.ns},
        },
    )


def spares(run: Run) -> list[dict[str, Any]]:
    return [
        p
        for p in run.pods("ddiloco.dev/role=spare")
        if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") == "Running"
    ]


def test_hot_spare_takes_over_an_evicted_slot(run: Run) -> None:
    """failurePolicy.hotSpares: 1 on the running job: a spare pod warms up (Ready once its
    learner process has imported torch and built the model), an eviction promotes it to the
    evicted slot (same pod, now labelled with the slot), and a new spare follows. The time from
    the eviction to the slot's first accepted update is printed beside the cold replacement's
    (test_evicted_learner_is_replaced_and_rejoins) of the same run."""
    run.kubectl(
        "patch",
        "ddj",
        JOB,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"failurePolicy": {"hotSpares": 1}}}),
    )
    t0 = time.monotonic()
    spare = k8senv.wait_until(
        "a Ready hot spare",
        lambda: next((p for p in spares(run) if running_ready(p)), None),
        timeout=180,
    )
    run.figures["hot_spare_ready_s"] = round(time.monotonic() - t0, 1)
    real_container(spare)
    lid = sorted(learner_pods(run))[0]
    t0 = _replace_and_rejoin(
        run, lid, lambda pod: evict(run, pod), "eviction_with_hot_spare_to_first_accepted_update_s"
    )
    now = learner_pods(run)[lid]
    assert now["metadata"]["uid"] == spare["metadata"]["uid"], "the slot was not given to the spare"
    # the operator's share of that time (its annotation has 1 s resolution)
    stamp = now["metadata"]["annotations"]["ddiloco.dev/promoted-at"]
    promoted = calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))
    run.figures["eviction_to_spare_promoted_s"] = round(promoted - t0, 1)
    k8senv.wait_until(
        "a new spare",
        lambda: any(p["metadata"]["uid"] != spare["metadata"]["uid"] for p in spares(run)) or None,
        timeout=180,
    )
    cold = run.figures.get("eviction_to_first_accepted_update_s")
    print(f"\neviction to first accepted update: cold {cold}s, hot spare "
          f"{run.figures['eviction_with_hot_spare_to_first_accepted_update_s']}s")  # fmt: skip


def test_deleting_the_job_removes_everything_it_made(run: Run) -> None:
    uid = run.job()["metadata"]["uid"]
    run.kubectl("delete", "ddj", JOB, "--wait=true", "--timeout=120s", timeout=150)
    kinds = (
        "pods,services,secrets,configmaps,persistentvolumeclaims,serviceaccounts,roles,rolebindings,"
        "statefulsets"
    )

    def left() -> list[str]:
        items = run.get(kinds)["items"]
        return [
            f"{i['kind']}/{i['metadata']['name']}"
            for i in items
            if i["metadata"].get("labels", {}).get("ddiloco.dev/job-uid") == uid
            or any(o.get("uid") == uid for o in i["metadata"].get("ownerReferences", []))
        ]

    k8senv.wait_until("every object of the job gone", lambda: not left() or None, timeout=120)


FINISHED = "tiny-done"


def test_a_finished_job_keeps_its_synchronizer_and_the_model_comes_out(
    run: Run, tmp_path: Path
) -> None:
    """A job whose learners all finished (phase Succeeded) keeps its synchronizer pod and its
    state volume, so the trained model can be exported from it as operator/README.md says:
    `ddiloco export` inside the synchronizer pod, then `kubectl cp` out of it. The export is
    loaded with safetensors and checked against the layout in the state directory."""
    body = yaml.safe_load((c.REPO / "deploy" / "examples" / "tiny-cpu.yaml").read_text())
    body["metadata"]["name"] = FINISHED
    body["spec"]["image"] = run.image
    body["spec"]["imagePullPolicy"] = "Never"
    body["spec"]["training"]["maxSteps"] = 48  # 2H: every fragment merged twice, then exit 0
    body["spec"]["learnerGroups"][0]["replicas"] = 1
    t0 = time.monotonic()
    run.plane.kubectl("home", "-n", run.ns, "apply", "-f", "-", input=yaml.safe_dump(body))

    def succeeded() -> dict[str, Any] | None:
        job = run.get("ddj", FINISHED)
        return job if job.get("status", {}).get("phase") == "Succeeded" else None

    job = k8senv.wait_until("the job Succeeded", succeeded, timeout=360)
    run.figures["finished_job_apply_to_succeeded_s"] = round(time.monotonic() - t0, 1)
    # the job's status reads the synchronizer's every status_poll_seconds (10 s): a job that
    # trains its 48 steps in ~20 s can turn Succeeded before the read that sees its merges
    job = k8senv.wait_until(
        "the finished job's status to show its merges",
        lambda: (j := run.get("ddj", FINISHED))["status"].get("globalVersion") and j,
        timeout=40,
    )
    assert job["status"]["phase"] == "Succeeded", job["status"]
    selector = f"ddiloco.dev/job={FINISHED}"
    (learner,) = run.get("pods", "-l", f"{selector},{LEARNER_LABEL}")["items"]
    assert learner["status"]["phase"] == "Succeeded"
    # the synchronizer is still there, Ready, on its claim: nothing tore it down
    syncs = [
        p
        for p in run.get("pods", "-l", f"{selector},{SYNC_POD_LABEL}")["items"]
        if running_ready(p)
    ]
    assert len(syncs) == 1, [p["status"] for p in syncs]
    pod = syncs[0]["metadata"]["name"]
    claim = run.get("pvc", f"state-{FINISHED}-synchronizer-0")  # the StatefulSet's, shard 0
    assert claim["status"]["phase"] == "Bound"

    # what a user runs (operator/README.md, "Getting the trained model out")
    t0 = time.monotonic()
    done = run.plane.kubectl(
        "home", "-n", run.ns, "exec", pod, "-c", "synchronizer", "--",
        "ddiloco", "export", "--state-dir", "/var/lib/ddiloco", "--out", "/tmp/export",
        check=False, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, f"ddiloco export:\n{done.stdout}\n{done.stderr}"
    run.figures["export_in_pod_s"] = round(time.monotonic() - t0, 1)
    local = tmp_path / "export"  # the whole directory, as the README copies it
    run.kubectl(
        "cp", "-c", "synchronizer", f"{run.ns}/{pod}:/tmp/export", str(local), timeout=120,
    )  # fmt: skip
    info = json.loads((local / "ddiloco_export.json").read_text())
    assert info["model"] == "tiny" and min(info["versions"]) >= 1, info  # every fragment merged
    saved = json.loads(run.kubectl("exec", pod, "-c", "synchronizer", "--", "cat",
                                   "/var/lib/ddiloco/layout.json"))  # fmt: skip
    assert saved["format"] == 1, saved  # the state dir's format version (docs/storage.md)
    layout = saved["layout"]

    with safe_open(str(local / "model.safetensors"), framework="pt") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    want = {t["name"]: t["shape"] for frag in layout["fragments"] for t in frag["tensors"]}
    assert shapes == want
    print(f"\nexported {len(shapes)} tensors from the finished job's synchronizer pod "
          f"in {run.figures['export_in_pod_s']}s")  # fmt: skip

    # deleting the job deletes the claim too: export first (the README says so)
    run.kubectl("delete", "ddj", FINISHED, "--wait=true", "--timeout=120s", timeout=150)
    k8senv.wait_until(
        "the state claim deleted with the job",
        lambda: run.kubectl("get", "pvc", "-o", "name", check=False).find(FINISHED) < 0 or None,
        timeout=120,
    )


SHARDED = "tiny-shards"


def test_a_sharded_job_trains_on_two_synchronizer_pods(run: Run) -> None:
    """synchronizer.shards 2: a StatefulSet of two real synchronizer pods, one
    claim each; the learner reaches both through the headless Service's names (TLS verified
    under each), the job's status and `ddiloco status --job` merge both shards, and deleting
    the job deletes both claims."""
    body = yaml.safe_load((c.REPO / "deploy" / "examples" / "tiny-cpu.yaml").read_text())
    body["metadata"]["name"] = SHARDED
    body["spec"]["image"] = run.image
    body["spec"]["imagePullPolicy"] = "Never"
    body["spec"]["training"]["maxSteps"] = 48  # 2H: every fragment merged twice, then exit 0
    body["spec"]["synchronizer"]["shards"] = 2
    body["spec"]["learnerGroups"][0]["replicas"] = 1
    t0 = time.monotonic()
    run.plane.kubectl("home", "-n", run.ns, "apply", "-f", "-", input=yaml.safe_dump(body))
    selector = f"ddiloco.dev/job={SHARDED}"

    def both_ready() -> list[dict[str, Any]] | None:
        pods = [
            p
            for p in run.get("pods", "-l", f"{selector},{SYNC_POD_LABEL}")["items"]
            if running_ready(p)
        ]
        return pods if len(pods) == 2 else None

    syncs = k8senv.wait_until("both synchronizer shards Ready", both_ready, timeout=300)
    run.figures["sharded_apply_to_shards_ready_s"] = round(time.monotonic() - t0, 1)
    assert sorted(p["metadata"]["name"] for p in syncs) == [
        f"{SHARDED}-synchronizer-0",
        f"{SHARDED}-synchronizer-1",
    ]
    for p in syncs:
        real_container(p)

    def merged() -> dict[str, Any] | None:
        job = run.get("ddj", SHARDED)
        return job if (job.get("status", {}).get("globalVersion") or 0) >= 4 else None

    job = k8senv.wait_until("merges on both shards in the job's status", merged, timeout=360)
    run.figures["sharded_apply_to_4_merges_s"] = round(time.monotonic() - t0, 1)
    assert job["status"]["synchronizer"]["availableShards"] == 2, job["status"]
    for i in range(2):
        claim = run.get("pvc", f"state-{SHARDED}-synchronizer-{i}")
        assert claim["status"]["phase"] == "Bound"
    got = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli.main", "status", "--job", SHARDED, "-n", run.ns,
         "--kubeconfig", str(run.plane.home.kubeconfig), "--json"],
        capture_output=True, text=True, timeout=90, env=run.plane.env(),
    )  # fmt: skip
    assert got.returncode == 0 and not got.stderr.strip(), got.stderr
    st = json.loads(got.stdout)
    assert st["shards"] == 2 and {f["shard"] for f in st["fragments"]} == {0, 1}, st
    print(f"\nsharded job: 2 shards Ready in {run.figures['sharded_apply_to_shards_ready_s']}s, "
          f"4 merges in {run.figures['sharded_apply_to_4_merges_s']}s")  # fmt: skip

    run.kubectl("delete", "ddj", SHARDED, "--wait=true", "--timeout=120s", timeout=150)
    k8senv.wait_until(
        "both state claims deleted with the job",
        lambda: run.kubectl("get", "pvc", "-o", "name", check=False).find(SHARDED) < 0 or None,
        timeout=120,
    )


# ---- your model on your data: a fine-tune from a claim, to its budget, and resumed ----------
TUNE = "tune"
TUNE_SEQ, TUNE_BATCH, TUNE_EVAL_BATCHES = 64, 4, 4
EVALUATED = re.compile(r"Evaluated global version (\d+): loss ([\d.]+)")
STARTED = re.compile(r"Evaluated the starting model \(([^)]*)\): loss ([\d.]+)")


def pretrained_and_corpus(root: Path) -> tuple[Path, Path]:
    """A user's model directory and corpus: a tiny Llama trained a little on the corpus's
    training documents (its weights are not any seed's init), saved with `save_pretrained`
    beside its tokenizer, and a Parquet dataset of the standard library's sources."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from ddiloco.learner import corpus as corpus_rules
    from ddiloco.learner import hf
    from ddiloco.learner.data import stdlib_files

    docs = [
        d
        for source in stdlib_files()[:60]
        for d in source.read_text(errors="replace").split("\n\n\n")
        if d.strip()
    ]
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    pq.write_table(pa.table({"text": docs}), corpus / "part-0.parquet")
    shipped = hf.SHIPPED["llama-tiny"]
    tok = AutoTokenizer.from_pretrained(str(shipped))
    # trained on training documents only: every 20th is held out (learner/corpus.py), and a
    # model that saw them would start with an eval loss no fine-tune could match
    train = [d for k, d in enumerate(docs[:400]) if k % corpus_rules.EVAL_EVERY]
    ids = torch.tensor([t for d in train for t in tok(d)["input_ids"]], dtype=torch.long)
    torch.manual_seed(5)
    net = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(str(shipped)))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        starts = torch.randint(0, len(ids) - TUNE_SEQ - 1, (8,), generator=g)
        w = torch.stack([ids[s : s + TUNE_SEQ + 1] for s in starts])
        hf.causal_lm_loss(net, w[:, :-1].contiguous(), w[:, 1:].contiguous()).backward()
        opt.step()
        opt.zero_grad()
    model = root / "model"
    net.save_pretrained(str(model), safe_serialization=True)
    tok.save_pretrained(str(model))
    return model, corpus


def held_out_loss(model_dir: Path, corpus: Path) -> float:
    """The held-out loss `ddiloco evaluate` measures, of a model directory, here."""
    from ddiloco.learner.task import build_task

    task = build_task(
        preset=f"hf:{model_dir}", data=str(corpus), tokenizer=str(model_dir),
        batch_size=TUNE_BATCH, seq_len=TUNE_SEQ, eval_only=True,
    )  # fmt: skip
    return float(task.eval_loss(task.model, batches=TUNE_EVAL_BATCHES))


def user_claim(r: Run, name: str, path: Path) -> None:
    """A claim of the user's, on a volume of theirs (a host directory of the real node): not
    the job's, so deleting a job leaves it and what is on it."""
    pv = f"{r.ns}-{name}"[:63]
    r.api("POST", "/api/v1/persistentvolumes", {
        "metadata": {"name": pv},
        "spec": {
            "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
            "hostPath": {"path": str(path)}, "claimRef": {"namespace": r.ns, "name": name},
        },
    })  # fmt: skip
    r.api("POST", f"/api/v1/namespaces/{r.ns}/persistentvolumeclaims", {
        "metadata": {"name": name},
        "spec": {
            "accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": pv,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    })  # fmt: skip


def tune_job(r: Run, name: str, total_tokens: int, init_from: str | None) -> dict[str, Any]:
    # the user's claims: the model and corpus, and the checkpoints (a new job starts from one,
    # so every pod that builds the model mounts them)
    data = {
        "volumes": [
            {"name": "data", "persistentVolumeClaim": {"claimName": "tune-data"}},
            {"name": "ckpt", "persistentVolumeClaim": {"claimName": "tune-checkpoints"}},
        ],
        "volumeMounts": [
            {"name": "data", "mountPath": "/data", "readOnly": True},
            {"name": "ckpt", "mountPath": "/checkpoints", "readOnly": True},
        ],
    }
    training: dict[str, Any] = {
        "model": "hf:/data/model", "data": "/data/corpus", "tokenizer": "/data/model",
        "sequenceLength": TUNE_SEQ, "batchSize": TUNE_BATCH, "innerSteps": 16, "fragments": 2,
        "overlapSteps": 1, "innerOptimizer": {"learningRate": 3e-3},
        "schedule": {"warmupSteps": 5, "decay": "cosine", "minRatio": 0.1},
        "totalTokens": total_tokens,
    }  # fmt: skip
    if init_from is not None:
        training["initFrom"] = init_from
    return {
        "apiVersion": "ddiloco.dev/v1alpha1",
        "kind": "DecoupledDiLoCoJob",
        "metadata": {"name": name},
        "spec": {
            "image": r.image, "imagePullPolicy": "Never", "training": training,
            "synchronizer": {
                "quorum": 1, "storage": {"size": "1Gi"},
                "volumes": [{"name": "ckpt",
                             "persistentVolumeClaim": {"claimName": "tune-checkpoints"}}],
                "volumeMounts": [{"name": "ckpt", "mountPath": "/checkpoints"}],
            },
            "checkpoints": {"path": f"/checkpoints/{name}", "everyVersions": 4, "keep": 2},
            "evaluation": {"everyVersions": 2, "evalBatches": TUNE_EVAL_BATCHES, **data},
            "learnerGroups": [
                {"name": "a", "replicas": 1, **data},
                {"name": "b", "replicas": 1, **data},
            ],
        },
    }  # fmt: skip


def run_to_succeeded(r: Run, body: dict[str, Any], timeout: float = 480) -> dict[str, Any]:
    name = body["metadata"]["name"]
    r.plane.kubectl("home", "-n", r.ns, "apply", "-f", "-", input=yaml.safe_dump(body))

    def succeeded() -> dict[str, Any] | None:
        job = r.get("ddj", name)
        return job if job.get("status", {}).get("phase") == "Succeeded" else None

    try:
        return k8senv.wait_until(f"job {name} Succeeded", succeeded, timeout=timeout)
    except TimeoutError:  # what it was doing instead, for whoever reads the failure
        print(json.dumps(r.get("ddj", name).get("status"), indent=1))
        for p in r.get("pods", "-l", f"ddiloco.dev/job={name}")["items"]:
            pod = p["metadata"]["name"]
            print(f"--- {pod}: {p['status'].get('phase')}")
            print(r.kubectl("logs", pod, "--all-containers", "--tail=25", check=False))
        raise


def evaluations(r: Run, job: str) -> tuple[float, list[tuple[int, float]]]:
    """The starting model's loss as the job's evaluator measured it (what every learner
    starts from), and (global version, loss) of every measurement it logged since."""
    out = r.kubectl("logs", f"deployment/{job}-evaluator", "--tail=-1", check=False)
    started = STARTED.search(out)
    assert started is not None, out[-2000:]
    return float(started[2]), [(int(m[1]), float(m[2])) for m in EVALUATED.finditer(out)]


def test_a_user_fine_tunes_their_model_on_their_data_and_a_second_job_resumes(
    run: Run, tmp_path: Path
) -> None:
    """A platform team's job, start to finish: their pretrained model and Parquet corpus on a
    claim of theirs, mounted through the pod template fields; the first evaluation is the
    saved model's own loss (not a random init's); the job runs to totalTokens and Succeeds;
    its checkpoint, on another claim of theirs, loads with `from_pretrained`, evaluates lower
    than the start and outlives the job; a second job started from it resumes there."""
    import os
    import shutil

    from transformers import AutoModelForCausalLM

    root = Path("/tmp/ddiloco-test") / f"{run.ns}-tune"
    shutil.rmtree(root, ignore_errors=True)
    model, corpus = pretrained_and_corpus(root / "data")
    ckpt = root / "checkpoints"
    ckpt.mkdir(parents=True)
    os.chown(ckpt, 10001, 10001)  # the image's user writes there
    for f in [root, *root.rglob("*")]:  # readable by the image's user, as a shared volume is
        if f != ckpt:
            f.chmod(0o755 if f.is_dir() else 0o644)
    start = held_out_loss(model, corpus)
    user_claim(run, "tune-data", root / "data")
    user_claim(run, "tune-checkpoints", ckpt)

    t0 = time.monotonic()
    budget = 2 * 250 * TUNE_BATCH * TUNE_SEQ  # about 250 steps of each learner
    run_to_succeeded(run, tune_job(run, TUNE, budget, None))
    run.figures["tune_apply_to_succeeded_s"] = round(time.monotonic() - t0, 1)
    first, measured = evaluations(run, TUNE)
    assert first == pytest.approx(start, abs=2e-4)  # the user's model, not a random init
    assert measured, "no evaluation of the global model"

    def evaluated_at_the_end() -> dict[str, Any] | None:
        st = run.get("ddj", TUNE)["status"]
        ev = st.get("evaluation") or {}
        return (
            st
            if st.get("globalVersion") and ev.get("globalVersion") == st["globalVersion"]
            else None
        )

    # the evaluator measures the last version too (it moved past the last measurement), and
    # the operator copies it into the status within a poll
    status = k8senv.wait_until("the final version's evaluation in the status",
                               evaluated_at_the_end, timeout=180)  # fmt: skip
    assert status["evaluation"]["loss"] < start, status["evaluation"]
    assert status.get("progressPercentage", 0) >= 100, status

    # the learners hear `finished` at their next call after the budget is merged, hand over
    # and exit 0: their pods end Succeeded (the job's phase may say so first)
    def learners_exited() -> list[str] | None:
        pods = run.get("pods", "-l", f"ddiloco.dev/job={TUNE},{LEARNER_LABEL}")["items"]
        phases = sorted(p["status"]["phase"] for p in pods)
        return phases if phases == ["Succeeded", "Succeeded"] else None

    k8senv.wait_until("both learners Succeeded", learners_exited, timeout=90)

    pointer = ckpt / TUNE / "latest"
    if not pointer.exists():  # say why, from the synchronizer's log
        log = run.kubectl("logs", f"{TUNE}-synchronizer-0", "--tail=-1", check=False)
        pytest.fail("no checkpoint written:\n" + "\n".join(
            line for line in log.splitlines() if "heckpoint" in line or "rror" in line
        )[-4000:])  # fmt: skip
    latest = pointer.read_text().strip()
    exported = ckpt / TUNE / latest
    net = AutoModelForCausalLM.from_pretrained(str(exported))  # what a user loads
    assert net.config.hidden_size == 64
    tuned = held_out_loss(exported, corpus)
    assert tuned < start - 0.01, (tuned, start)
    manifest = json.loads((exported / "ddiloco_checkpoint.json").read_text())

    run.kubectl("delete", "ddj", TUNE, "--wait=true", "--timeout=120s", timeout=150)
    assert (exported / "model.safetensors").exists()  # the job's deletion left the user's claim

    # a second job starts from the checkpoint: the synchronizer from its outer state, and the
    # evaluator's first measurement is the checkpoint's loss, at the checkpoint's version
    resumed = f"{TUNE}-2"
    body = tune_job(run, resumed, budget + 2 * 40 * TUNE_BATCH * TUNE_SEQ,
                    f"/checkpoints/{TUNE}/{latest}")  # fmt: skip
    run_to_succeeded(run, body)
    first, again = evaluations(run, resumed)
    assert first == pytest.approx(tuned, abs=2e-4)  # it started from the checkpoint
    versions = sum(f["version"] for f in manifest["fragments"])
    assert again and min(v for v, _ in again) >= versions, (again, manifest["fragments"])
    run.kubectl("delete", "ddj", resumed, "--wait=true", "--timeout=120s", timeout=150)
