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

    def hold(self, name: str, cpu: int) -> None:
        """A bare high-priority Workload in the LocalQueue asking for `cpu` (nothing runs it:
        it only holds quota once admitted)."""
        self.cl.custom().create_namespaced_custom_object(*KQ, self.ns, "workloads", {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "Workload",
            "metadata": {"name": name},
            "spec": {
                "queueName": "lq",
                "priorityClassRef": {
                    "group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": self.high,
                },
                "priority": 1000,
                "podSets": [{
                    "name": "main", "count": 1,
                    "template": {"spec": {"restartPolicy": "Never", "containers": [{
                        "name": "c", "image": "x",
                        "resources": {"requests": {"cpu": str(cpu)}}}]}},
                }],
            },
        })  # fmt: skip

    def admitted(self, name: str) -> bool:
        return any(
            c["type"] == "Admitted" and c["status"] == "True"
            for c in self.workload(name).get("status", {}).get("conditions", [])
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
    queues.hold("urgent", cpu=4)
    evicted = h.wait_condition(cl, job, "Suspended", reason="Preempted", timeout=60)
    assert evicted["status"]["phase"] == "Suspended"
    assert "Evicted by Kueue" in h.condition(evicted, "Suspended")["message"]
    k8senv.wait_until("the learner pods gone", lambda: not cl.pods("home", job), timeout=30)
    # the pods' quota goes back to Kueue, which admits the urgent Workload
    k8senv.wait_until("the urgent Workload admitted", lambda: queues.admitted("urgent"), timeout=60)
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


def test_a_partially_admitted_job_grows_when_quota_frees(
    cl: h.Clusters, operator: h.Operator, queues: Queues
) -> None:
    """Kueue's workload slices (ElasticJobsViaWorkloadSlices, on in kueueenv): admitted with
    2 of 4 learners, the job keeps a larger slice queued; once the quota frees Kueue admits
    it in place of the first, and the job runs 4."""
    queues.create(cpu=5)  # the synchronizer's 1 and 4 learners
    queues.hold("other", cpu=2)  # higher priority: the job's slice cannot preempt it
    k8senv.wait_until("the other Workload admitted", lambda: queues.admitted("other"), timeout=30)
    job = h.create_job(cl, queued_job("grow", 4, queues.low, minReplicas=2))
    first = f"ddiloco-{job}"
    grown = f"{first}-{cl.job(job)['metadata']['uid'][:8]}-2"

    ready = h.wait_condition(cl, job, "Ready", timeout=60)
    assert ready["status"]["desiredLearners"] == 2 and len(cl.pods("home", job)) == 2
    running = {p.metadata.uid for p in cl.pods("home", job)}
    waiting = k8senv.wait_until("the larger slice", lambda: queues.workload(grown), timeout=30)
    assert (
        waiting["metadata"]["annotations"]["kueue.x-k8s.io/workload-slice-replacement-for"]
        == f"{cl.ns}/{first}"
    )
    learners = next(p for p in waiting["spec"]["podSets"] if p["name"] == "learners-a")
    assert learners["count"] == 4 and "minCount" not in learners
    assert not waiting.get("status", {}).get("admission")  # the quota is short: it waits
    assert "asks Kueue for the rest" in h.condition(cl.job(job), "Suspended")["message"]

    cl.custom().delete_namespaced_custom_object(*KQ, cl.ns, "workloads", "other")

    def four() -> dict[str, Any] | None:
        j = cl.job(job)
        ok = j["status"].get("readyLearners") == 4 and len(cl.pods("home", job)) == 4
        return j if ok else None

    grew = k8senv.wait_until("the job at 4 learners", four, timeout=60)
    assert running <= {p.metadata.uid for p in cl.pods("home", job)}  # the 2 went on
    assert grew["status"]["desiredLearners"] == 4
    suspended = h.condition(grew, "Suspended")
    assert suspended["status"] == "False" and "a 4 of 4" in suspended["message"]
    assert "Grown" in events(cl, job)
    old = queues.workload(first)
    fin = next(c for c in old["status"]["conditions"] if c["type"] == "Finished")
    assert fin["status"] == "True" and fin["reason"] == "WorkloadSliceReplaced"
    new = queues.workload(grown)
    counts = {a["name"]: a["count"] for a in new["status"]["admission"]["podSetAssignments"]}
    assert counts == {"synchronizer": 1, "learners-a": 4}

    def usage() -> tuple[int, str]:
        st = cl.custom().get_cluster_custom_object(*KQ, "clusterqueues", queues.cq)["status"]
        cpu = {r["name"]: r["total"] for f in st["flavorsReservation"] for r in f["resources"]}
        return st.get("reservingWorkloads", 0), cpu.get("cpu", "0")

    # the ClusterQueue's status follows its cache with a delay: wait for it to count the new
    # slice's 1 + 4 cpu, then it counts that Workload only (nothing left of the old one's 3)
    k8senv.wait_until("the ClusterQueue at 5 cpu", lambda: usage()[1] == "5", timeout=30)
    assert usage() == (1, "5")
    assert cl.job(job)["spec"]["learnerGroups"][0]["replicas"] == 4

    # Preempted, the grown slice gets its minCount back with the quota: readmitted with 2
    # (what is left beside the urgent Workload), it asks for the rest again.
    queues.hold("urgent", cpu=2)
    h.wait_condition(cl, job, "Suspended", reason="Preempted", timeout=60)

    def back_at_two() -> dict[str, Any] | None:
        j = cl.job(job)
        ok = (
            h.condition(j, "Suspended")["status"] == "False"
            and "a 2 of 4" in h.condition(j, "Suspended")["message"]
        )
        return j if ok and len(cl.pods("home", job)) == 2 else None

    k8senv.wait_until("the job readmitted with 2 learners", back_at_two, timeout=60)
    again = next(p for p in queues.workload(grown)["spec"]["podSets"] if p["name"] == "learners-a")
    assert again["minCount"] == 2
    k8senv.wait_until(
        "a larger slice again",
        lambda: queues.workload(grown[: grown.rindex("-")] + "-3"),
        timeout=30,
    )
