"""The pure reconcile of the operator (ddiloco.operator.reconcile), situation by situation.

    .venv/bin/pytest tests/unit/test_operator_reconcile.py

Each test builds a job and an observation by hand (no cluster), runs `reconcile`, and checks
the actions, the status and the events. `step()` feeds a plan's status back into the job, as
the operator does between two passes.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from ddiloco.operator import builders, sync_workload, tokens
from ddiloco.operator import conditions as c
from ddiloco.operator.api import DecoupledDiLoCoJob, SecretKeyRef
from ddiloco.operator.plan import (
    ClusterView,
    Observed,
    Plan,
    PodView,
    SecretView,
    Target,
    home,
    target_of,
    targets,
)
from ddiloco.operator.reconcile import reconcile
from ddiloco.wire import auth

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
TOKEN = "tok-123"
SYNC_URL = "https://sync.example:8470"
REMOTE = Target(SecretKeyRef(name="region-a-kubeconfig"), "ns")
SYNC_ANSWER: dict[str, Any] = {"global_version": 0}  # the synchronizer's status endpoint answers


def make_job(**spec: Any) -> DecoupledDiLoCoJob:
    body: dict[str, Any] = {
        "metadata": {"name": "tiny", "namespace": "ns", "uid": "job-1", "generation": 3},
        "spec": {
            "image": "ddiloco:dev",
            "training": {"model": "tiny"},
            # TLS (issuing, copying, renewing) has its own tests: test_operator_tls.py
            "synchronizer": {"tls": {"enabled": False}},
            "learnerGroups": [
                {"name": "home", "replicas": 2},
                {
                    "name": "ra",
                    "replicas": 1,
                    "cluster": {"kubeconfigSecret": {"name": "region-a-kubeconfig"}},
                    "syncUrl": SYNC_URL,
                },
            ],
            "failurePolicy": {"maxReplacementsPerSlot": 2, "backoffSeconds": 1},
        },
    }
    body["spec"].update(spec)
    return DecoupledDiLoCoJob.from_body(body)


def pod(
    group: str,
    index: int,
    uid: str,
    phase: str = "Running",
    ready: bool = True,
    terminating: bool = False,
    reason: str | None = None,
    job_uid: str = "job-1",
    attempt: int = 0,
) -> PodView:
    owner = SimpleNamespace(name="tiny", uid=job_uid)  # all learner_pod_name reads of a job
    return PodView(
        name=builders.learner_pod_name(owner, group, index),  # type: ignore[arg-type]
        uid=uid,
        job_uid=job_uid,
        group=group,
        index=index,
        phase=phase,
        ready=ready,
        terminating=terminating,
        reason=reason,
        attempt=attempt,
    )


def healthy_pods() -> tuple[tuple[PodView, ...], tuple[PodView, ...]]:
    return (pod("home", 0, "h0"), pod("home", 1, "h1")), (pod("ra", 0, "r0"),)


def observe(
    job: DecoupledDiLoCoJob,
    home_pods: tuple[PodView, ...] = (),
    remote_pods: tuple[PodView, ...] = (),
    now: datetime = T0,
    remote: ClusterView | None = None,
    available: bool = True,
    sync: dict[str, Any] | None = SYNC_ANSWER,
    service_ports: tuple[dict[str, Any], ...] | None = None,
) -> Observed:
    """`service_ports`: both Services' ports as read; by default those the builders make."""
    sts = sync_workload.build_synchronizer_statefulset(job)
    sts["status"] = {"availableReplicas": 1 if available else 0}
    built = tuple(sync_workload.build_synchronizer_service(job)["spec"]["ports"])
    return Observed(
        now=now,
        clusters={
            home(job): settled(job, home(job), ClusterView(pods=home_pods, token=TOKEN)),
            REMOTE: remote or settled(job, REMOTE, ClusterView(pods=remote_pods)),
        },
        statefulset=sts,
        service=True,
        shards_service=True,
        service_ports=built if service_ports is None else service_ports,
        shards_service_ports=built if service_ports is None else service_ports,
        sync_status=sync,
    )


def settled(job: DecoupledDiLoCoJob, tgt: Target, view: ClusterView) -> ClusterView:
    """`view` with what an earlier pass wrote there: each group's learner credentials under
    TOKEN (tokens.py), for the pods it holds."""
    found = dict(view.secrets)
    for group in job.spec.learner_groups:
        if target_of(job, group) == tgt:
            found[builders.learner_tokens_secret_name(job, group.name)] = SecretView(
                data=tokens.credentials(job, group, view, [TOKEN]), job_uid=job.uid
            )
    return dataclasses.replace(view, secrets=found)


