"""Namespaces a job shares, with other groups of its own or with objects it did not make.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_shared.py

Two kubeconfig Secrets may reach one namespace (two groups in one region, or a "remote"
group whose kubeconfig points back at the job's home namespace): each group keeps its pods,
nothing is replaced. And an object with the job's name but neither its uid label nor an
owner reference (a pod with the job's labels and another uid, a Secret of the name of a
group's credentials, the synchronizer's Service, a shard's state claim) is never mounted,
patched, counted or deleted: its resourceVersion stays as it was through the operator's
passes and the job's deletion.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import k8senv
import operator_helpers as h
import pytest
from kubernetes.client.exceptions import ApiException
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

from ddiloco.operator import builders

pytestmark = pytest.mark.integration
PASSES_S = 10 * float(h.RESYNC_S)  # long enough for many passes of the operator


def region(name: str, replicas: int, secret: str) -> dict[str, Any]:
    return {**h.remote(name, replicas, secret), "syncUrl": "https://ddiloco-sync.example:8470"}


def delete_job(cl: h.Clusters, job: str) -> None:
    cl.custom().delete_namespaced_custom_object(h.GROUP, h.VERSION, cl.ns, h.PLURAL, job)

    def gone() -> bool:
        try:
            cl.job(job)
        except ApiException as e:
            return e.status == 404
        return False

    k8senv.wait_until(f"job {job} to go", gone, 30)


def decoy_pod(cl: h.Clusters, cluster: str, name: str, job: str, group: str) -> Any:
    """A pod with the job's name and learner labels but another job's uid."""
    labels = {
        builders.LABEL_JOB: job,
        builders.LABEL_JOB_UID: "not-this-job",
        builders.LABEL_COMPONENT: "learner",
        builders.LABEL_GROUP: group,
        builders.LABEL_SLOT: "0",
        builders.LABEL_LEARNER_ID: f"{group}-0",
        builders.LABEL_ATTEMPT: "0",
    }
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    cl.core(cluster).create_namespaced_pod(cl.ns, body)

    def settled() -> Any:  # scheduled and started (what the scheduler and kubelet write)
        pod = cl.core(cluster).read_namespaced_pod(name, cl.ns)
        return pod if pod.status.phase == "Running" else None

    return k8senv.wait_until(f"decoy pod {name} in {cluster} running", settled, 30)


def foreign(cl: h.Clusters, cluster: str, kind: str, name: str) -> Any:
    """Someone else's Secret, Service or PersistentVolumeClaim of a name the job needs."""
    core = cl.core(cluster)
    meta = {"name": name, "labels": {"owner": "someone-else"}}
    if kind == "Secret":
        body = {"metadata": meta, "stringData": {"password": "theirs"}}
        return core.create_namespaced_secret(cl.ns, body)
    if kind == "Service":
        spec = {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}
        return core.create_namespaced_service(cl.ns, {"metadata": meta, "spec": spec})
    spec = {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "no-such-class",  # stays Pending: nothing else writes it
        "resources": {"requests": {"storage": "1Gi"}},
    }
    return core.create_namespaced_persistent_volume_claim(cl.ns, {"metadata": meta, "spec": spec})


def read(cl: h.Clusters, cluster: str, kind: str, name: str) -> Any:
    core = cl.core(cluster)
    return {
        "Pod": core.read_namespaced_pod,
        "Secret": core.read_namespaced_secret,
        "Service": core.read_namespaced_service,
        "PersistentVolumeClaim": core.read_namespaced_persistent_volume_claim,
    }[kind](name, cl.ns)


def unchanged(cl: h.Clusters, objects: list[tuple[str, str, Any]]) -> None:
    """Each (cluster, kind, object as made) is still there, exactly as it was written."""
    for cluster, kind, before in objects:
        now = read(cl, cluster, kind, before.metadata.name)
        what = f"{kind} {before.metadata.name} in {cluster}"
        assert now.metadata.uid == before.metadata.uid, what
        assert now.metadata.resource_version == before.metadata.resource_version, what
        assert not now.metadata.owner_references, what
        assert now.metadata.deletion_timestamp is None, what


