"""Failure handling of the operator on a real control plane: replacement, limits, broken clusters.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_failures.py

Pods never run (kwok fakes them), so failures are made the ways a cluster makes them: the
eviction API (policy/v1), and a status PATCH to phase Failed with the kubelet's reasons.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import k8senv
import operator_helpers as h
import pytest
from kubernetes import client
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration
REGIONS = ["region-a", "region-b"]


def evict(cl: h.Clusters, cluster: str, pod: str) -> None:
    cl.core(cluster).create_namespaced_pod_eviction(
        pod, cl.ns, client.V1Eviction(metadata=client.V1ObjectMeta(name=pod, namespace=cl.ns))
    )


def fail(cl: h.Clusters, cluster: str, pod: str, reason: str) -> None:
    """What a kubelet writes when it evicts (node pressure) or preempts a pod."""
    cl.core(cluster).patch_namespaced_pod_status(
        pod,
        cl.ns,
        {
            "status": {
                "phase": "Failed",
                "reason": reason,
                "message": f"The pod was {reason.lower()}",
            }
        },
    )


def replaced_events(cl: h.Clusters, job: str) -> list[Any]:
    events = (
        cl.core().list_namespaced_event(cl.ns, field_selector=f"involvedObject.name={job}").items
    )
    return [e for e in events if e.reason == "LearnerReplaced"]


def test_evicted_and_failed_pods_are_replaced_in_their_slots(
    cl: h.Clusters, operator: h.Operator
) -> None:
    for region in REGIONS:
        h.kubeconfig_secret(cl, f"{region}-kubeconfig", region)
    job = h.create_job(cl, h.job_manifest("repl", [h.remote(r, 2) for r in REGIONS]))
    h.wait_condition(cl, job, "Ready", timeout=60)
    before = h.running_uids(cl, REGIONS, job)
    assert len(before) == 4, before

    t0 = time.monotonic()
    names_before = {p.metadata.name for r in REGIONS for p in cl.pods(r, job)}
    evict(cl, "region-a", h.slot_pod(cl, "region-a", job, "region-a-0"))
    fail(cl, "region-b", h.slot_pod(cl, "region-b", job, "region-b-1"), "Preempted")

    def replaced() -> dict[str, str] | None:
        now = h.running_uids(cl, REGIONS, job)
        done = len(now) == 4 and all(now[i] != before[i] for i in ("region-a-0", "region-b-1"))
        return now if done else None

    after = k8senv.wait_until("both slots replaced", replaced, timeout=20)
    took = time.monotonic() - t0
    print(f"evicted + preempted pods replaced in {took:.1f}s")
    assert took < 10, f"replacement took {took:.1f}s"
    for untouched in ("region-a-1", "region-b-0"):
        assert after[untouched] == before[untouched]
    names = {p.metadata.name for r in REGIONS for p in cl.pods(r, job)}
    assert names == names_before  # same slots, same names
    assert {h.untagged(n) for n in names} == {f"repl-{r}-{i}" for r in REGIONS for i in (0, 1)}

    def counted() -> dict[str, Any] | None:
        status = cl.job(job).get("status") or {}
        groups = {g["name"]: g["replaced"] for g in status.get("groups", [])}
        return status if groups == {"region-a": 1, "region-b": 1} else None

    status = k8senv.wait_until("replacement counts", counted, timeout=10)
    per_slot = {g["name"]: g.get("slotReplacements") for g in status["groups"]}
    assert per_slot == {"region-a": [1, 0], "region-b": [0, 1]}
    assert status.get("slots", []) == []  # healthy again: no per-slot detail
    events = k8senv.wait_until(
        "two LearnerReplaced events",
        lambda: (e := replaced_events(cl, job)) and len(e) >= 2 and e,
        10,
    )
    assert {e.message.split(" in slot ")[1].split(" ")[0] for e in events} == {
        "region-a-0",
        "region-b-1",
    }
    assert any("region-b-1 after Preempted" in e.message for e in events)
    h.wait_condition(cl, job, "Ready")


def test_past_the_failure_limit_the_job_is_degraded(cl: h.Clusters, operator: h.Operator) -> None:
    job = h.create_job(
        cl,
        h.job_manifest(
            "limit",
            [{"name": "a", "replicas": 2}],
            failurePolicy={"maxReplacementsPerSlot": 1, "backoffSeconds": 0},
        ),
    )
    h.wait_condition(cl, job, "Ready")
    first = h.running_uids(cl, ["home"], job)
    a0, a1 = (h.slot_pod(cl, "home", job, f"a-{i}") for i in (0, 1))
    fail(cl, "home", a0, "Evicted")
    second = k8senv.wait_until(
        "a-0 replaced once",
        lambda: (
            (u := h.running_uids(cl, ["home"], job)).get("a-0", first["a-0"]) != first["a-0"] and u
        ),
        20,
    )

    fail(cl, "home", a0, "Evicted")
    done = h.wait_condition(cl, job, "Degraded", reason="ReplacementLimitReached", timeout=20)
    assert "a-0" in h.condition(done, "Degraded")["message"]
    assert done["status"]["phase"] == "Degraded"
    assert h.condition(done, "Ready")["status"] == "False"
    # it does not loop: over several resync periods the failed pod stays, nothing new appears
    deadline = time.monotonic() + 4 * float(h.RESYNC_S) + 1
    while time.monotonic() < deadline:
        pods = {p.metadata.name: p for p in cl.pods("home", job)}
        assert pods[a0].metadata.uid == second["a-0"]
        assert pods[a0].status.phase == "Failed"
        assert pods[a1].metadata.uid == first["a-1"]
        time.sleep(0.2)
    status = cl.job(job)["status"]
    assert [(s["id"], s["replacements"], s["limitReached"]) for s in status["slots"]] == [
        ("a-0", 1, True)
    ]
    assert status["groups"][0]["slotReplacements"] == [1, 0]
    assert operator.running()


def test_missing_or_broken_kubeconfig_secret_degrades_and_recovers(
    k8s: Any, cl: h.Clusters, operator: h.Operator
) -> None:
    job = h.create_job(
        cl,
        h.job_manifest(
            "kc", [{"name": "a", "replicas": 1}, h.remote("region-b", 1, "rb-kubeconfig")]
        ),
    )
    missing = h.wait_condition(cl, job, "Degraded", reason="KubeconfigSecretMissing")
    assert "rb-kubeconfig" in h.condition(missing, "Degraded")["message"]
    assert missing["status"]["phase"] == "Degraded"
    # the rest of the job goes on: home's learner pod is there
    k8senv.wait_until("the home learner", lambda: h.running_uids(cl, ["home"], job), 20)

    h.kubeconfig_secret(cl, "rb-kubeconfig", None, text="clusters: [this is: not, a kubeconfig")
    broken = h.wait_condition(cl, job, "Degraded", reason="KubeconfigSecretInvalid")
    assert "rb-kubeconfig" in h.condition(broken, "Degraded")["message"]
    assert operator.running()

    h.kubeconfig_secret(cl, "rb-kubeconfig", "region-b")
    fixed = h.wait_condition(cl, job, "Ready", timeout=30)
    assert h.condition(fixed, "Degraded")["status"] == "False"
    assert h.running_uids(cl, ["region-b"], job).keys() == {"region-b-0"}
    # credentials and tokens stay out of the operator's log
    log = operator.log.read_text()
    assert k8s.clusters["region-b"].token not in log
    token = cl.core().read_namespaced_secret(f"{job}-token", cl.ns).data["token"]
    assert base64.b64decode(token).decode() not in log