def step(job: DecoupledDiLoCoJob, obs: Observed) -> tuple[DecoupledDiLoCoJob, Plan]:
    plan = reconcile(job, obs, fresh_token="fresh")
    if plan.status is not None:
        job = job.model_copy(update={"status": plan.status})
    return job, plan


def cond(job: DecoupledDiLoCoJob, type_: str) -> tuple[str, str]:
    found = c.get(job.status.conditions, type_)
    assert found is not None, type_
    return found.status, found.reason


def secret_data(body: dict[str, Any] | None) -> dict[str, bytes]:
    assert body is not None
    return {k: base64.b64decode(v) for k, v in body["data"].items()}


def verbs(plan: Plan) -> list[tuple[str, str, str]]:
    """(verb, kind, name); a pod's name without the tag that builders.learner_pod_name ends
    it with (tests/unit/test_operator_ownership.py checks the tags)."""
    return [
        (a.verb, a.kind, a.name.rsplit("-", 1)[0] if a.kind == "Pod" else a.name)
        for a in plan.actions
    ]


def test_a_new_job_creates_everything_everywhere() -> None:
    job = make_job()
    obs = Observed(now=T0, clusters={home(job): ClusterView(), REMOTE: ClusterView()})
    job, plan = step(job, obs)
    got = verbs(plan)
    assert ("create", "Secret", "tiny-token") in got
    assert {
        ("create", k, n)
        for k, n in [
            ("Service", "tiny-synchronizer"),
            ("Service", "tiny-synchronizer-shards"),
            ("StatefulSet", "tiny-synchronizer"),
        ]
    } <= set(got)
    assert not [a for a in plan.actions if a.kind == "PersistentVolumeClaim"]  # the sts's
    pods = [a for a in plan.actions if a.kind == "Pod"]
    assert sorted((a.name, a.target.label) for a in pods) == [
        (builders.learner_pod_name(job, "home", 0), "local"),
        (builders.learner_pod_name(job, "home", 1), "local"),
        (builders.learner_pod_name(job, "ra", 0), "region-a-kubeconfig"),
    ]
    # the key stays home; the region gets its learner's credential only, derived from the key
    remote_secret = [a for a in plan.actions if a.kind == "Secret" and a.target == REMOTE]
    assert [a.name for a in remote_secret] == [builders.learner_tokens_secret_name(job, "ra")]
    assert secret_data(remote_secret[0].body) == {
        "ra-0": auth.learner_token("fresh", "ra-0").encode()
    }
    home_secret = next(
        a for a in plan.actions if a.name == builders.learner_tokens_secret_name(job, "home")
    )
    assert secret_data(home_secret.body) == {
        f"home-{i}": auth.learner_token("fresh", f"home-{i}").encode() for i in (0, 1)
    }
    # each written before the pods that mount it
    kinds = [(a.kind, a.target) for a in plan.actions]
    for tgt in (home(job), REMOTE):
        assert kinds.index(("Secret", tgt)) < kinds.index(("Pod", tgt))
    assert job.status.phase == "Pending" and job.status.observed_generation == 3
    assert {x.type for x in job.status.conditions} == set(c.TYPES)
    assert cond(job, c.READY) == ("False", c.SYNCHRONIZER_NOT_READY)


def test_ready_when_synchronizer_and_every_learner_are() -> None:
    job = make_job()
    job, plan = step(
        job,
        observe(
            job,
            *healthy_pods(),
            sync={
                "global_version": 7,
                "merges": 12,
                "tokens_merged": 4096,
                "goodput": 0.9,
                "learners": [],
            },
        ),
    )
    assert plan.actions == []
    assert cond(job, c.READY) == ("True", c.JOB_READY)
    assert cond(job, c.DEGRADED) == ("False", c.AS_EXPECTED)
    assert job.status.phase == "Running"
    assert (job.status.ready_learners, job.status.desired_learners) == (3, 3)
    assert (job.status.global_version, job.status.tokens_merged, job.status.goodput) == (
        7,
        4096,
        0.9,
    )
    # the synchronizer going quiet keeps the last numbers
    job, _ = step(job, observe(job, *healthy_pods(), sync=None))
    assert job.status.global_version == 7 and job.status.synchronizer is not None
    assert job.status.synchronizer.reachable is False
    # and nothing changes on a further identical pass: no status write
    _, plan = step(job, observe(job, *healthy_pods(), sync=None))
    assert plan.status is None and plan.actions == []


def test_transition_time_moves_only_when_status_flips() -> None:
    job = make_job()
    job, _ = step(job, observe(job, *healthy_pods(), available=False))
    first = c.get(job.status.conditions, c.READY)
    job, _ = step(
        job, observe(job, *healthy_pods(), available=False, now=T0 + timedelta(seconds=5))
    )
    assert c.get(job.status.conditions, c.READY) == first
    job, _ = step(job, observe(job, *healthy_pods(), now=T0 + timedelta(seconds=9)))
    after = c.get(job.status.conditions, c.READY)
    assert after is not None and first is not None
    assert after.last_transition_time != first.last_transition_time