def test_groups_sharing_a_namespace_keep_their_pods(cl: h.Clusters, operator: h.Operator) -> None:
    """Two groups reach region-a through two kubeconfig Secrets, and a third group's
    kubeconfig points back at the home namespace, where a home group runs too: every slot
    keeps its first pod, nothing is replaced, and each group has its own credentials."""
    h.kubeconfig_secret(cl, "one-kubeconfig", "region-a")
    h.kubeconfig_secret(cl, "two-kubeconfig", "region-a")
    h.kubeconfig_secret(cl, "back-kubeconfig", "home")
    groups = [
        {"name": "home", "replicas": 1},
        region("one", 2, "one-kubeconfig"),
        region("two", 2, "two-kubeconfig"),
        region("back", 1, "back-kubeconfig"),
    ]
    job = h.create_job(cl, h.job_manifest("share", groups))
    where = ["home", "region-a"]
    first = k8senv.wait_until(
        "a running pod in every slot",
        lambda: (u := h.running_uids(cl, where, job)) and len(u) == 6 and u,
        40,
    )
    time.sleep(2 * PASSES_S)
    assert h.running_uids(cl, where, job) == first
    status = cl.job(job)["status"]
    assert {g["name"]: g.get("replaced", 0) for g in status["groups"]} == {
        "home": 0,
        "one": 0,
        "two": 0,
        "back": 0,
    }, status["groups"]
    assert status["readyLearners"] == 6, status
    assert h.condition(cl.job(job), "Degraded").get("status") != "True", status["conditions"]
    for cluster, group in (("region-a", "one"), ("region-a", "two"), ("home", "back")):
        h.learner_credentials(cl, cluster, job, group)  # exactly one each
    delete_job(cl, job)
    assert cl.pods("home", job) == [] or all(
        p.metadata.deletion_timestamp for p in cl.pods("home", job)
    )
    assert not [p for p in cl.pods("region-a", job) if not p.metadata.deletion_timestamp]


def test_objects_of_the_jobs_name_it_did_not_make_are_never_touched(
    cl: h.Clusters, operator: h.Operator
) -> None:
    """At home and in regions: pods with the job's labels and another uid are neither
    counted nor deleted; a Secret of the name of a group's credentials holds that group
    back; a Service and a shard's state claim of the synchronizer's names hold the job back
    (no StatefulSet is made onto the claim). Through many passes and the jobs' deletion,
    every such object keeps its resourceVersion."""
    # a running job among decoys: pods of its name and labels but another uid
    decoys = [
        ("home", "Pod", decoy_pod(cl, "home", "own-decoy", "own", "home")),
        ("region-a", "Pod", decoy_pod(cl, "region-a", "own-decoy", "own", "ra")),
    ]
    h.kubeconfig_secret(cl, "ra-kubeconfig", "region-a")
    groups = [
        {"name": "home", "replicas": 1},
        region("ra", 1, "ra-kubeconfig"),
        region("rb", 1, "rb-kubeconfig"),
    ]
    job = h.create_job(cl, h.job_manifest("own", groups))
    meta = cl.job(job)["metadata"]
    taken = builders.learner_tokens_secret_name(
        SimpleNamespace(name=job, uid=meta["uid"]),  # type: ignore[arg-type]
        "rb",
    )
    decoys.append(("region-b", "Secret", foreign(cl, "region-b", "Secret", taken)))
    h.kubeconfig_secret(cl, "rb-kubeconfig", "region-b")

    # a job whose synchronizer's Service and first shard's claim are someone else's
    held = [
        ("home", "Service", foreign(cl, "home", "Service", "held-synchronizer")),
        (
            "home",
            "PersistentVolumeClaim",
            foreign(cl, "home", "PersistentVolumeClaim", "state-held-synchronizer-0"),
        ),
    ]
    other = h.create_job(cl, h.job_manifest("held", [{"name": "a", "replicas": 1}]), volume=False)

    def own_state() -> dict[str, Any] | None:
        got = cl.job(job)
        deg = h.condition(got, "Degraded")
        ready = {g["name"]: g.get("ready", 0) for g in got.get("status", {}).get("groups", [])}
        ok = deg.get("reason") == "NameConflict" and ready.get("home") == 1 and ready.get("ra")
        return got if ok else None

    got = k8senv.wait_until("own: NameConflict in rb, the others ready", own_state, 40)
    assert taken in h.condition(got, "Degraded")["message"]
    got = h.wait_condition(cl, other, "Degraded", reason="NameConflict", timeout=30)
    message = h.condition(got, "Degraded")["message"]
    assert "PersistentVolumeClaim" in message or "Service" in message, message
    time.sleep(2 * PASSES_S)
    got = cl.job(job)
    assert got["status"]["readyLearners"] == 2, got["status"]  # the decoys are not counted
    assert {g["name"]: g.get("replaced", 0) for g in got["status"]["groups"]} == {
        "home": 0,
        "ra": 0,
        "rb": 0,
    }
    assert len(cl.pods("region-b", job)) == 0
    sts = cl.apps().list_namespaced_stateful_set(cl.ns).items
    assert not [s for s in sts if s.metadata.name == "held-synchronizer"]  # never onto the claim
    unchanged(cl, decoys + held)

    # the claim alone still holds the job back, and is named
    cl.core().delete_namespaced_service("held-synchronizer", cl.ns)
    held = held[1:]

    def claim_named() -> dict[str, Any] | None:
        got = cl.job(other)
        deg = h.condition(got, "Degraded")
        claim = f"PersistentVolumeClaim {cl.ns}/state-held-synchronizer-0"
        return got if deg.get("reason") == "NameConflict" and claim in deg["message"] else None

    k8senv.wait_until("NameConflict naming the state claim", claim_named, 30)
    time.sleep(PASSES_S)
    sts = cl.apps().list_namespaced_stateful_set(cl.ns).items
    assert not [s for s in sts if s.metadata.name == "held-synchronizer"]
    unchanged(cl, decoys + held)

    delete_job(cl, job)
    delete_job(cl, other)
    unchanged(cl, decoys + held)


