"""The status tells the truth, on a real control plane.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_status.py

- a job name no Service may have is refused by the CRD, with the rule's message;
- an OOMKilled learner (kwok's container-failed stage, as a kubelet writes it) reads
  OOMKilled, with its exit code and last log lines, in the events that outlive the pod;
- scaling keeps every learner's data part unique: within spec.training.dataParts nobody
  restarts, past an unset one every learner moves to its new shard;
- the status of the CRD's largest spec, at its worst, is accepted by the apiserver.

The synchronizer status endpoint is operator_helpers' stub (the pods never run), so "Ready"
here means what it means in production: the synchronizer answered.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import k8senv
import operator_helpers as h
import pytest
from kubernetes.client.exceptions import ApiException
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

from ddiloco.operator import api, builders, slots
from ddiloco.operator.plan import ClusterView, Observed, PodView, home
from ddiloco.operator.reconcile import reconcile
from ddiloco.operator.slots import Slot

pytestmark = pytest.mark.integration
KWOK_FAIL = "pod-container-running-failed.stage.kwok.x-k8s.io"


def pod_of(cl: h.Clusters, cluster: str, job: str, lid: str) -> Any:
    return next(
        p for p in cl.pods(cluster, job) if p.metadata.labels["ddiloco.dev/learner-id"] == lid
    )


def events(cl: h.Clusters, job: str, reason: str) -> list[Any]:
    found = cl.core().list_namespaced_event(cl.ns, field_selector=f"involvedObject.name={job}")
    return [e for e in found.items if e.reason == reason]


def shards(cl: h.Clusters, cluster: str, job: str) -> dict[str, tuple[int, int, str]]:
    """learner id -> (DDILOCO_LEARNER_INDEX, DDILOCO_NUM_LEARNERS, pod uid) of live pods."""
    out = {}
    for p in cl.pods(cluster, job):
        if p.metadata.deletion_timestamp or p.status.phase != "Running":
            continue
        env = {e.name: e.value for e in p.spec.containers[0].env}
        label = p.metadata.labels["ddiloco.dev/data-part"]
        index, count = int(env["DDILOCO_LEARNER_INDEX"]), int(env["DDILOCO_NUM_LEARNERS"])
        assert label == f"{index}-of-{count}"
        out[p.metadata.labels["ddiloco.dev/learner-id"]] = (index, count, p.metadata.uid)
    return out


def settled(cl: h.Clusters, job: str, want: int) -> dict[str, tuple[int, int, str]]:
    def probe() -> dict[str, tuple[int, int, str]] | None:
        table = shards(cl, "home", job)
        ready = h.condition(cl.job(job), "Ready").get("status") == "True"
        return table if ready and len(table) == want == len(cl.pods("home", job)) else None

    return k8senv.wait_until(f"{want} learners Ready", probe, timeout=40)


def patch_spec(cl: h.Clusters, job: str, spec: dict[str, Any]) -> None:
    cl.custom().patch_namespaced_custom_object(
        h.GROUP, h.VERSION, cl.ns, h.PLURAL, job, {"spec": spec}
    )


@pytest.mark.parametrize("name", ["tiny.v2", "a" * 41, "9lives"])
def test_names_no_service_may_have_are_refused_by_the_crd(cl: h.Clusters, name: str) -> None:
    body = h.job_manifest(name, [{"name": "a", "replicas": 1}])
    with pytest.raises(ApiException) as e:
        h.create_job(cl, body, volume=False)
    assert e.value.status == 422
    assert "metadata.name" in json.loads(e.value.body)["message"]


def test_an_oom_killed_learner_says_so_and_its_last_lines_outlive_it(
    cl: h.Clusters, operator: h.Operator
) -> None:
    job = h.create_job(cl, h.job_manifest("oom", [{"name": "a", "replicas": 2}]))
    h.wait_condition(cl, job, "Ready")
    victim = pod_of(cl, "home", job, "a-1")
    assert victim.spec.containers[0].termination_message_policy == "FallbackToLogsOnError"
    # (kwok's template puts the message into YAML unquoted: one line, no ": ")
    lines = "step 119 loss 2.30 - torch.OutOfMemoryError - CUDA out of memory"
    cl.core().patch_namespaced_pod(
        victim.metadata.name,
        cl.ns,
        {
            "metadata": {
                "labels": {KWOK_FAIL: "true"},
                "annotations": {
                    f"{KWOK_FAIL}/reason": "OOMKilled",
                    f"{KWOK_FAIL}/exit-code": "137",
                    f"{KWOK_FAIL}/message": lines,
                },
            }
        },
    )
    failed = k8senv.wait_until(
        "a LearnerFailed event", lambda: events(cl, job, "LearnerFailed"), timeout=30
    )
    message = failed[0].message
    assert "slot a-1 ended with OOMKilled (exit code 137)" in message, message
    assert message.endswith("CUDA out of memory"), message
    replaced = k8senv.wait_until(
        "a LearnerReplaced event", lambda: events(cl, job, "LearnerReplaced"), timeout=30
    )
    assert "slot a-1 after OOMKilled" in replaced[0].message
    after = h.wait_condition(cl, job, "Ready")
    assert pod_of(cl, "home", job, "a-1").metadata.uid != victim.metadata.uid
    assert pod_of(cl, "home", job, "a-1").metadata.labels["ddiloco.dev/attempt"] == "1"
    assert after["status"]["groups"][0]["slotReplacements"] == [0, 1]


def test_scaling_within_data_parts_keeps_every_learner_and_its_shard(
    cl: h.Clusters, operator: h.Operator
) -> None:
    groups = [{"name": "a", "replicas": 2}, {"name": "b", "replicas": 2}]
    job = h.create_job(
        cl, h.job_manifest("shd", groups, training={"model": "tiny", "dataParts": 8})
    )
    before = settled(cl, job, 4)
    assert {k: v[:2] for k, v in before.items()} == {
        "a-0": (0, 8), "a-1": (1, 8), "b-0": (2, 8), "b-1": (3, 8),
    }  # fmt: skip
    patch_spec(cl, job, {"learnerGroups": [{"name": "a", "replicas": 3}, groups[1]]})
    after = settled(cl, job, 5)
    assert {k: after[k] for k in before} == before  # same pods, same shards
    assert after["a-2"][:2] == (4, 8)  # not b-0's 2
    status = cl.job(job)["status"]
    assert status["dataParts"] == 8 and status["phase"] == "Running"
    # past dataParts: refused by the CRD, before anything happens
    with pytest.raises(ApiException) as e:
        patch_spec(cl, job, {"learnerGroups": [{"name": "a", "replicas": 7}, groups[1]]})
    assert "dataParts" in json.loads(e.value.body)["message"]


def test_a_scale_up_past_the_shard_count_moves_every_learner_to_a_unique_shard(
    cl: h.Clusters, operator: h.Operator
) -> None:
    groups = [{"name": "a", "replicas": 2}, {"name": "b", "replicas": 2}]
    job = h.create_job(cl, h.job_manifest("rsh", groups))
    before = settled(cl, job, 4)
    assert sorted(v[:2] for v in before.values()) == [(i, 4) for i in range(4)]
    patch_spec(cl, job, {"learnerGroups": [{"name": "a", "replicas": 3}, groups[1]]})

    def resharded() -> dict[str, tuple[int, int, str]] | None:
        table = settled(cl, job, 5)
        return table if all(v[1] == 5 for v in table.values()) else None

    after = k8senv.wait_until("every learner on 5 shards", resharded, timeout=60)
    assert sorted(v[0] for v in after.values()) == [0, 1, 2, 3, 4]  # unique
    assert all(after[k][2] != before[k][2] for k in before)  # restarted on the new shard
    status = cl.job(job)["status"]
    assert status["dataParts"] == 5
    assert all(g["replaced"] == 0 for g in status["groups"])  # not failures
    assert events(cl, job, "DataRedivided")


def test_the_largest_spec_at_its_worst_status_is_accepted(cl: h.Clusters) -> None:
    # No operator: it would make 8192 pods. The status is computed here and written as the
    # operator writes it (replace of the status subresource).
    name = "j" * api.MAX_JOB_NAME
    groups = [
        {"name": f"g{n:02d}" + "x" * (api.MAX_GROUP_NAME - 3), "replicas": api.MAX_REPLICAS}
        for n in range(api.MAX_GROUPS)
    ]
    body = h.job_manifest(name, groups, failurePolicy={"maxReplacementsPerSlot": 0})
    body["spec"]["synchronizer"]["quorum"] = api.MAX_GROUPS * api.MAX_REPLICAS
    body["spec"]["synchronizer"]["tls"] = {"enabled": False}  # certificates are no status
    h.create_job(cl, body, volume=False)
    stored = cl.job(name)
    job = api.DecoupledDiLoCoJob.from_body(stored)

    # 1. a real reconcile pass: every slot's pod failed at once with a long message
    pods = []
    for g in job.spec.learner_groups:
        for i in range(g.replicas):
            pod = builders.build_learner_pod(job, g, i)
            pod["metadata"]["uid"] = f"{g.name}-{i}"
            pod["status"] = {
                "phase": "Failed",
                "containerStatuses": [
                    {"name": "learner", "state": {"terminated": {
                        "reason": "OOMKilled", "exitCode": 137, "message": "x" * 2048}}}
                ],
            }  # fmt: skip
            view = PodView.from_k8s(pod)
            assert view is not None
            pods.append(view)
    obs = Observed(
        now=datetime.now(UTC),
        clusters={home(job): ClusterView(pods=tuple(pods), token="t")},
        statefulset={"status": {"availableReplicas": 1}},
        service=True,
        shards_service=True,
        sync_status={"global_version": 1},
    )
    plan = reconcile(job, obs, fresh_token="t")
    assert plan.status is not None and plan.status.unhealthy_slots == 8192

    # 2. the worst the books can hold: every slot failed at its own second, each reason new
    t0 = datetime.now(UTC)
    worst_groups = []
    for g, gs in zip(job.spec.learner_groups, plan.status.groups, strict=True):
        recs = [
            Slot(
                g.name, i, failed=True, replacements=10_000, shard=i,
                reason=f"{g.name}{i:04d}" + "R" * 64,
                time=(t0 + timedelta(seconds=i)).strftime("%Y-%m-%dT%H:%M:%SZ"),
            )
            for i in range(g.replicas)
        ]  # fmt: skip
        worst_groups.append(slots.encode(gs, recs))
    worst = plan.status.model_copy(update={"groups": worst_groups})

    for status in (plan.status, worst):
        doc = status.model_dump(by_alias=True, exclude_none=True, mode="json")
        current = cl.job(name)
        written = cl.custom().replace_namespaced_custom_object_status(
            h.GROUP, h.VERSION, cl.ns, h.PLURAL, name, {**current, "status": doc}
        )
        size = len(json.dumps(written))
        print(f"stored object with status: {size} bytes")
        assert written["status"]["unhealthySlots"] == 8192
        assert written["status"]["groups"] == doc["groups"]  # nothing pruned
        assert size < 512 * 1024
    cl.custom().delete_namespaced_custom_object(h.GROUP, h.VERSION, cl.ns, h.PLURAL, name)