def as_read(ports: list[dict[str, Any]], **extra: Any) -> tuple[dict[str, Any], ...]:
    """Service ports as the apiserver answers them: what was sent, and fields it fills in."""
    return tuple({**p, **extra} for p in ports)


def test_services_of_an_older_operator_get_the_upload_port_by_a_ports_patch() -> None:
    job = make_job()
    built = sync_workload.build_synchronizer_service(job)["spec"]["ports"]
    assert [p["name"] for p in built] == ["http", "upload"]
    old = tuple(p for p in built if p["name"] == "http")  # an operator before the upload port's
    job, plan = step(job, observe(job, *healthy_pods(), service_ports=old))
    assert verbs(plan) == [
        ("patch", "Service", "tiny-synchronizer"),
        ("patch", "Service", "tiny-synchronizer-shards"),
    ]
    for action in plan.actions:
        # spec.ports only, the whole wanted list (a merge patch replaces it): never the
        # clusterIP, type or selector of a Service that exists
        assert action.target == home(job) and action.body == {"patch": {"spec": {"ports": built}}}
        assert action.event is not None and action.event.reason == "ServicePortsUpdated"
        assert action.event.message.endswith("ports: http 8470, upload 8471")
    assert plan.events == []  # each patch's event is posted once it is done
    # ports as the apiserver reads them back (nodePort and the like are not compared): no write
    again = observe(job, *healthy_pods(), service_ports=as_read(built, nodePort=None))
    assert step(job, again)[1].actions == []
    # not read (None): nothing to compare, nothing sent
    unread = dataclasses.replace(again, service_ports=None, shards_service_ports=None)
    assert step(job, unread)[1].actions == []


def test_service_ports_patch_gives_exactly_the_wanted_list() -> None:
    job = make_job()
    want = sync_workload.build_synchronizer_service(job)
    built = want["spec"]["ports"]
    http, upload = built
    patch = sync_workload.service_ports_patch
    assert patch(want, as_read(built)) is None
    assert patch(want, None) is None
    # a stale port goes, the missing one comes, the order is the builder's
    stale = {"name": "old", "port": 9000, "targetPort": 9000, "protocol": "TCP"}
    for have in ([http, stale], [upload, http], [], [http, upload, stale]):
        assert patch(want, have) == {"spec": {"ports": built}}, have
    # every compared field counts: TLS turned on makes both ports' appProtocol https
    tls = make_job(synchronizer={"tls": {"enabled": True}})
    got = patch(sync_workload.build_synchronizer_service(tls), as_read(built))
    assert got is not None and [p["appProtocol"] for p in got["spec"]["ports"]] == ["https"] * 2
    assert patch(want, [{**http, "targetPort": 8470}, upload]) == {"spec": {"ports": built}}
    # a nodePort the Service has (one made a NodePort by hand) stays with its port
    got = patch(want, [{**http, "nodePort": 30470}])
    assert got == {"spec": {"ports": [{**http, "nodePort": 30470}, upload]}}


def test_evicted_pod_is_replaced_in_its_slot_and_counted_once() -> None:
    job = make_job()
    home_pods, remote_pods = healthy_pods()
    job, _ = step(job, observe(job, home_pods, remote_pods))
    # kubelet (or kwok) fails home-1 with reason Evicted
    failed = (home_pods[0], pod("home", 1, "h1", phase="Failed", ready=False, reason="Evicted"))
    job, plan = step(job, observe(job, failed, remote_pods, now=T0 + timedelta(seconds=1)))
    assert verbs(plan) == [("delete", "Pod", "tiny-home-1")]
    assert plan.actions[0].uid == "h1" and plan.actions[0].grace_seconds == 0
    assert [e.reason for e in plan.events] == ["LearnerFailed"]
    slot = next(s for s in job.status.slots if s.id == "home-1")
    assert (slot.last_failure_reason, slot.replacements) == ("Evicted", 0)
    # gone, but within the backoff: wait
    _, plan = step(job, observe(job, home_pods[:1], remote_pods, now=T0 + timedelta(seconds=1)))
    assert plan.actions == []
    # after the backoff: a new pod with the same name, nothing else touched
    job, plan = step(job, observe(job, home_pods[:1], remote_pods, now=T0 + timedelta(seconds=3)))
    assert verbs(plan) == [("create", "Pod", "tiny-home-1")]
    env = {e["name"]: e.get("value") for e in plan.actions[0].body["spec"]["containers"][0]["env"]}
    assert env["DDILOCO_LEARNER_ID"] == "home-1" and env["DDILOCO_LEARNER_INDEX"] == "1"
    # the replacement shows up: counted once, with an event
    new = (home_pods[0], pod("home", 1, "h1-new", attempt=1))
    job, plan = step(job, observe(job, new, remote_pods, now=T0 + timedelta(seconds=4)))
    assert [e.reason for e in plan.events] == ["LearnerReplaced"]
    job, plan = step(job, observe(job, new, remote_pods, now=T0 + timedelta(seconds=5)))
    assert plan.events == []
    group = next(g for g in job.status.groups if g.name == "home")
    assert group.slot_replacements == [0, 1] and group.replaced == 1
    assert job.status.slots == []  # healthy again: no detail
    assert cond(job, c.READY) == ("True", c.JOB_READY)