def group_status(cl: h.Clusters, job: str, name: str) -> dict[str, Any]:
    groups = (cl.job(job).get("status") or {}).get("groups") or []
    return next((g for g in groups if g["name"] == name), {})


def test_a_group_moved_to_another_cluster_leaves_nothing_behind(
    cl: h.Clusters, operator: h.Operator
) -> None:
    """A group's kubeconfig Secret edited to point at another cluster: its pods and
    credentials go from the old one (a group that stays there keeps its pod), its slots start
    in the new one without counting failures. Moved again while the operator is down and the
    job deleted meanwhile, the deletion cleans where the status says its objects were."""
    servers = {c: cl.plane.clusters[c].server for c in ("region-a", "region-b")}
    h.kubeconfig_secret(cl, "stay-kubeconfig", "region-a")
    h.kubeconfig_secret(cl, "there-kubeconfig", "region-b")
    h.kubeconfig_secret(cl, "mover-kubeconfig", "region-a")
    groups = [
        {"name": "home", "replicas": 1},
        region("stay", 1, "stay-kubeconfig"),
        region("there", 1, "there-kubeconfig"),
        region("mover", 2, "mover-kubeconfig"),
    ]
    job = h.create_job(cl, h.job_manifest("move", groups))
    k8senv.wait_until(
        "every slot running",
        lambda: len(h.running_uids(cl, ["home", "region-a", "region-b"], job)) == 5,
        40,
    )
    assert group_status(cl, job, "mover")["server"] == servers["region-a"]
    stay = h.running_uids(cl, ["region-a"], job)["stay-0"]
    mover_creds, _ = h.learner_credentials(cl, "region-a", job, "mover")

    h.kubeconfig_secret(cl, "mover-kubeconfig", "region-b")

    def moved() -> bool:
        a, b = h.pods_by_slot(cl, ["region-a"], job), h.running_uids(cl, ["region-b"], job)
        g = group_status(cl, job, "mover")
        return (
            set(a) == {"stay-0"}
            and {"mover-0", "mover-1", "there-0"} <= set(b)
            and mover_creds not in h.job_secret_names(cl, "region-a", job)
            and g.get("server") == servers["region-b"]
            and not g.get("former")
        )

    k8senv.wait_until("the mover's objects gone from region-a, its pods in region-b", moved, 40)
    time.sleep(PASSES_S)
    assert h.running_uids(cl, ["region-a"], job) == {"stay-0": stay}  # untouched
    assert f"{job}-trust" in h.job_secret_names(cl, "region-a", job)  # stay still mounts it
    assert mover_creds in h.job_secret_names(cl, "region-b", job)
    assert {g["name"]: g.get("replaced", 0) for g in cl.job(job)["status"]["groups"]} == {
        "home": 0,
        "stay": 0,
        "there": 0,
        "mover": 0,
    }

    # moved back while the operator is down, and deleted before it is back: the deletion
    # still finds the group's objects in region-b, where the status says they are
    operator.stop()
    h.kubeconfig_secret(cl, "mover-kubeconfig", "region-a")
    cl.custom().delete_namespaced_custom_object(h.GROUP, h.VERSION, cl.ns, h.PLURAL, job)
    operator.start()

    def gone() -> bool:
        try:
            cl.job(job)
        except ApiException as e:
            return e.status == 404
        return False

    k8senv.wait_until(f"job {job} to go", gone, 40)
    for cluster in ("home", "region-a", "region-b"):
        assert not [p for p in cl.pods(cluster, job) if not p.metadata.deletion_timestamp]
        assert h.job_secret_names(cl, cluster, job) == set(), cluster
