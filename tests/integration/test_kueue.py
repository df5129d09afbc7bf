"""Queued through a real Kueue: the operator next to Kueue's controller manager (kueueenv.py).

    python tests/integration/kueueenv.py build     # once per machine, after k8senv's build
    .venv/bin/pytest tests/integration/test_kueue.py

A job labelled kueue.x-k8s.io/queue-name gets a Workload (operator/kueue.py); Kueue admits,
preempts and readmits it, and the job follows: suspended until admitted, on the flavor's
nodes when admitted, its pods deleted (each learner's SIGTERM flush) when preempted, with its
synchronizer state kept for the readmission. Each test has its own ResourceFlavor,
ClusterQueue and WorkloadPriorityClasses (cluster-scoped, named after the test's namespace) and
a LocalQueue in its namespace. Pods run on kwok's fake nodes (no containers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import k8senv
import operator_helpers as h
import pytest
from kubernetes.client.exceptions import ApiException
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

# 420 s: the first test also waits for the control plane and Kueue to start
pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
KQ = ("kueue.x-k8s.io", "v1beta2")
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
REGION = "topology.kubernetes.io/region"  # every fake node of home has region=home


class Queues:
    """One test's Kueue objects: flavor `rf-<ns>`, ClusterQueue `cq-<ns>` with a cpu quota,
    LocalQueue `lq` in the namespace, priority classes `low-<ns>` (10) and `high-<ns>` (1000)."""

    def __init__(self, cl: h.Clusters) -> None:
        self.cl, self.ns = cl, cl.ns
        self.flavor, self.cq = f"rf-{cl.ns}", f"cq-{cl.ns}"
        self.low, self.high = f"low-{cl.ns}", f"high-{cl.ns}"

    def create(self, cpu: int, hold: bool = False) -> None:
        api = self.cl.custom()
        api.create_cluster_custom_object(*KQ, "resourceflavors", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
            "metadata": {"name": self.flavor}, "spec": {"nodeLabels": {REGION: "home"}},
        })  # fmt: skip
        for name, value in ((self.low, 10), (self.high, 1000)):
            api.create_cluster_custom_object(*KQ, "workloadpriorityclasses", {
                "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
                "metadata": {"name": name}, "value": value,
            })  # fmt: skip
        cq: dict[str, Any] = {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": self.cq},
            "spec": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": self.ns}},
                "resourceGroups": [{
                    "coveredResources": ["cpu"],
                    "flavors": [{"name": self.flavor,
                                 "resources": [{"name": "cpu", "nominalQuota": cpu}]}],
                }],
                "preemption": {"withinClusterQueue": "LowerPriority"},
            },
        }  # fmt: skip
        if hold:
            cq["spec"]["stopPolicy"] = "Hold"
        api.create_cluster_custom_object(*KQ, "clusterqueues", cq)
        api.create_namespaced_custom_object(*KQ, self.ns, "localqueues", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
            "metadata": {"name": "lq"}, "spec": {"clusterQueue": self.cq},
        })  # fmt: skip

    def release_hold(self) -> None:
        self.cl.custom().patch_cluster_custom_object(
            *KQ, "clusterqueues", self.cq, {"spec": {"stopPolicy": "None"}}
        )

    def workload(self, name: str) -> dict[str, Any]:
        return dict(self.cl.custom().get_namespaced_custom_object(*KQ, self.ns, "workloads", name))

    def delete(self) -> None:
        """Delete the cluster-scoped objects (not awaited: the namespace's deletion takes
        the LocalQueue and the Workloads, after which Kueue lets the ClusterQueue go)."""
        api = self.cl.custom()
        for plural, name in (
            ("clusterqueues", self.cq),
            ("resourceflavors", self.flavor),
            ("workloadpriorityclasses", self.low),
            ("workloadpriorityclasses", self.high),
        ):
            with contextlib.suppress(ApiException):
                api.delete_cluster_custom_object(*KQ, plural, name)


@pytest.fixture
def queues(kueue: Any, cl: h.Clusters) -> Iterator[Queues]:
    q = Queues(cl)
    yield q
    q.delete()
    assert kueue.alive(), f"kueue exited during the test:\n{kueue.tail()}"


def queued_job(name: str, learners: int, priority: str, **group: Any) -> dict[str, Any]:
    body = h.job_manifest(
        name,
        [{"name": "a", "replicas": learners, "resources": {"requests": {"cpu": "1"}}, **group}],
        synchronizer={
            "storage": {"size": "1Gi", "storageClassName": ""},
            "resources": {"requests": {"cpu": "1"}},
        },
    )
    body["metadata"]["labels"] = {QUEUE_LABEL: "lq", PRIORITY_LABEL: priority}
    return body


def events(cl: h.Clusters, job: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for e in (
        cl.core().list_namespaced_event(cl.ns, field_selector=f"involvedObject.name={job}").items
    ):
        out.setdefault(e.reason, []).append(e.message)
    return out


def test_queued_admitted_preempted_and_readmitted(
    cl: h.Clusters, operator: h.Operator, queues: Queues
) -> None:
    queues.create(cpu=4, hold=True)  # the ClusterQueue holds: the job must wait
    job = h.create_job(cl, queued_job("kq", 3, queues.low))

    queued = h.wait_condition(cl, job, "Suspended", reason="Queued", timeout=30)
    assert queued["status"]["phase"] == "Suspended"
    wl = queues.workload(f"ddiloco-{job}")
    assert wl["spec"]["queueName"] == "lq" and wl["spec"]["priority"] == 10
    assert {p["name"]: p["count"] for p in wl["spec"]["podSets"]} == {
        "synchronizer": 1,
        "learners-a": 3,
    }
    assert not cl.pods("home", job)
    sts = cl.apps().read_namespaced_stateful_set(f"{job}-synchronizer", cl.ns)
    assert sts.spec.replicas == 0  # nothing runs before Kueue admits

    queues.release_hold()
    ready = h.wait_condition(cl, job, "Ready", timeout=60)
    assert h.condition(ready, "Suspended")["status"] == "False"
    assert h.condition(ready, "Suspended")["reason"] == "Admitted"
    pods = cl.pods("home", job)
    assert len(pods) == 3
    assert all(p.spec.node_selector.get(REGION) == "home" for p in pods)  # the flavor's label
    assert "Admitted" in events(cl, job)
    claim = f"state-{job}-synchronizer-0"
    claim_uid = cl.core().read_namespaced_persistent_volume_claim(claim, cl.ns).metadata.uid

    # A higher-priority Workload that needs the whole quota: Kueue preempts the job.
    high = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {"name": "urgent"},
        "spec": {
            "queueName": "lq",
            "priorityClassRef": {
                "group": "kueue.x-k8s.io",
                "kind": "WorkloadPriorityClass",
                "name": queues.high,
            },
            "priority": 1000,
            "podSets": [{
                "name": "main", "count": 1,
                "template": {"spec": {"restartPolicy": "Never", "containers": [{
                    "name": "c", "image": "x", "resources": {"requests": {"cpu": "4"}}}]}},
            }],
        },
    }  # fmt: skip
    cl.custom().create_namespaced_custom_object(*KQ, cl.ns, "workloads", high)
    evicted = h.wait_condition(cl, job, "Suspended", reason="Preempted", timeout=60)
    assert evicted["status"]["phase"] == "Suspended"
    assert "Evicted by Kueue" in h.condition(evicted, "Suspended")["message"]
    k8senv.wait_until("the learner pods gone", lambda: not cl.pods("home", job), timeout=30)
    # the pods' quota goes back to Kueue, which admits the urgent Workload
    k8senv.wait_until(
        "the urgent Workload admitted",
        lambda: any(
            c["type"] == "Admitted" and c["status"] == "True"
            for c in queues.workload("urgent")["status"].get("conditions", [])
        ),
        timeout=60,
    )
    ours = queues.workload(f"ddiloco-{job}")
    assert not ours["status"].get("admission")
    assert "Suspended" in events(cl, job) and "QuotaReleased" in events(cl, job)
    # the synchronizer's state stays for the readmission
    assert cl.core().read_namespaced_persistent_volume_claim(claim, cl.ns).metadata.uid == claim_uid

    cl.custom().delete_namespaced_custom_object(*KQ, cl.ns, "workloads", "urgent")
    back = h.wait_condition(cl, job, "Ready", timeout=90)
    assert back["status"]["readyLearners"] == 3
    assert h.condition(back, "Suspended")["status"] == "False"
    assert "Resumed" in events(cl, job)
    assert cl.core().read_namespaced_persistent_volume_claim(claim, cl.ns).metadata.uid == claim_uid
    # a preemption is not a learner failure: nothing was replaced
    assert all(g["replaced"] == 0 for g in back["status"]["groups"])


def test_a_job_over_its_queues_quota_waits_and_says_why(
    cl: h.Clusters, operator: h.Operator, queues: Queues
) -> None:
    queues.create(cpu=2)
    job = h.create_job(cl, queued_job("big", 3, queues.low))  # 1 + 3 cpu > 2
    waiting = h.wait_condition(cl, job, "Suspended", reason="Queued", timeout=30)

    def quoted() -> dict[str, Any] | None:
        j = cl.job(job)
        return j if "insufficient quota" in h.condition(j, "Suspended")["message"] else None

    waiting = k8senv.wait_until("Kueue's reason in the condition", quoted, timeout=30)
    assert "lq" in h.condition(waiting, "Suspended")["message"]
    assert waiting["status"]["phase"] == "Suspended"
    assert h.condition(waiting, "Ready")["status"] == "False"
    assert not cl.pods("home", job)


def test_partial_admission_runs_fewer_learners(
    cl: h.Clusters, operator: h.Operator, queues: Queues
) -> None:
    queues.create(cpu=3)  # the synchronizer's 1 and 2 learners of the 4 asked for
    job = h.create_job(cl, queued_job("part", 4, queues.low, minReplicas=1))
    ready = h.wait_condition(cl, job, "Ready", timeout=60)
    assert ready["status"]["desiredLearners"] == 2 and ready["status"]["readyLearners"] == 2
    assert len(cl.pods("home", job)) == 2
    wl = queues.workload(f"ddiloco-{job}")
    counts = {a["name"]: a["count"] for a in wl["status"]["admission"]["podSetAssignments"]}
    assert counts == {"synchronizer": 1, "learners-a": 2}
    assert "a 2 of 4" in h.condition(ready, "Suspended")["message"]
    assert cl.job(job)["spec"]["learnerGroups"][0]["replicas"] == 4  # the spec is the user's