def test_eviction_api_terminating_pod_waits_then_is_replaced() -> None:
    job = make_job(failurePolicy={"backoffSeconds": 0})
    home_pods, remote_pods = healthy_pods()
    job, _ = step(job, observe(job, home_pods, remote_pods))
    evicting = (pod("ra", 0, "r0", terminating=True, reason="EvictionByEvictionAPI"),)
    job, plan = step(job, observe(job, home_pods, evicting))
    assert plan.actions == []  # the kubelet finishes it; we never force a running pod
    assert (
        next(s for s in job.status.slots if s.id == "ra-0").last_failure_reason
        == "EvictionByEvictionAPI"
    )
    job, plan = step(job, observe(job, home_pods, ()))
    assert verbs(plan) == [("create", "Pod", "tiny-ra-0")] and plan.actions[0].target == REMOTE
    assert "ownerReferences" not in plan.actions[0].body["metadata"]  # cannot cross clusters


def test_pod_that_vanished_counts_as_deleted() -> None:
    job = make_job(failurePolicy={"backoffSeconds": 0})
    home_pods, remote_pods = healthy_pods()
    job, _ = step(job, observe(job, home_pods, remote_pods))
    job, plan = step(job, observe(job, home_pods[1:], remote_pods))
    assert verbs(plan) == [("create", "Pod", "tiny-home-0")]
    assert next(s for s in job.status.slots if s.id == "home-0").last_failure_reason == "Deleted"


def test_past_the_limit_the_job_is_degraded_and_stops_replacing() -> None:
    job = make_job(failurePolicy={"maxReplacementsPerSlot": 1, "backoffSeconds": 0})
    home_pods, remote_pods = healthy_pods()
    job, _ = step(job, observe(job, home_pods, remote_pods))
    uid = "h0"
    for n in range(2):
        dead = (pod("home", 0, uid, phase="Failed", reason="Preempted", attempt=n), home_pods[1])
        job, plan = step(job, observe(job, dead, remote_pods))
        if n == 0:
            assert ("delete", "Pod", "tiny-home-0") in verbs(plan)
            job, plan = step(job, observe(job, home_pods[1:], remote_pods))
            assert verbs(plan) == [("create", "Pod", "tiny-home-0")]
            uid = "h0-2"
            job, _ = step(
                job, observe(job, (pod("home", 0, uid, attempt=1), home_pods[1]), remote_pods)
            )
    assert plan.actions == []  # the failed pod stays for its logs; no new pod
    assert cond(job, c.DEGRADED) == ("True", c.REPLACEMENT_LIMIT_REACHED)
    degraded = c.get(job.status.conditions, c.DEGRADED)
    assert degraded is not None and "home-0" in degraded.message
    assert job.status.phase == "Degraded" and cond(job, c.READY)[1] == c.DEGRADED_REASON
    _, plan = step(job, observe(job, home_pods[1:], remote_pods))
    assert plan.actions == []


def test_a_crash_between_create_and_status_still_counts_once() -> None:
    job = make_job(failurePolicy={"backoffSeconds": 0})
    home_pods, remote_pods = healthy_pods()
    job, _ = step(job, observe(job, home_pods, remote_pods))
    job, _ = step(
        job, observe(job, (pod("home", 0, "h0", phase="Failed"), home_pods[1]), remote_pods)
    )
    # the operator created the replacement and died before writing status: replay both passes
    replay = observe(job, (pod("home", 0, "h0-new", attempt=1), home_pods[1]), remote_pods)
    first, plan1 = step(job, replay)
    again, plan2 = step(job, replay)
    assert first.status.groups[0].slot_replacements == [1, 0]
    assert again.status.groups[0].slot_replacements == [1, 0]
    assert plan1.actions == plan2.actions == []


