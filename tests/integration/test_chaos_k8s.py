"""The chaos schedule applied to pods on a real apiserver (local/k8s_chaos.py).

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_chaos_k8s.py

Pods are plain labelled pods on kwok's fake nodes, labelled as the operator labels a job's
learners and synchronizer; the schedule kills one learner, partitions another (a deny-all
NetworkPolicy created, then deleted), evicts a scavenged one, kills the synchronizer and
records the pause it cannot apply.
"""

from __future__ import annotations

from typing import Any

import k8senv
import pytest
from kubernetes import client

from ddiloco.local.chaos import SYNCHRONIZER, ChaosEvent, Schedule
from ddiloco.local.k8s_chaos import (
    LABEL_COMPONENT,
    LABEL_JOB,
    LABEL_LEARNER_ID,
    PodChaos,
    plan,
    policy_name,
)

pytestmark = pytest.mark.integration
JOB = "chaos-job"


def pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {LABEL_JOB: JOB, **labels}},
        "spec": {
            "containers": [{"name": "c", "image": "ddiloco:test"}],
            "tolerations": [{"operator": "Exists"}],
        },
    }


def running(core: client.CoreV1Api, ns: str, name: str) -> bool:
    p = core.read_namespaced_pod(name, ns)
    return p.status.phase == "Running" and p.metadata.deletion_timestamp is None


def gone(core: client.CoreV1Api, ns: str, name: str) -> bool:
    try:
        p = core.read_namespaced_pod(name, ns)
    except client.exceptions.ApiException as e:
        return e.status == 404
    return p.metadata.deletion_timestamp is not None


def test_schedule_deletes_evicts_and_isolates_pods(k8s: Any, k8s_namespace: str) -> None:
    ns = k8s_namespace
    api = k8s.home.api_client()
    core = client.CoreV1Api(api)
    net = client.NetworkingV1Api(api)
    for i in range(3):
        core.create_namespaced_pod(ns, pod(f"learner-{i}", {LABEL_LEARNER_ID: f"learner-{i}"}))
    core.create_namespaced_pod(ns, pod("sync", {LABEL_COMPONENT: "synchronizer"}))
    for name in ("learner-0", "learner-1", "learner-2", "sync"):
        k8senv.wait_until(f"pod {name} running", lambda n=name: running(core, ns, n))

    schedule = Schedule(
        kind="test",
        seed=0,
        events=[
            ChaosEvent(0.0, "partition", "learner-0", 0.6),
            ChaosEvent(0.1, "kill", "learner-1", 2.0),
            ChaosEvent(0.2, "pause", "learner-0", 1.0),
            ChaosEvent(0.3, "remove", "learner-2", 0.0),
            ChaosEvent(0.4, "kill_sync", SYNCHRONIZER, 2.0),
        ],
    )
    assert [a.verb for a in plan(schedule, JOB)] == [
        "isolate",
        "delete",
        "skip",
        "evict",
        "delete",
        "heal",
    ]
    chaos = PodChaos(api, ns, job=JOB)
    seen_policy: list[str] = []
    real_apply = chaos.apply

    def apply_and_look(action: Any) -> dict[str, Any]:
        rec = real_apply(action)
        if action.verb == "isolate":  # the deny-all policy exists while the cut lasts
            got = net.read_namespaced_network_policy(policy_name("learner-0"), ns)
            assert got.spec.pod_selector.match_labels == {
                LABEL_LEARNER_ID: "learner-0",
                LABEL_JOB: JOB,
            }
            assert got.spec.ingress in (None, []) and got.spec.egress in (None, [])
            seen_policy.append(got.metadata.name)
        return rec

    chaos.apply = apply_and_look  # type: ignore[method-assign]
    records = chaos.run(schedule)

    assert seen_policy == [policy_name("learner-0")]
    assert not [r for r in records if "error" in r], records
    by_verb = {(r["verb"], r["target"]): r for r in records}
    assert by_verb[("delete", "learner-1")]["pods"] == ["learner-1"]
    assert by_verb[("evict", "learner-2")]["pods"] == ["learner-2"]
    assert by_verb[("delete", SYNCHRONIZER)]["pods"] == ["sync"]
    assert "container" in by_verb[("skip", "learner-0")]["reason"]
    for name in ("learner-1", "learner-2", "sync"):
        k8senv.wait_until(f"pod {name} gone", lambda n=name: gone(core, ns, n))
    assert running(core, ns, "learner-0")  # partitioned and paused, never deleted
    names = [p.metadata.name for p in net.list_namespaced_network_policy(ns).items]
    assert policy_name("learner-0") not in names  # healed


def test_refusals_are_recorded_not_raised(k8s: Any, k8s_namespace: str) -> None:
    """Healing a partition whose policy someone already removed: a 404 in the record."""
    chaos = PodChaos(k8s.home.api_client(), k8s_namespace)
    sched = Schedule(kind="t", seed=0, events=[ChaosEvent(0.0, "partition", "learner-9", 1.0)])
    actions = plan(sched)
    assert [a.verb for a in actions] == ["isolate", "heal"]
    assert "error" not in chaos.apply(actions[0])
    client.NetworkingV1Api(k8s.home.api_client()).delete_namespaced_network_policy(
        policy_name("learner-9"), k8s_namespace
    )
    rec = chaos.apply(actions[1])
    assert rec["verb"] == "heal" and rec["error"].startswith("404")
