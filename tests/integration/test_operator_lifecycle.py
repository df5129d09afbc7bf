"""A job's life on a real control plane: scaling, suspend, deletion, operator restarts, status.

python tests/integration/k8senv.py build          # once per machine
.venv/bin/pytest tests/integration/test_operator_lifecycle.py
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import k8senv
import operator_helpers as h
import pytest
from kubernetes.client.exceptions import ApiException
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration
ALL = ["home", "region-a", "region-b"]


def three_cluster_job(cl: h.Clusters, name: str, per_group: int, **spec: Any) -> str:
    for region in ("region-a", "region-b"):
        h.kubeconfig_secret(cl, f"{region}-kubeconfig", region)
    groups = [
        {"name": "home", "replicas": per_group},
        h.remote("region-a", per_group),
        h.remote("region-b", per_group),
    ]
    return h.create_job(cl, h.job_manifest(name, groups, **spec))


def patch_spec(cl: h.Clusters, name: str, spec: dict[str, Any]) -> None:
    cl.custom().patch_namespaced_custom_object(
        h.GROUP, h.VERSION, cl.ns, h.PLURAL, name, {"spec": spec}
    )


def gone(call: Any) -> bool:
    try:
        call()
    except ApiException as e:
        return e.status == 404
    return False


def test_deleting_the_job_removes_everything_in_every_cluster(
    cl: h.Clusters, operator: h.Operator
) -> None:
    job = three_cluster_job(cl, "del", 1)
    h.wait_condition(cl, job, "Ready", timeout=60)
    assert all(cl.pods(c, job) for c in ALL)
    # the job key at home only; every cluster its group's credentials, each pod its own
    assert not gone(lambda: cl.core().read_namespaced_secret(f"{job}-token", cl.ns))
    for c in ALL:
        _, items = h.learner_credentials(cl, c, job, c)
        assert sorted(items) == [f"{c}-0"]
        assert (f"{job}-token" in h.job_secret_names(cl, c, job)) == (c == "home"), c
        for pod in cl.pods(c, job):
            h.check_own_credential(cl, c, job, pod)

    t0 = time.monotonic()
    cl.custom().delete_namespaced_custom_object(h.GROUP, h.VERSION, cl.ns, h.PLURAL, job)
    k8senv.wait_until("the job to go", lambda: gone(lambda: cl.job(job)), timeout=30)
    print(f"job and its objects in 3 clusters deleted in {time.monotonic() - t0:.1f}s")
    for c in ALL:  # the finalizer waited for the pods, so they are gone already
        assert cl.pods(c, job) == [], c
        assert h.job_secret_names(cl, c, job) == set(), c  # the key, credentials, TLS
    name = f"{job}-synchronizer"
    assert gone(lambda: cl.apps().read_namespaced_stateful_set(name, cl.ns))
    assert gone(lambda: cl.core().read_namespaced_service(name, cl.ns))
    assert gone(lambda: cl.core().read_namespaced_service(f"{name}-shards", cl.ns))
    k8senv.wait_until(
        "the state claim to go",
        lambda: gone(
            lambda: cl.core().read_namespaced_persistent_volume_claim(f"state-{name}-0", cl.ns)
        ),
        30,
    )
    leftovers = cl.core().list_namespaced_pod(
        cl.ns, label_selector="app.kubernetes.io/instance=del"
    )
    assert leftovers.items == []


def test_deleting_after_the_kubeconfig_secret_went_still_cleans_the_region(
    cl: h.Clusters, operator: h.Operator
) -> None:
    # As in a namespace deletion, where the Secret may go before the job: the operator
    # still knows the region's client and cleans it.
    h.kubeconfig_secret(cl, "region-a-kubeconfig", "region-a")
    job = h.create_job(cl, h.job_manifest("orphan", [h.remote("region-a", 2)]))
    h.wait_condition(cl, job, "Ready")
    cl.core().delete_namespaced_secret("region-a-kubeconfig", cl.ns)
    cl.custom().delete_namespaced_custom_object(h.GROUP, h.VERSION, cl.ns, h.PLURAL, job)
    k8senv.wait_until("the job to go", lambda: gone(lambda: cl.job(job)), timeout=30)
    assert cl.pods("region-a", job) == []
    assert h.job_secret_names(cl, "region-a", job) == set()


def test_killing_the_operator_mid_reconcile_leaves_one_pod_per_slot(
    cl: h.Clusters, operator: h.Operator
) -> None:
    per_group = 12
    job = three_cluster_job(cl, "crash", per_group)
    # SIGKILL the operator as soon as the first learner pods exist, before it made them all
    seen = k8senv.wait_until(
        "the first learner pods",
        lambda: sum(len(cl.pods(c, job)) for c in ALL),
        timeout=30,
        interval=0.01,
    )
    operator.kill()
    at_kill = sum(len(cl.pods(c, job)) for c in ALL)
    assert 0 < seen <= at_kill < 3 * per_group, f"not mid-reconcile: {seen}/{at_kill}"
    operator.start()
    h.wait_condition(cl, job, "Ready", timeout=90)
    slots = h.pods_by_slot(cl, ALL, job)
    assert len(slots) == 3 * per_group
    assert {lid: len(pods) for lid, pods in slots.items() if len(pods) != 1} == {}
    status = cl.job(job)["status"]
    assert all(s["replacements"] == 0 for s in status["slots"])
    assert all(g["replaced"] == 0 for g in status["groups"])
    print(f"killed with {at_kill}/{3 * per_group} pods made; restarted: one pod per slot")


def test_scaling_a_group_adds_and_removes_slots(cl: h.Clusters, operator: h.Operator) -> None:
    # within the declared shard count, so no learner gets a new data part (past it, every learner
    # moves to a new shard: tests/integration/test_operator_status.py)
    job = h.create_job(
        cl,
        h.job_manifest(
            "scale", [{"name": "a", "replicas": 2}], training={"model": "tiny", "dataParts": 4}
        ),
    )
    h.wait_condition(cl, job, "Ready")
    before = h.running_uids(cl, ["home"], job)

    patch_spec(cl, job, {"learnerGroups": [{"name": "a", "replicas": 4}]})
    up = k8senv.wait_until(
        "4 learners", lambda: len(u := h.running_uids(cl, ["home"], job)) == 4 and u, timeout=30
    )
    assert {k: up[k] for k in before} == before  # the first two untouched
    # a credential per slot, there before its pod; each pod mounts its own
    assert sorted(h.learner_credentials(cl, "home", job, "a")[1]) == [f"a-{i}" for i in range(4)]
    for pod in cl.pods("home", job):
        h.check_own_credential(cl, "home", job, pod)
    job_up = h.wait_condition(cl, job, "Ready")
    assert (job_up["status"]["desiredLearners"], job_up["status"]["readyLearners"]) == (4, 4)

    patch_spec(cl, job, {"learnerGroups": [{"name": "a", "replicas": 1}]})
    down = k8senv.wait_until(
        "1 learner",
        lambda: (
            (u := h.running_uids(cl, ["home"], job)).keys() == {"a-0"}
            and len(cl.pods("home", job)) == 1
            and u
        ),
        30,
    )
    assert down["a-0"] == before["a-0"]
    # the removed slots' credentials go once their pods have
    k8senv.wait_until(
        "the removed slots' credentials to go",
        lambda: sorted(h.learner_credentials(cl, "home", job, "a")[1]) == ["a-0"],
        timeout=10,
    )
    job_down = h.wait_condition(cl, job, "Ready")
    assert len(job_down["status"]["groups"][0]["parts"]) == 1
    assert job_down["status"]["groups"][0]["replaced"] == 0  # scaling is not a failure


def test_suspend_frees_the_learners_and_resume_brings_them_back(
    cl: h.Clusters, operator: h.Operator
) -> None:
    h.kubeconfig_secret(cl, "region-a-kubeconfig", "region-a")
    job = h.create_job(
        cl, h.job_manifest("susp", [{"name": "a", "replicas": 2}, h.remote("region-a", 1)])
    )
    h.wait_condition(cl, job, "Ready")
    patch_spec(cl, job, {"suspend": True})
    suspended = h.wait_condition(cl, job, "Ready", "False", reason="Suspended")
    k8senv.wait_until(
        "no learner pods",
        lambda: not any(cl.pods(c, job) for c in ("home", "region-a")),
        timeout=20,
    )
    # the synchronizer, which took the learners' last hand-overs, stops once they are gone
    k8senv.wait_until(
        "the synchronizer scaled to 0",
        lambda: (
            cl.apps().read_namespaced_stateful_set(f"{job}-synchronizer", cl.ns).spec.replicas == 0
        ),
        timeout=20,
    )
    # scaled to 0, the shard keeps its claim (whenScaled: Retain): resuming keeps the state
    claim = f"state-{job}-synchronizer-0"
    assert cl.core().read_namespaced_persistent_volume_claim(claim, cl.ns).status.phase == "Bound"
    assert (
        h.wait_condition(cl, job, "Ready", "False", reason="Suspended")["status"]["phase"]
        == "Suspended"
    ), suspended
    patch_spec(cl, job, {"suspend": False})
    resumed = h.wait_condition(cl, job, "Ready", timeout=30)
    assert resumed["status"]["readyLearners"] == 3
    assert all(s["replacements"] == 0 for s in resumed["status"]["slots"])


def _synchronizer(port: int, token: str, state: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "DDILOCO_TOKEN": token,
        "DDILOCO_STATE_DIR": str(state),
        "DDILOCO_PORT": str(port),
        "DDILOCO_HOST": "127.0.0.1",
        "DDILOCO_QUORUM": "1",
    }
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ddiloco.cli.main", "synchronizer"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=state.parent,
        )


def test_status_numbers_come_from_the_synchronizer(
    k8s: Any, cl: h.Clusters, tmp_path: Path
) -> None:
    # The synchronizer pod is fake; run the real `ddiloco synchronizer` here and point the
    # operator's status URL at it. Until it answers the job is not Ready (status.py): an
    # available pod that never answered is no synchronizer anyone can use.
    port = h.free_port()
    op = h.Operator(
        k8s.home.kubeconfig,
        cl.ns,
        tmp_path,
        env={"DDILOCO_OPERATOR_STATUS_URL_TEMPLATE": f"http://127.0.0.1:{port}"},
    )
    op.start()
    sync = None
    try:
        job = h.create_job(cl, h.job_manifest("stat", [{"name": "a", "replicas": 1}]))
        quiet = h.wait_condition(cl, job, "SynchronizerReady", "False", "SynchronizerNotAnswering")
        quiet = h.wait_condition(cl, job, "LearnersReady")
        assert h.condition(quiet, "Ready")["reason"] == "SynchronizerNotReady"
        assert quiet["status"]["synchronizer"]["reachable"] is False
        assert "globalVersion" not in quiet["status"]
        assert quiet["status"]["phase"] == "Running"  # its learner trains all the same
        token = base64.b64decode(
            cl.core().read_namespaced_secret(f"{job}-token", cl.ns).data["token"]
        ).decode()
        sync = _synchronizer(port, token, tmp_path / "state", tmp_path / "sync.log")
        k8senv.wait_until(
            "the synchronizer",
            lambda: (
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).status == 200
            ),
            timeout=30,
        )
        status = k8senv.wait_until(
            "status from the synchronizer",
            lambda: (s := cl.job(job)["status"])["synchronizer"]["reachable"] and s,
            timeout=20,
        )
        assert status["globalVersion"] == 0 and status["merges"] == 0
        assert status["tokensMerged"] == 0
        h.wait_condition(cl, job, "Ready", timeout=10)
        sync.terminate()
        sync.wait(10)
        # unreachable again: the last numbers stay, Ready goes False, the operator lives
        after = k8senv.wait_until(
            "unreachable noticed",
            lambda: not (s := cl.job(job)["status"])["synchronizer"]["reachable"] and s,
            timeout=20,
        )
        assert after["globalVersion"] == 0 and op.running()
        gone = h.wait_condition(cl, job, "Ready", "False", "SynchronizerNotReady", timeout=10)
        assert gone["status"]["phase"] == "Running"
    finally:
        if sync is not None and sync.poll() is None:
            sync.kill()
        try:
            h.delete_jobs(cl, op)
        finally:
            op.stop()