def test_unreachable_cluster_degrades_and_names_the_secret() -> None:
    job = make_job()
    home_pods, _ = healthy_pods()
    broken = ClusterView(
        problem=(c.KUBECONFIG_SECRET_MISSING, "Secret ns/region-a-kubeconfig was not found")
    )
    job, plan = step(job, observe(job, home_pods, remote=broken))
    assert all(a.target != REMOTE for a in plan.actions)
    assert cond(job, c.DEGRADED) == ("True", c.KUBECONFIG_SECRET_MISSING)
    degraded = c.get(job.status.conditions, c.DEGRADED)
    assert degraded is not None and "region-a-kubeconfig" in degraded.message
    assert job.status.phase == "Degraded"
    # fixed: the slot's pod is created and the condition clears once it runs
    job, plan = step(job, observe(job, home_pods, ()))
    assert ("create", "Pod", "tiny-ra-0") in verbs(plan)
    job, _ = step(job, observe(job, home_pods, (pod("ra", 0, "r0"),)))
    assert cond(job, c.DEGRADED)[0] == "False" and cond(job, c.READY)[0] == "True"


def test_scaling_adds_and_removes_the_highest_slots() -> None:
    job = make_job()
    home_pods, remote_pods = healthy_pods()
    job, _ = step(job, observe(job, home_pods, remote_pods))
    up = make_job(
        learnerGroups=[
            {"name": "home", "replicas": 3},
            {
                "name": "ra",
                "replicas": 1,
                "cluster": {"kubeconfigSecret": {"name": "region-a-kubeconfig"}},
                "syncUrl": SYNC_URL,
            },
        ]
    )
    up = up.model_copy(update={"status": job.status})
    _, plan = step(up, observe(up, home_pods, remote_pods))
    assert verbs(plan) == [("create", "Pod", "tiny-home-2")]
    env = {e["name"]: e.get("value") for e in plan.actions[0].body["spec"]["containers"][0]["env"]}
    assert (env["DDILOCO_LEARNER_INDEX"], env["DDILOCO_NUM_LEARNERS"]) == ("2", "4")
    down = make_job(
        learnerGroups=[
            {"name": "home", "replicas": 1},
            {
                "name": "ra",
                "replicas": 1,
                "cluster": {"kubeconfigSecret": {"name": "region-a-kubeconfig"}},
                "syncUrl": SYNC_URL,
            },
        ]
    )
    down = down.model_copy(update={"status": job.status})
    down, plan = step(down, observe(down, home_pods, remote_pods))
    assert verbs(plan) == [("delete", "Pod", "tiny-home-1")]
    assert [len(g.parts) for g in down.status.groups] == [1, 1]
    assert down.status.slots == []
    assert not plan.events  # removing a slot is not a failure


def test_removed_group_is_cleaned_from_its_cluster() -> None:
    job = make_job()
    home_pods, remote_pods = healthy_pods()
    job, _ = step(job, observe(job, home_pods, remote_pods))
    only_home = make_job(learnerGroups=[{"name": "home", "replicas": 2}])
    only_home = only_home.model_copy(update={"status": job.status})
    assert REMOTE in targets(only_home)  # still looked at, from the status
    obs = observe(only_home, home_pods, remote=settled(job, REMOTE, ClusterView(pods=remote_pods)))
    job2, plan = step(only_home, obs)
    creds = builders.learner_tokens_secret_name(job, "ra")
    assert {("delete", "Pod", "tiny-ra-0"), ("delete", "Secret", creds)} <= set(verbs(plan))
    assert "ra" in [g.name for g in job2.status.groups]  # until its pods are gone
    gone = dataclasses.replace(obs.clusters[REMOTE], pods=())
    job2, plan = step(job2, dataclasses.replace(obs, clusters={**obs.clusters, REMOTE: gone}))
    assert ("delete", "Secret", creds) in verbs(plan)
    assert "ra" in [g.name for g in job2.status.groups]  # and its credentials
    job3, _ = step(
        job2,
        Observed(
            now=T0,
            clusters={home(job2): ClusterView(pods=home_pods, token=TOKEN), REMOTE: ClusterView()},
            statefulset=observe(job2).statefulset,
            service=True,
            shards_service=True,
        ),
    )
    assert [g.name for g in job3.status.groups] == ["home"]


