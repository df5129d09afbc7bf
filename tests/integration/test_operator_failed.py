"""A job that cannot go on says Failed, with its reason, on a real control plane.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_failed.py

Two jobs side by side under one operator:

- every learner slot fails with no replacement left (kwok's container-failed stage):
  Failed, reason LearnersExhausted, a `Failed` event, status.components counting the failed
  slots, the failed pods kept for their logs and the synchronizer kept;
- the synchronizer's container crash-loops on exit code 2 (its pod status written as a
  kubelet writes it: CrashLoopBackOff, the last termination's message holding its one-line
  error): Failed, reason SynchronizerStateUnusable quoting that line, the learners deleted
  and the synchronizer scaled to zero with its state claim kept.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import k8senv
import operator_helpers as h
import pytest
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration
KWOK_FAIL = "pod-container-running-failed.stage.kwok.x-k8s.io"
REFUSED = "ddiloco synchronizer: error: /state/layout.json has format 9, this synchronizer reads 3"


def events(cl: h.Clusters, job: str, reason: str) -> list[Any]:
    found = cl.core().list_namespaced_event(cl.ns, field_selector=f"involvedObject.name={job}")
    return [e for e in found.items if e.reason == reason]


def counts(job: dict[str, Any], name: str) -> dict[str, int]:
    entry = next(x for x in job["status"]["components"] if x["name"] == name)
    return {k: entry.get(k, 0) for k in ("active", "ready", "succeeded", "failed", "suspended")}


def fail_pod(cl: h.Clusters, name: str) -> None:
    cl.core().patch_namespaced_pod(
        name,
        cl.ns,
        {
            "metadata": {
                "labels": {KWOK_FAIL: "true"},
                "annotations": {f"{KWOK_FAIL}/reason": "Error", f"{KWOK_FAIL}/exit-code": "1"},
            }
        },
    )


def crash_loop(cl: h.Clusters, pod: Any) -> None:
    """Write the synchronizer pod's status as a kubelet does after its container exited 2
    three times: waiting in CrashLoopBackOff, the last termination's message its log tail."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    cl.core().patch_namespaced_pod_status(
        pod.metadata.name,
        cl.ns,
        {
            "status": {
                "conditions": [
                    {"type": "Ready", "status": "False", "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": "False", "lastTransitionTime": now},
                ],
                "containerStatuses": [
                    {
                        "name": "synchronizer",
                        "image": pod.spec.containers[0].image,
                        "imageID": "",
                        "ready": False,
                        "started": False,
                        "restartCount": 3,
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {
                            "terminated": {
                                "exitCode": 2,
                                "reason": "Error",
                                "message": f"INFO Starting synchronizer\n{REFUSED}\n",
                                "startedAt": now,
                                "finishedAt": now,
                            }
                        },
                    }
                ],
            }
        },
    )


def test_a_job_that_cannot_go_on_fails_with_its_reason_and_counts(
    cl: h.Clusters, operator: h.Operator
) -> None:
    limit0 = {"backoffSeconds": 0.5, "maxReplacementsPerSlot": 0}
    exhausted = h.create_job(
        cl, h.job_manifest("exh", [{"name": "a", "replicas": 2}], failurePolicy=limit0)
    )
    refused = h.create_job(cl, h.job_manifest("bad", [{"name": "a", "replicas": 1}]))
    for job in (exhausted, refused):
        ready = h.wait_condition(cl, job, "Ready")
        assert counts(ready, "learners-a")["ready"] == ready["spec"]["learnerGroups"][0]["replicas"]
        assert counts(ready, "synchronizer") == {
            "active": 1, "ready": 1, "succeeded": 0, "failed": 0, "suspended": 0,
        }  # fmt: skip

    # 1. every slot fails, none may be replaced: LearnersExhausted
    victims = sorted(p.metadata.name for p in cl.pods("home", exhausted))
    for name in victims:
        fail_pod(cl, name)
    # 2. the synchronizer refuses its state dir, again and again
    (sync_pod,) = (
        cl.core()
        .list_namespaced_pod(
            cl.ns,
            label_selector=f"ddiloco.dev/job={refused},app.kubernetes.io/component=synchronizer",
        )
        .items
    )
    crash_loop(cl, sync_pod)

    failed = h.wait_condition(cl, exhausted, "Failed", reason="LearnersExhausted", timeout=30)
    assert failed["status"]["phase"] == "Failed"
    assert h.condition(failed, "Ready")["reason"] == "LearnersExhausted"
    assert not h.condition(failed, "Complete")
    assert "a-0 (Error), a-1 (Error)" in h.condition(failed, "Failed")["message"]
    assert counts(failed, "learners-a") == {
        "active": 0, "ready": 0, "succeeded": 0, "failed": 2, "suspended": 0,
    }  # fmt: skip
    assert k8senv.wait_until("a Failed event", lambda: events(cl, exhausted, "Failed"), timeout=10)
    assert sorted(p.metadata.name for p in cl.pods("home", exhausted)) == victims  # kept
    sts = cl.apps().read_namespaced_stateful_set(f"{exhausted}-synchronizer", cl.ns)
    assert sts.spec.replicas == 1  # the model stays reachable

    broken = h.wait_condition(cl, refused, "Failed", reason="SynchronizerStateUnusable", timeout=30)
    message = h.condition(broken, "Failed")["message"]
    assert REFUSED in message and sync_pod.metadata.name in message, message
    assert h.condition(broken, "SynchronizerReady")["reason"] == "SynchronizerStateUnusable"

    def stopped() -> dict[str, Any] | None:
        job = cl.job(refused)
        sts = cl.apps().read_namespaced_stateful_set(f"{refused}-synchronizer", cl.ns)
        quiet = not cl.pods("home", refused) and sts.spec.replicas == 0
        return job if quiet and counts(job, "synchronizer")["active"] == 0 else None

    after = k8senv.wait_until("the learners gone, the synchronizer at zero", stopped, timeout=30)
    assert after["status"]["phase"] == "Failed"
    assert counts(after, "learners-a")["active"] == 0
    claim = cl.core().read_namespaced_persistent_volume_claim(
        f"state-{refused}-synchronizer-0", cl.ns
    )
    assert claim.metadata.deletion_timestamp is None  # its state kept, to repair
    assert len(events(cl, refused, "Failed")) == 1
