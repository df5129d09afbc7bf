"""What the job did not make it never touches, and what the apiserver refuses it reports.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_ownership.py

An object of a name the job needs that lacks the job's uid (label or ownerReference) is left
as it is, also on deletion, and the job says NameConflict naming it. Slot pod names of two
jobs never collide. A child the apiserver refuses (an exceeded ResourceQuota, a missing
PriorityClass) shows as a FailedCreate event and condition quoting the apiserver.
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


def region(name: str, replicas: int) -> dict[str, Any]:
    return {**h.remote(name, replicas), "syncUrl": "https://ddiloco-sync.example:8470"}


def foreign_secret(cl: h.Clusters, cluster: str, name: str) -> Any:
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": {"owner": "someone-else"}},
        "stringData": {"password": "theirs", "other": "keep me"},
    }
    return cl.core(cluster).create_namespaced_secret(cl.ns, body)


def delete_job(cl: h.Clusters, job: str) -> None:
    cl.custom().delete_namespaced_custom_object(h.GROUP, h.VERSION, cl.ns, h.PLURAL, job)

    def gone() -> bool:
        try:
            cl.job(job)
        except ApiException as e:
            return e.status == 404
        return False

    k8senv.wait_until(f"job {job} to go", gone, 30)


def events(cl: h.Clusters, job: str, reason: str) -> list[Any]:
    found = (
        cl.core().list_namespaced_event(cl.ns, field_selector=f"involvedObject.name={job}").items
    )
    return [e for e in found if e.reason == reason]


def test_someone_elses_secrets_in_a_region_are_never_changed_nor_deleted(
    cl: h.Clusters, operator: h.Operator
) -> None:
    """A Secret of the name a group's learner credentials need (its pods would mount it)
    holds that group back; one of the name of the job key, which no region needs, is simply
    left alone."""
    h.kubeconfig_secret(cl, "region-b-kubeconfig", "region-b")
    unrelated = foreign_secret(cl, "region-b", "own-token")
    groups = [{"name": "home", "replicas": 1}, region("region-a", 1), region("region-b", 1)]
    job = h.create_job(cl, h.job_manifest("own", groups))
    # the credentials' name carries a tag of the job's uid: known once the job exists, and
    # taken in region-a before the operator can reach it (its kubeconfig Secret comes after)
    meta = cl.job(job)["metadata"]
    taken = builders.learner_tokens_secret_name(
        SimpleNamespace(name=job, uid=meta["uid"]),  # type: ignore[arg-type]
        "region-a",
    )
    theirs = foreign_secret(cl, "region-a", taken)
    h.kubeconfig_secret(cl, "region-a-kubeconfig", "region-a")

    def conflict() -> dict[str, Any] | None:
        got = cl.job(job)
        deg = h.condition(got, "Degraded")
        return got if deg.get("reason") == "NameConflict" and taken in deg["message"] else None

    got = k8senv.wait_until("NameConflict naming the credentials Secret", conflict, timeout=30)
    message = h.condition(got, "Degraded")["message"]
    assert f"Secret {cl.ns}/{taken}" in message and "region-a-kubeconfig" in message, message
    # the rest of the job goes on; nothing is made where the conflict is
    k8senv.wait_until(
        "learners at home and in region-b",
        lambda: len(h.running_uids(cl, ["home", "region-b"], job)) == 2,
        30,
    )
    time.sleep(4 * float(h.RESYNC_S))
    assert cl.pods("region-a", job) == []
    for cluster, before in (("region-a", theirs), ("region-b", unrelated)):
        now = cl.core(cluster).read_namespaced_secret(before.metadata.name, cl.ns)
        assert now.metadata.uid == before.metadata.uid
        assert now.metadata.resource_version == before.metadata.resource_version  # not written
        assert now.metadata.labels == {"owner": "someone-else"}

    delete_job(cl, job)
    for cluster, before in (("region-a", theirs), ("region-b", unrelated)):
        after = cl.core(cluster).read_namespaced_secret(before.metadata.name, cl.ns)
        assert after.metadata.uid == before.metadata.uid
        assert set(after.data) == {"password", "other"}


def test_someone_elses_token_secret_at_home_holds_the_job_back_untouched(
    cl: h.Clusters, operator: h.Operator
) -> None:
    theirs = foreign_secret(cl, "home", "adopt-token")
    job = h.create_job(cl, h.job_manifest("adopt", [{"name": "a", "replicas": 1}]))
    got = h.wait_condition(cl, job, "Degraded", reason="NameConflict", timeout=30)
    assert f"Secret {cl.ns}/adopt-token" in h.condition(got, "Degraded")["message"]
    time.sleep(4 * float(h.RESYNC_S))
    # not adopted as the bearer token: nothing that would read it was made
    assert cl.pods("home", job) == []
    deps = cl.apps().list_namespaced_stateful_set(cl.ns).items
    assert not [d for d in deps if d.metadata.name == f"{job}-synchronizer"]
    delete_job(cl, job)
    after = cl.core().read_namespaced_secret("adopt-token", cl.ns)
    assert after.metadata.resource_version == theirs.metadata.resource_version


def test_slot_pod_names_do_not_collide_across_jobs(cl: h.Clusters, operator: h.Operator) -> None:
    # without a tag, both jobs need pod p-col-a-b-0
    one = h.create_job(cl, h.job_manifest("p-col", [{"name": "a-b", "replicas": 1}]))
    two = h.create_job(cl, h.job_manifest("p-col-a", [{"name": "b", "replicas": 1}]))
    for job in (one, two):
        h.wait_condition(cl, job, "LearnersReady", timeout=40)
    pods = {job: cl.pods("home", job) for job in (one, two)}
    assert all(len(p) == 1 for p in pods.values()), pods
    names = {job: p[0].metadata.name for job, p in pods.items()}
    assert names[one] != names[two]
    for job, (pod,) in pods.items():
        assert pod.metadata.labels["ddiloco.dev/job-uid"] == cl.job(job)["metadata"]["uid"]
        assert len(pod.metadata.name) <= 63
    keep = pods[two][0].metadata.uid
    delete_job(cl, one)
    assert [p.metadata.uid for p in cl.pods("home", two)] == [keep]


def test_a_foreign_pod_holding_a_slot_name_is_not_adopted(
    cl: h.Clusters, operator: h.Operator
) -> None:
    job = h.create_job(cl, h.job_manifest("hold", [{"name": "a", "replicas": 1}]))
    h.wait_condition(cl, job, "LearnersReady", timeout=40)
    body = cl.job(job)
    owner = type("J", (), {"name": job, "uid": body["metadata"]["uid"]})
    name = builders.learner_pod_name(owner, "a", 1)  # type: ignore[arg-type]
    squatter = cl.core().create_namespaced_pod(
        cl.ns,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": "mine"}},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]},
        },
    )
    cl.custom().patch_namespaced_custom_object(
        h.GROUP,
        h.VERSION,
        cl.ns,
        h.PLURAL,
        job,
        {"spec": {"learnerGroups": [{"name": "a", "replicas": 2}]}},
    )
    got = h.wait_condition(cl, job, "Degraded", reason="NameConflict", timeout=30)
    assert f"Pod {cl.ns}/{name}" in h.condition(got, "Degraded")["message"]
    assert events(cl, job, "NameConflict")
    now = cl.core().read_namespaced_pod(name, cl.ns)
    assert now.metadata.uid == squatter.metadata.uid and now.metadata.labels["app"] == "mine"
    assert not [k for k in now.metadata.labels if k.startswith("ddiloco.dev/")]  # not adopted
    delete_job(cl, job)
    assert cl.core().read_namespaced_pod(name, cl.ns).metadata.uid == squatter.metadata.uid


def test_refused_children_show_as_failed_create_with_the_apiservers_message(
    cl: h.Clusters, operator: h.Operator
) -> None:
    h.kubeconfig_secret(cl, "region-a-kubeconfig", "region-a")
    cl.core("region-a").create_namespaced_resource_quota(
        cl.ns,
        {"metadata": {"name": "two-pods"}, "spec": {"hard": {"pods": "1"}}},
    )
    k8senv.wait_until(
        "the quota's usage to be counted",
        lambda: cl.core("region-a").read_namespaced_resource_quota("two-pods", cl.ns).status.used,
        30,
    )
    groups = [
        {"name": "home", "replicas": 1, "priorityClassName": "no-such-class"},
        region("region-a", 2),
    ]
    job = h.create_job(cl, h.job_manifest("refuse", groups))

    def both() -> list[str] | None:
        found = [e.message for e in events(cl, job, "FailedCreate")]
        quota = any("exceeded quota" in m and "region-a-kubeconfig" in m for m in found)
        klass = any("no-such-class" in m for m in found)
        return found if quota and klass else None

    found = k8senv.wait_until("FailedCreate events for the quota and the class", both, 30)
    print("\n".join(found))
    got = h.wait_condition(cl, job, "Degraded", reason="FailedCreate", timeout=20)
    message = h.condition(got, "Degraded")["message"]
    assert "exceeded quota" in message or "no-such-class" in message, message
    assert len(cl.pods("region-a", job)) == 1  # the one the quota allows
    assert cl.pods("home", job) == []