def test_suspend_removes_learners_without_counting_failures() -> None:
    job = make_job()
    home_pods, remote_pods = healthy_pods()
    job, _ = step(job, observe(job, home_pods, remote_pods))
    suspended = make_job(suspend=True).model_copy(update={"status": job.status})
    suspended, plan = step(suspended, observe(job, home_pods, remote_pods))  # 1 replica still
    assert sorted(n for v, k, n in verbs(plan) if k == "Pod" and v == "delete") == [
        "tiny-home-0",
        "tiny-home-1",
        "tiny-ra-0",
    ]
    # the synchronizer accepts the learners' hand-overs until their pods are gone, then stops
    assert not [a for a in plan.actions if a.kind == "StatefulSet"]
    leaving = tuple(pod(p.group, p.index, p.uid, terminating=True) for p in home_pods)
    _, plan = step(suspended, observe(job, leaving, ()))
    assert not [a for a in plan.actions if a.kind == "StatefulSet"]
    _, plan = step(suspended, observe(job))
    sts = next(a for a in plan.actions if a.kind == "StatefulSet")
    assert sts.verb == "replace" and sts.body["spec"]["replicas"] == 0
    assert suspended.status.phase == "Suspended" and cond(suspended, c.READY)[1] == c.SUSPENDED
    _, plan = step(suspended, observe(suspended))
    assert not [a for a in plan.actions if a.kind == "Pod"]
    resumed = make_job().model_copy(update={"status": suspended.status})
    # resumed while the suspended pods are still terminating: they are not failures
    leaving = tuple(pod(p.group, p.index, p.uid, terminating=True) for p in home_pods)
    resumed, plan = step(resumed, observe(resumed, leaving, ()))
    assert not plan.events and resumed.status.slots == []  # no slot is failed
    resumed, plan = step(resumed, observe(resumed))
    assert len([a for a in plan.actions if a.kind == "Pod" and a.verb == "create"]) == 3
    assert resumed.status.slots == [] and resumed.status.groups[0].slot_replacements == []


def test_managed_by_someone_else_is_left_alone() -> None:
    job = make_job(managedBy="kueue.x-k8s.io/multikueue")
    plan = reconcile(job, Observed(now=T0, clusters={}), fresh_token="x")
    assert plan.actions == [] and plan.status is None


def test_pods_of_another_job_with_the_same_name_are_never_deleted() -> None:
    # An older job's leftover, or a same-named job's of another home namespace sharing the
    # remote namespace: not this job's uid, so not this job's to delete.
    job = make_job()
    stale = pod("home", 0, "old", job_uid="job-0")
    _, plan = step(job, observe(job, (stale,), ()))
    assert not [a for a in plan.actions if a.verb == "delete" and a.kind == "Pod"]
    assert ("create", "Pod", "tiny-home-0") in verbs(plan)  # its own pod, of another name
    created = next(a for a in plan.actions if a.kind == "Pod" and a.verb == "create")
    assert created.name != stale.name


def test_only_the_synchronizer_mounts_the_job_key() -> None:
    """Every pod a job makes, slots and hot spares at home and in a region, mounts one item
    of its group's credentials Secret (its own), the synchronizer alone the key."""
    job = make_job(failurePolicy={"hotSpares": 1})
    obs = Observed(now=T0, clusters={home(job): ClusterView(), REMOTE: ClusterView()})
    _, plan = step(job, obs)
    made = [a for a in plan.actions if a.kind in ("Pod", "StatefulSet") and a.verb == "create"]
    assert len([a for a in made if a.kind == "Pod"]) == 5  # 3 slots, a spare per group
    for action in made:
        assert action.body is not None
        spec = action.body["spec"]
        spec = spec["template"]["spec"] if action.kind == "StatefulSet" else spec
        secrets = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}
        if action.kind == "StatefulSet":
            assert secrets["token"]["secretName"] == "tiny-token"
            continue
        assert "tiny-token" not in [v["secretName"] for v in secrets.values()], action.name
        labels = action.body["metadata"]["labels"]
        group = labels[builders.LABEL_GROUP]
        own = labels.get(builders.LABEL_LEARNER_ID) or f"spare.{action.name}"
        assert secrets["token"] == {
            "secretName": builders.learner_tokens_secret_name(job, group),
            "defaultMode": 0o440,
            "items": [{"key": own, "path": "token"}],
        }


def test_a_removed_slots_credential_goes_with_its_pod() -> None:
    job = make_job()
    home_pods, remote_pods = healthy_pods()
    job, _ = step(job, observe(job, home_pods, remote_pods))
    name = builders.learner_tokens_secret_name(job, "home")
    fewer = make_job(learnerGroups=[{"name": "home", "replicas": 1}, job.spec.learner_groups[1]])
    fewer = fewer.model_copy(update={"status": job.status})
    obs = observe(job, home_pods, remote_pods)  # written for two slots, both pods there
    job2, plan = step(fewer, obs)
    assert ("delete", "Pod", "tiny-home-1") in verbs(plan)
    assert not [a for a in plan.actions if a.name == name]  # kept while its pod drains
    going = dataclasses.replace(home_pods[1], terminating=True)
    still = dataclasses.replace(obs.clusters[home(job)], pods=(home_pods[0], going))
    _, plan = step(job2, dataclasses.replace(obs, clusters={**obs.clusters, home(job): still}))
    assert not [a for a in plan.actions if a.name == name]
    gone = dataclasses.replace(still, pods=home_pods[:1])
    _, plan = step(job2, dataclasses.replace(obs, clusters={**obs.clusters, home(job): gone}))
    (action,) = [a for a in plan.actions if a.name == name]
    assert action.verb == "replace"
    assert secret_data(action.body) == {"home-0": auth.learner_token(TOKEN, "home-0").encode()}


def test_credentials_follow_the_key() -> None:
    """A changed key (a rotation's "new\\nold") rewrites every group's credentials in the
    same pass, one line per key, the new one first; an up-to-date Secret is left alone."""
    job = make_job()
    home_pods, remote_pods = healthy_pods()
    obs = observe(job, home_pods, remote_pods)
    assert not [a for a in step(job, obs)[1].actions if a.kind == "Secret"]
    rotated = dataclasses.replace(obs.clusters[home(job)], token=f"new\n{TOKEN}")
    _, plan = step(job, dataclasses.replace(obs, clusters={**obs.clusters, home(job): rotated}))
    written = {a.name: secret_data(a.body) for a in plan.actions if a.kind == "Secret"}
    assert written == {
        builders.learner_tokens_secret_name(job, "home"): {
            lid: auth.derived_lines(["new", TOKEN], "learner", lid).encode()
            for lid in ("home-0", "home-1")
        },
        builders.learner_tokens_secret_name(job, "ra"): {
            "ra-0": auth.derived_lines(["new", TOKEN], "learner", "ra-0").encode()
        },
    }


def test_invalid_spec_sets_a_condition_and_acts_nowhere() -> None:
    job = make_job(synchronizer={"quorum": 9})
    job, plan = step(job, observe(job))
    assert plan.actions == [] and job.status.phase == "Invalid"
    assert cond(job, c.READY) == ("False", c.INVALID_SPEC)


@pytest.mark.parametrize(
    ("k8s", "reason"),
    [
        ({"status": {"phase": "Failed", "reason": "Evicted"}}, "Evicted"),
        (
            {
                "status": {
                    "phase": "Running",
                    "conditions": [
                        {
                            "type": "DisruptionTarget",
                            "status": "True",
                            "reason": "PreemptionByScheduler",
                        }
                    ],
                }
            },
            "PreemptionByScheduler",
        ),
        ({"status": {"phase": "Running"}}, None),
    ],
)
def test_pod_view_reads_the_failure_reason(k8s: dict[str, Any], reason: str | None) -> None:
    body = {
        "metadata": {
            "name": "p",
            "uid": "u",
            "labels": {
                builders.LABEL_GROUP: "g",
                builders.LABEL_SLOT: "0",
                builders.LABEL_JOB_UID: "j",
            },
        },
        **k8s,
    }
    view = PodView.from_k8s(body)
    assert view is not None and view.reason == reason and (view.group, view.index) == ("g", 0)
    assert PodView.from_k8s({"metadata": {"name": "x"}}) is None


def test_a_group_can_target_another_namespace_in_its_cluster() -> None:
    job = make_job(
        learnerGroups=[
            {
                "name": "ra",
                "replicas": 1,
                "cluster": {
                    "kubeconfigSecret": {"name": "region-a-kubeconfig"},
                    "namespace": "training",
                },
                "syncUrl": SYNC_URL,
            }
        ]
    )
    there = Target(SecretKeyRef(name="region-a-kubeconfig"), "training")
    assert there in targets(job)
    obs = Observed(now=T0, clusters={home(job): ClusterView(token=TOKEN), there: ClusterView()})
    _, plan = step(job, obs)
    made = {(a.kind, a.target.namespace) for a in plan.actions if a.target == there}
    assert made == {("Pod", "training"), ("Secret", "training")}
    pod_action = next(a for a in plan.actions if a.kind == "Pod")
    assert pod_action.body is not None and pod_action.body["metadata"]["namespace"] == "training"


def test_a_status_with_nan_is_flagged_and_the_job_status_stays_writable() -> None:
    job = make_job()
    home_pods, remote_pods = healthy_pods()
    obs = observe(job, home_pods, remote_pods)
    sync = {**SYNC_ANSWER, "global_version": math.nan, "goodput": "high", "merges": 5}
    plan = reconcile(job, dataclasses.replace(obs, sync_status=sync), fresh_token="f")
    assert plan.status is not None
    dumped = plan.status.model_dump(by_alias=True, exclude_none=True, mode="json")
    json.dumps(dumped, allow_nan=False)  # what the apiserver would accept
    assert plan.status.merges == 5 and plan.status.global_version is None
    (deg,) = [x for x in plan.status.conditions if x.type == c.DEGRADED]
    assert (deg.status, deg.reason) == ("True", c.SYNCHRONIZER_STATUS_INVALID)
    assert "global_version" in deg.message and "goodput" in deg.message
    ready = next(x for x in plan.status.conditions if x.type == c.READY)
    assert ready.status == "False"


def test_a_group_moved_to_another_cluster_has_its_old_place_cleaned() -> None:
    """Its kubeconfig Secret edited to point at another apiserver: the status records where
    the group's objects were (server URL and namespace, no credentials), that place is
    observed and cleaned of the group's pods and credentials, then forgotten; its slots start
    in the new cluster without counting failures."""
    job = make_job()
    home_pods, remote_pods = healthy_pods()
    at_a = settled(job, REMOTE, ClusterView(pods=remote_pods, server="https://a"))
    job, _ = step(job, observe(job, home_pods, remote=at_a))
    (ra,) = [g for g in job.status.groups if g.name == "ra"]
    assert ra.server == "https://a" and ra.former == []

    at_b = settled(job, REMOTE, ClusterView(server="https://b"))
    job, plan = step(job, observe(job, home_pods, remote=at_b))
    (ra,) = [g for g in job.status.groups if g.name == "ra"]
    assert ra.server == "https://b"
    assert [(f.server, f.namespace, f.kubeconfig_secret) for f in ra.former] == [
        ("https://a", "ns", "region-a-kubeconfig")
    ]
    assert ("create", "Pod", "tiny-ra-0") in verbs(plan)
    assert ra.replaced == 0 and not ra.failed_slots  # a move is no failure
    left = Target(None, "ns", server="https://a")
    assert left in targets(job)

    creds = builders.learner_tokens_secret_name(job, "ra")
    there = ClusterView(
        pods=remote_pods,
        server="https://a",
        secrets={creds: SecretView(data={}, job_uid=job.uid)},
    )
    obs = observe(job, home_pods, remote=at_b)
    obs = dataclasses.replace(obs, clusters={**obs.clusters, left: there})
    job, plan = step(job, obs)
    gone = {(a.verb, a.kind, a.name) for a in plan.actions if a.target == left}
    assert gone == {("delete", "Pod", remote_pods[0].name), ("delete", "Secret", creds)}
    assert next(g for g in job.status.groups if g.name == "ra").former  # until it is clean

    obs = dataclasses.replace(obs, clusters={**obs.clusters, left: ClusterView(server="https://a")})
    job, plan = step(job, obs)
    assert next(g for g in job.status.groups if g.name == "ra").former == []
    assert left not in targets(job)


def test_a_place_left_that_cannot_be_reached_is_degraded_and_kept() -> None:
    job = make_job()
    home_pods, _ = healthy_pods()
    job, _ = step(
        job, observe(job, home_pods, remote=settled(job, REMOTE, ClusterView(server="https://a")))
    )
    job, _ = step(
        job, observe(job, home_pods, remote=settled(job, REMOTE, ClusterView(server="https://b")))
    )
    left = Target(None, "ns", server="https://a")
    obs = observe(job, home_pods, remote=settled(job, REMOTE, ClusterView(server="https://b")))
    down = ClusterView(problem=(c.CLUSTER_UNREACHABLE, "no credentials"))
    job, plan = step(job, dataclasses.replace(obs, clusters={**obs.clusters, left: down}))
    assert cond(job, "Degraded") == ("True", c.CLUSTER_UNREACHABLE)
    assert "https://a" in c.get(job.status.conditions, "Degraded").message
    assert next(g for g in job.status.groups if g.name == "ra").former
    assert not [a for a in plan.actions if a.target == left]


def test_two_targets_at_one_place_leave_each_others_objects_alone() -> None:
    """A group whose spec now names another kubeconfig Secret for the same apiserver and
    namespace: the old target, still observed from the status, sees the same pods and
    credentials, and deletes neither (the group's own target keeps them)."""
    job = make_job()
    home_pods, remote_pods = healthy_pods()
    job, _ = step(
        job, observe(job, home_pods, remote=settled(job, REMOTE, ClusterView(server="https://a")))
    )
    groups = [g.model_dump(by_alias=True, exclude_none=True) for g in job.spec.learner_groups]
    groups[1]["cluster"] = {"kubeconfigSecret": {"name": "same-cluster"}}
    renamed = make_job(learnerGroups=groups).model_copy(update={"status": job.status})
    alias = target_of(renamed, renamed.spec.learner_groups[1])
    assert alias != REMOTE and REMOTE in targets(renamed)
    obs = observe(renamed, home_pods, remote=settled(job, REMOTE, ClusterView(server="https://a")))
    obs = dataclasses.replace(
        obs,
        clusters={
            **obs.clusters,
            REMOTE: settled(job, REMOTE, ClusterView(pods=remote_pods, server="https://a")),
            alias: settled(renamed, alias, ClusterView(pods=remote_pods, server="https://a")),
        },
    )
    _, plan = step(renamed, obs)
    assert not [a for a in plan.actions if a.verb == "delete"], verbs(plan)
