"""The status tells the truth: readiness, phase, failure reasons, valid names,
unique data parts under scaling, a status that fits etcd at the CRD's largest spec, the
Failed condition's rules (conditions.py) and the per-component counts.

    .venv/bin/pytest tests/unit/test_operator_status.py

Pure: jobs and observations built by hand, as in test_operator_reconcile.py.
"""

from __future__ import annotations

import dataclasses
import json
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ddiloco.operator import api, builders, names, slots, sync_workload, tokens
from ddiloco.operator import conditions as c
from ddiloco.operator.api import DecoupledDiLoCoJob, JobStatus, SecretKeyRef
from ddiloco.operator.plan import ClusterView, Observed, Plan, PodView, SecretView, Target, home
from ddiloco.operator.reconcile import reconcile
from ddiloco.operator.slots import Slot

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
ANSWER: dict[str, Any] = {"global_version": 3, "merges": 5}
REMOTE = Target(SecretKeyRef(name="region-a-kubeconfig"), "ns")
ETCD_LIMIT = 1_572_864  # etcd's default --max-request-bytes: the whole object must fit


def make_job(groups: list[dict[str, Any]] | None = None, **spec: Any) -> DecoupledDiLoCoJob:
    body: dict[str, Any] = {
        "metadata": {"name": "tiny", "namespace": "ns", "uid": "job-1", "generation": 1},
        "spec": {
            "image": "ddiloco:dev",
            "training": {"model": "tiny"},
            "synchronizer": {"tls": {"enabled": False}},
            "learnerGroups": groups or [{"name": "a", "replicas": 2}],
            "failurePolicy": {"maxReplacementsPerSlot": 2, "backoffSeconds": 1},
            **spec,
        },
    }
    return DecoupledDiLoCoJob.from_body(body)


def with_spec(job: DecoupledDiLoCoJob, **spec: Any) -> DecoupledDiLoCoJob:
    """The same job (status kept) with a changed spec, as a `kubectl patch` makes it."""
    body = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    body["spec"].update(spec)
    return DecoupledDiLoCoJob.from_body(body).model_copy(update={"status": job.status})


def observe(
    job: DecoupledDiLoCoJob,
    pods: tuple[PodView, ...] = (),
    now: datetime = T0,
    sync: dict[str, Any] | None = ANSWER,
    service: bool = True,
) -> Observed:
    sts = sync_workload.build_synchronizer_statefulset(job)
    sts["status"] = {"availableReplicas": 1}
    view = ClusterView(pods=pods, token="tok")
    creds = {  # each group's learner credentials, as an earlier pass wrote them
        builders.learner_tokens_secret_name(job, g.name): SecretView(
            data=tokens.credentials(job, g, view, ["tok"]), job_uid=job.uid
        )
        for g in job.spec.learner_groups
    }
    return Observed(
        now=now,
        clusters={home(job): dataclasses.replace(view, secrets=creds)},
        statefulset=sts,
        service=service,
        shards_service=True,
        sync_status=sync,
    )


def step(job: DecoupledDiLoCoJob, obs: Observed) -> tuple[DecoupledDiLoCoJob, Plan]:
    plan = reconcile(job, obs, fresh_token="fresh")
    if plan.status is not None:
        job = job.model_copy(update={"status": plan.status})
    return job, plan


def cond(job: DecoupledDiLoCoJob, type_: str) -> tuple[str, str]:
    found = c.get(job.status.conditions, type_)
    assert found is not None, type_
    return found.status, found.reason


def as_pod(job: DecoupledDiLoCoJob, body: dict[str, Any], uid: str, **status: Any) -> PodView:
    """What the runtime would observe of a pod the plan created, Running and Ready."""
    body = json.loads(json.dumps(body))
    body["metadata"]["uid"] = uid
    body["status"] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
        **status,
    }
    view = PodView.from_k8s(body)
    assert view is not None
    return view


def created(plan: Plan) -> list[dict[str, Any]]:
    return [a.body for a in plan.actions if a.verb == "create" and a.kind == "Pod" and a.body]


def run_pods(job: DecoupledDiLoCoJob, pods: dict[str, PodView], plan: Plan) -> None:
    """Play the cluster: created pods appear Running, deleted ones vanish."""
    for a in plan.actions:
        if a.kind != "Pod":
            continue
        if a.verb == "delete":
            pods.pop(a.name, None)
        elif a.verb == "create" and a.body is not None:
            pods[a.name] = as_pod(job, a.body, f"uid-{a.name}-{len(pods)}-{random.random()}")


def settle(
    job: DecoupledDiLoCoJob, pods: dict[str, PodView], passes: int = 6
) -> DecoupledDiLoCoJob:
    for _ in range(passes):
        job, plan = step(job, observe(job, tuple(pods.values())))
        run_pods(job, pods, plan)
    return job


def env_of(pod: PodView | dict[str, Any], job: DecoupledDiLoCoJob) -> dict[str, str]:
    assert isinstance(pod, dict)
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


# --------------------------------------------------------------------------- readiness


def test_ready_needs_an_answer_from_the_synchronizer() -> None:
    job = make_job()
    pods: dict[str, PodView] = {}
    job = settle(job, pods)
    assert cond(job, c.READY) == ("True", c.JOB_READY)

    quiet, _ = step(job, observe(job, tuple(pods.values()), sync=None))
    assert cond(quiet, c.SYNCHRONIZER_READY) == ("False", c.SYNCHRONIZER_NOT_ANSWERING)
    assert cond(quiet, c.READY) == ("False", c.SYNCHRONIZER_NOT_READY)
    assert quiet.status.phase == "Running"  # the learners still train
    assert quiet.status.synchronizer is not None and not quiet.status.synchronizer.reachable
    assert quiet.status.global_version == 3  # the last numbers stay

    fresh = make_job()
    never, _ = step(fresh, observe(fresh, sync=None))
    assert cond(never, c.READY)[0] == "False" and never.status.phase == "Pending"


def test_ready_needs_the_service() -> None:
    job = make_job()
    pods: dict[str, PodView] = {}
    job = settle(job, pods)
    gone, plan = step(job, observe(job, tuple(pods.values()), service=False))
    assert cond(gone, c.SYNCHRONIZER_READY) == ("False", c.SYNCHRONIZER_PROGRESSING)
    assert "Service tiny-synchronizer" in (c.get(gone.status.conditions, c.READY) or c).message  # type: ignore[union-attr]
    assert ("create", "Service") in [(a.verb, a.kind) for a in plan.actions]


def test_phase_stays_running_while_a_slot_waits_for_its_replacement() -> None:
    job = make_job(failurePolicy={"backoffSeconds": 60})
    pods: dict[str, PodView] = {}
    job = settle(job, pods)
    name = builders.learner_pod_name(job, "a", 1)
    del pods[name]  # it vanished: a failure, its replacement waits 60 s
    job, plan = step(job, observe(job, tuple(pods.values()), now=T0 + timedelta(seconds=1)))
    assert [e.reason for e in plan.events] == ["LearnerFailed"]
    assert job.status.phase == "Running"
    assert cond(job, c.READY) == ("False", c.LEARNERS_NOT_READY)
    assert cond(job, c.LEARNERS_READY)[0] == "False"
    assert [s.id for s in job.status.slots] == ["a-1"] and job.status.unhealthy_slots == 1


# --------------------------------------------------------------------------- failure reasons


def kwok_failed(reason: str, exit_code: int, message: str) -> dict[str, Any]:
    """The status kwok's pod-container-running-failed stage writes (as a kubelet would)."""
    return {
        "phase": "Failed",
        "conditions": [{"type": "Ready", "status": "False"}],
        "containerStatuses": [
            {
                "name": "learner",
                "ready": False,
                "state": {
                    "terminated": {"exitCode": exit_code, "reason": reason, "message": message}
                },
            }
        ],
    }


def test_an_oom_killed_learner_says_oomkilled_with_its_last_lines() -> None:
    job = make_job(failurePolicy={"backoffSeconds": 0, "maxReplacementsPerSlot": 1})
    pods: dict[str, PodView] = {}
    job = settle(job, pods)
    name = builders.learner_pod_name(job, "a", 0)
    body = builders.build_learner_pod(job, job.spec.learner_groups[0], 0)
    assert body["spec"]["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
    logs = "\n".join(f"step {i} loss 3.{i}" for i in range(200)) + "\nCUDA out of memory"
    pods[name] = as_pod(job, body, "dead", **kwok_failed("OOMKilled", 137, logs))
    assert pods[name].reason == "OOMKilled"
    job, plan = step(job, observe(job, tuple(pods.values())))
    failed = [e for e in plan.events if e.reason == "LearnerFailed"]
    assert len(failed) == 1 and "ended with OOMKilled (exit code 137)" in failed[0].message
    assert failed[0].message.endswith("CUDA out of memory") and len(failed[0].message) < 1100
    assert job.status.slots[0].last_failure_reason == "OOMKilled"
    assert job.status.groups[0].failed_slots[0].reason == "OOMKilled"
    assert [(a.verb, a.grace_seconds) for a in plan.actions] == [("delete", 0)]
    # replaced once, it fails again: the limit; the pod stays (logs) and Degraded says why
    run_pods(job, pods, plan)
    job, plan = step(job, observe(job, tuple(pods.values())))
    run_pods(job, pods, plan)
    job, plan = step(job, observe(job, tuple(pods.values())))
    assert pods[name].attempt == 1
    body = builders.build_learner_pod(job, job.spec.learner_groups[0], 0, attempt=1)
    pods[name] = as_pod(job, body, "dead-2", **kwok_failed("Error", 1, "Traceback ..."))
    job, plan = step(job, observe(job, tuple(pods.values())))
    assert plan.actions == []
    assert cond(job, c.DEGRADED) == ("True", c.REPLACEMENT_LIMIT_REACHED)
    degraded = c.get(job.status.conditions, c.DEGRADED)
    assert degraded is not None and "ended with Error" in degraded.message
    assert job.status.slots[0].limit_reached and job.status.phase == "Degraded"


def test_pod_status_reason_wins_over_the_container_reason() -> None:
    view = PodView.from_k8s(
        {
            "metadata": {
                "name": "p",
                "labels": {builders.LABEL_SLOT: "0", builders.LABEL_GROUP: "a"},
            },
            "status": {"reason": "Evicted", **kwok_failed("Error", 137, "")},
        }
    )
    assert view is not None and view.reason == "Evicted" and view.exit_code == 137


# --------------------------------------------------------------------------- names


def longest_job(tls: bool = True) -> DecoupledDiLoCoJob:
    """The longest names the CRD lets through: job, 16 groups, the highest index."""
    groups = [
        {"name": f"g{n:02d}" + "x" * (api.MAX_GROUP_NAME - 4) + "9", "replicas": api.MAX_REPLICAS}
        for n in range(api.MAX_GROUPS)
    ]
    body = {
        "metadata": {
            "name": ("j-" * api.MAX_JOB_NAME)[: api.MAX_JOB_NAME - 1] + "z",
            "namespace": "n" * 63,
            "uid": "0f8fad5b-d9cb-469f-a165-70867728950e",
        },
        "spec": {
            "image": "ddiloco:dev",
            "training": {"model": "tiny"},
            "synchronizer": {"tls": {"enabled": tls, "mutual": tls}},
            "learnerGroups": groups,
        },
    }
    job = DecoupledDiLoCoJob.from_body(body)
    assert len(job.name) == api.MAX_JOB_NAME
    assert all(len(g.name) == api.MAX_GROUP_NAME for g in job.spec.learner_groups)
    return job


def test_the_longest_names_the_crd_allows_give_valid_children() -> None:
    job = longest_job()
    assert names.problems(job) == []
    checked = {what.split(":")[0] for what, _, _ in names.derived(job)}
    assert {"Service", "StatefulSet", "PersistentVolumeClaim", "Secret", "Pod"} <= checked


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("a.b", "Service 'a.b-synchronizer'"),
        ("tiny.v2", "metadata.name 'tiny.v2'"),
        ("x" * 60, "is 73 characters"),
    ],
)
def test_a_name_some_child_cannot_have_is_refused(name: str, why: str) -> None:
    job = make_job()
    job = job.model_copy(update={"metadata": {**job.metadata, "name": name}})
    out, plan = step(job, observe(job))
    assert out.status.phase == "Invalid" and plan.actions == []
    ready = c.get(out.status.conditions, c.READY)
    assert ready is not None and ready.reason == c.INVALID_SPEC and why in ready.message


def test_the_crd_refuses_a_name_that_is_no_dns_label() -> None:
    rules = DecoupledDiLoCoJob.model_json_schema()["x-kubernetes-validations"]
    assert any(api.DNS_LABEL in r["rule"] for r in rules)
    assert any(str(api.MAX_JOB_NAME) in r["rule"] for r in rules)


# --------------------------------------------------------------------------- data parts


def shard_table(job: DecoupledDiLoCoJob, pods: dict[str, PodView]) -> dict[str, tuple[int, int]]:
    out = {}
    for p in pods.values():
        assert p.shard is not None
        out[builders.learner_id(p.group, p.index)] = p.shard
    return out


def test_the_issue_case_a_new_slot_never_takes_a_shard_in_use() -> None:
    # a: 2, b: 2 -> a: 3. With positions, the new a-2 got index 2 while b-0 kept 2.
    groups = [{"name": "a", "replicas": 2}, {"name": "b", "replicas": 2}]
    job = make_job(groups, training={"model": "tiny", "dataParts": 8})
    pods: dict[str, PodView] = {}
    job = settle(job, pods)
    before = shard_table(job, pods)
    assert before == {"a-0": (0, 8), "a-1": (1, 8), "b-0": (2, 8), "b-1": (3, 8)}
    job = with_spec(job, learnerGroups=[{"name": "a", "replicas": 3}, {"name": "b", "replicas": 2}])
    job = settle(job, pods)
    after = shard_table(job, pods)
    assert {k: after[k] for k in before} == before  # nobody moved, nobody restarted
    assert after["a-2"] == (4, 8)
    assert job.status.data_parts == 8 and job.status.groups[0].parts == [0, 1, 4]


def test_scaling_keeps_shards_unique_and_stable_whatever_the_order() -> None:
    rng = random.Random(12)
    job = make_job(
        [{"name": "a", "replicas": 2}, {"name": "b", "replicas": 1}, {"name": "c", "replicas": 1}],
        training={"model": "tiny", "dataParts": 12},
    )
    pods: dict[str, PodView] = {}
    job = settle(job, pods)
    for _ in range(30):
        sizes = [rng.randint(0, 4) for _ in range(3)]
        before = shard_table(job, pods)
        uids = {builders.learner_id(p.group, p.index): p.uid for p in pods.values()}
        job = with_spec(
            job,
            learnerGroups=[{"name": n, "replicas": k} for n, k in zip("abc", sizes, strict=True)],
        )
        job = settle(job, pods)
        table = shard_table(job, pods)
        assert len(table) == sum(sizes)
        assert len({s for s, _ in table.values()}) == len(table), table  # unique
        assert all(n == 12 and 0 <= s < 12 for s, n in table.values())
        for lid, shard in table.items():  # stable: a slot that stayed kept shard and pod
            if lid in before:
                assert shard == before[lid]
                assert (
                    next(
                        p.uid for p in pods.values() if builders.learner_id(p.group, p.index) == lid
                    )
                    == uids[lid]
                )
        assert all(g.replaced == 0 for g in job.status.groups)  # scaling is no failure
        for p in pods.values():  # the env says the same as the label
            body = builders.build_learner_pod(
                job,
                next(g for g in job.spec.learner_groups if g.name == p.group),
                p.index,
                shard=p.shard,
            )
            env = env_of(body, job)
            assert (int(env["DDILOCO_LEARNER_INDEX"]), int(env["DDILOCO_NUM_LEARNERS"])) == p.shard


def test_a_scale_up_past_the_shard_count_reshards_without_counting_failures() -> None:
    job = make_job([{"name": "a", "replicas": 2}, {"name": "b", "replicas": 1}])
    pods: dict[str, PodView] = {}
    job = settle(job, pods)
    assert job.status.data_parts == 3
    assert shard_table(job, pods) == {"a-0": (0, 3), "a-1": (1, 3), "b-0": (2, 3)}
    job = with_spec(job, learnerGroups=[{"name": "a", "replicas": 3}, {"name": "b", "replicas": 1}])
    job, plan = step(job, observe(job, tuple(pods.values())))
    assert "DataRedivided" in [e.reason for e in plan.events]
    run_pods(job, pods, plan)
    job = settle(job, pods)
    assert job.status.data_parts == 4
    assert shard_table(job, pods) == {"a-0": (0, 4), "a-1": (1, 4), "a-2": (2, 4), "b-0": (3, 4)}
    assert all(g.replaced == 0 for g in job.status.groups) and job.status.slots == []
    assert cond(job, c.READY) == ("True", c.JOB_READY)
    # scaling down keeps the count; a later scale-up within it reuses the freed shards
    job = settle(
        with_spec(job, learnerGroups=[{"name": "a", "replicas": 1}, {"name": "b", "replicas": 1}]),
        pods,
    )
    assert shard_table(job, pods) == {"a-0": (0, 4), "b-0": (3, 4)}
    job = settle(
        with_spec(job, learnerGroups=[{"name": "a", "replicas": 1}, {"name": "b", "replicas": 3}]),
        pods,
    )
    assert shard_table(job, pods) == {"a-0": (0, 4), "b-0": (3, 4), "b-1": (1, 4), "b-2": (2, 4)}


def test_a_replacement_keeps_its_slots_shard() -> None:
    job = make_job([{"name": "a", "replicas": 3}], failurePolicy={"backoffSeconds": 0})
    pods: dict[str, PodView] = {}
    job = settle(job, pods)
    name = builders.learner_pod_name(job, "a", 1)
    old = pods.pop(name)
    job = settle(job, pods)
    assert pods[name].shard == old.shard and pods[name].attempt == 1
    assert job.status.groups[0].slot_replacements == [0, 1, 0]


def test_dataParts_below_the_replicas_is_invalid() -> None:
    job = make_job([{"name": "a", "replicas": 3}], training={"model": "tiny", "dataParts": 2})
    out, _ = step(job, observe(job))
    assert out.status.phase == "Invalid"


# --------------------------------------------------------------------------- status size


def worst_status(job: DecoupledDiLoCoJob) -> tuple[JobStatus, dict[tuple[str, int], Slot]]:
    """Every slot at the replacement limit, each failure at its own second, with the longest
    reason kept: the most the books can hold."""
    books: dict[tuple[str, int], Slot] = {}
    for g in job.spec.learner_groups:
        for i in range(g.replicas):
            t = (T0 + timedelta(seconds=len(books))).strftime("%Y-%m-%dT%H:%M:%SZ")
            books[(g.name, i)] = Slot(
                g.name, i, failed=True, replacements=10_000, reason=f"{len(books):05d}" + "R" * 300, time=t,
                shard=len(books),
            )  # fmt: skip
    groups = [
        slots.encode(
            api.GroupStatus(
                name=g.name,
                cluster="region-" + "x" * 200,
                kubeconfig_secret=SecretKeyRef(name="k" * 253, key="c" * 253),
                namespace="n" * 63,
                desired=g.replicas,
                replaced=10**9,
            ),
            [books[(g.name, i)] for i in range(g.replicas)],
        )
        for g in job.spec.learner_groups
    ]
    return job.status.model_copy(update={"groups": groups}), books


def test_the_status_fits_etcd_at_the_crds_largest_spec() -> None:
    job = longest_job(tls=False)  # (certificates are not status)
    # a real pass: every slot's pod failed at once, limit 0, so none is replaced
    job = with_spec(job, failurePolicy={"maxReplacementsPerSlot": 0})
    pods = []
    for g in job.spec.learner_groups:
        for i in range(g.replicas):
            body = builders.build_learner_pod(job, g, i)
            pods.append(
                as_pod(job, body, f"u{g.name}{i}", **kwok_failed("OOMKilled", 137, "x" * 2048))
            )
    obs = Observed(
        now=T0,
        clusters={home(job): ClusterView(pods=tuple(pods), token="t")},
        statefulset={"status": {"availableReplicas": 1}},
        service=True,
        shards_service=True,
        sync_status=ANSWER,
    )
    out, _ = step(job, obs)
    real = json.dumps(out.status.model_dump(by_alias=True, exclude_none=True, mode="json"))
    assert out.status.unhealthy_slots == api.MAX_GROUPS * api.MAX_REPLICAS
    assert len(out.status.slots) == api.MAX_SLOT_DETAIL
    for cnd in out.status.conditions:
        assert len(cnd.message) <= 1024
    worst, books = worst_status(out)
    size = len(json.dumps(worst.model_dump(by_alias=True, exclude_none=True, mode="json")))
    print(f"status at the CRD maxima: {len(real)} bytes after a pass, {size} at the worst")
    assert len(real) < 64 * 1024
    assert size < ETCD_LIMIT // 3, size  # room for the spec, metadata and managedFields
    # and it decodes back to the same books
    again = slots.decode(worst.groups)
    assert len(again) == api.MAX_GROUPS * api.MAX_REPLICAS
    assert all(s.failed and s.replacements == 10_000 for s in again.values())
    assert all((again[k].time or "") >= (books[k].time or "") for k in books)  # only later


def test_index_ranges_round_trip() -> None:
    rng = random.Random(3)
    for _ in range(200):
        idx = {rng.randrange(600) for _ in range(rng.randrange(50))}
        text = slots.index_ranges(idx)
        assert slots.parse_ranges(text) == idx
    assert slots.index_ranges(range(512)) == "0-511"
    assert slots.index_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@pytest.mark.parametrize(
    ("status", "says"),
    [
        (  # envFrom a Secret that is not there: the kubelet's own words
            {
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "name": "learner",
                        "state": {
                            "waiting": {
                                "reason": "CreateContainerConfigError",
                                "message": 'secret "s3-credentials" not found',
                            }
                        },
                    }
                ],
            },
            'a-0 (CreateContainerConfigError: secret "s3-credentials" not found)',
        ),
        (  # a volume from a claim that does not exist: the scheduler's
            {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": '0/1 nodes are available: persistentvolumeclaim "corpus" '
                        "not found.",
                    }
                ],
            },
            'a-0 (Unschedulable: 0/1 nodes are available: persistentvolumeclaim "corpus" '
            "not found.)",
        ),
        (  # an init container of the user's image that cannot be pulled
            {
                "phase": "Pending",
                "initContainerStatuses": [
                    {
                        "name": "fetch",
                        "state": {"waiting": {"reason": "ImagePullBackOff", "message": "back-off"}},
                    }
                ],
            },
            "a-0 (ImagePullBackOff: back-off)",
        ),
    ],
    ids=["secret", "claim", "image"],
)
def test_a_pod_that_cannot_start_says_why_in_the_job_status(
    status: dict[str, Any], says: str
) -> None:
    job = make_job([{"name": "a", "replicas": 1}])
    job, plan = step(job, observe(job))
    (body,) = created(plan)
    pod = as_pod(job, body, "u-a0", **status)
    job, _ = step(job, observe(job, (pod,)))
    ready = c.get(job.status.conditions, c.LEARNERS_READY)
    assert ready is not None and ready.status == "False"
    assert says in ready.message, ready.message
    # a pod that is merely starting is just waited for
    starting = as_pod(job, body, "u-a0", phase="Pending", conditions=[])
    job, _ = step(job, observe(job, (starting,)))
    ready = c.get(job.status.conditions, c.LEARNERS_READY)
    assert ready is not None and ready.message.endswith("waiting for a-0")


# --------------------------------------------------------------------------- Failed, components


def next_generation(job: DecoupledDiLoCoJob, **spec: Any) -> DecoupledDiLoCoJob:
    """A spec change as the apiserver records it: metadata.generation moves, status kept."""
    body = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    body["spec"].update(spec)
    body["metadata"]["generation"] = job.generation + 1
    return DecoupledDiLoCoJob.from_body(body).model_copy(update={"status": job.status})


def fail_learner(
    job: DecoupledDiLoCoJob,
    pods: dict[str, PodView],
    index: int,
    reason: str = "Error",
    code: int = 1,
    phase: str = "Failed",
) -> None:
    """Slot a-<index>'s current pod ends (kwok's failed stage), or Succeeds with code 0."""
    name = builders.learner_pod_name(job, "a", index)
    body = builders.build_learner_pod(
        job, job.spec.learner_groups[0], index, attempt=pods[name].attempt
    )
    status = kwok_failed(reason, code, "Traceback ...\nRuntimeError: boom")
    pods[name] = as_pod(job, body, f"ended-{name}-{random.random()}", **{**status, "phase": phase})


def sync_pod(job: DecoupledDiLoCoJob, **container: Any) -> dict[str, Any]:
    """The synchronizer's pod as the apiserver holds it, Ready, or with the given container
    status (a kubelet's words for a crash loop)."""
    cs = {"name": "synchronizer", "ready": True, "restartCount": 0, "state": {"running": {}}}
    cs.update(container)
    return {
        "metadata": {
            "name": f"{builders.synchronizer_name(job)}-0",
            "labels": builders.labels(job, "synchronizer"),
        },
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if cs["ready"] else "False"}],
            "containerStatuses": [cs],
        },
    }


REFUSED_LOG = (
    "INFO Starting synchronizer\n"
    "ddiloco synchronizer: error: /state/layout.json: format 9, this synchronizer reads 3\n"
)


def crash_loop(
    exit_code: int = 2, restarts: int = 3, waiting: str = "CrashLoopBackOff"
) -> dict[str, Any]:
    return {
        "ready": False,
        "restartCount": restarts,
        "state": {"waiting": {"reason": waiting}},
        "lastState": {
            "terminated": {"exitCode": exit_code, "reason": "Error", "message": REFUSED_LOG}
        },
    }


def with_sync(obs: Observed, *pods: dict[str, Any]) -> Observed:
    return dataclasses.replace(obs, synchronizer_pods=pods)


def counts(job: DecoupledDiLoCoJob, name: str) -> tuple[int, int, int, int, int]:
    """(active, ready, succeeded, failed, suspended) of one status.components entry."""
    x = next(x for x in job.status.components if x.name == name)
    return x.active, x.ready, x.succeeded, x.failed, x.suspended


def test_a_job_with_every_slot_at_its_replacement_limit_fails_and_makes_no_pod() -> None:
    job = make_job(failurePolicy={"backoffSeconds": 0, "maxReplacementsPerSlot": 0})
    pods: dict[str, PodView] = {}
    job = settle(job, pods)
    ok = sync_pod(job)
    job, _ = step(job, with_sync(observe(job, tuple(pods.values())), ok))
    assert counts(job, "synchronizer") == (1, 1, 0, 0, 0)
    assert counts(job, "learners-a") == (2, 2, 0, 0, 0)

    fail_learner(job, pods, 0, "OOMKilled", 137)
    job, plan = step(job, with_sync(observe(job, tuple(pods.values())), ok))
    assert job.status.phase == "Degraded"  # one slot left trains: Degraded, not Failed
    assert c.get(job.status.conditions, c.FAILED) is None
    assert counts(job, "learners-a") == (1, 1, 0, 1, 0)

    fail_learner(job, pods, 1)
    job, plan = step(job, with_sync(observe(job, tuple(pods.values())), ok))
    assert job.status.phase == "Failed"
    assert cond(job, c.FAILED) == ("True", c.LEARNERS_EXHAUSTED)
    assert cond(job, c.READY) == ("False", c.LEARNERS_EXHAUSTED)
    assert cond(job, c.DEGRADED) == ("True", c.REPLACEMENT_LIMIT_REACHED)
    assert c.get(job.status.conditions, c.COMPLETE) is None
    failed = c.get(job.status.conditions, c.FAILED)
    assert failed is not None and "a-0 (OOMKilled), a-1 (Error)" in failed.message
    assert [e.reason for e in plan.events].count("Failed") == 1
    assert [a for a in plan.actions if a.kind in ("Pod", "StatefulSet")] == []  # all kept
    assert counts(job, "learners-a") == (0, 0, 0, 2, 0)
    assert counts(job, "synchronizer") == (1, 1, 0, 0, 0)  # kept: the model can be exported

    # the next pass knows only the status, as a restarted operator: Failed, no second event
    again, plan = step(job, with_sync(observe(job, tuple(pods.values())), ok))
    assert again.status.phase == "Failed" and "Failed" not in [e.reason for e in plan.events]
    assert created(plan) == [] and plan.status is None

    # raising the limit is a new generation: the rules run again, the slots are replaced
    retry = next_generation(again, failurePolicy={"backoffSeconds": 0, "maxReplacementsPerSlot": 1})
    retry = settle(retry, pods)
    assert retry.status.phase == "Running" and cond(retry, c.READY)[0] == "True"
    assert c.get(retry.status.conditions, c.FAILED) is None
    assert {p.attempt for p in pods.values()} == {1}


def test_finished_and_exhausted_slots_fail_the_job_and_spares_go() -> None:
    job = make_job(failurePolicy={"backoffSeconds": 0, "maxReplacementsPerSlot": 0, "hotSpares": 1})
    pods: dict[str, PodView] = {}
    job = settle(job, pods)
    assert any(p.spare for p in pods.values())
    fail_learner(job, pods, 0, "Completed", 0, phase="Succeeded")
    fail_learner(job, pods, 1, "OOMKilled", 137)
    job, plan = step(job, observe(job, tuple(pods.values())))
    assert cond(job, c.FAILED) == ("True", c.LEARNERS_EXHAUSTED)
    failed = c.get(job.status.conditions, c.FAILED)
    assert failed is not None and "1 of 2 learner slots" in failed.message
    assert "1 finished" in failed.message
    assert counts(job, "learners-a")[2:4] == (1, 1)  # succeeded, failed
    run_pods(job, pods, plan)
    job, plan = step(job, observe(job, tuple(pods.values())))
    assert created(plan) == []
    run_pods(job, pods, plan)
    assert not any(p.spare for p in pods.values())  # a hot spare only holds a node now


def test_a_synchronizer_refusing_its_state_fails_the_job_quoting_its_error() -> None:
    job = make_job()
    pods: dict[str, PodView] = {}
    job = settle(job, pods)
    live = tuple(pods.values())

    # a crash loop on another code is a fault a restart may fix; one exit 2 is not a loop yet
    for container in (crash_loop(exit_code=1), crash_loop(restarts=1, waiting="ContainerCreating")):
        seen, plan = step(job, with_sync(observe(job, live), sync_pod(job, **container)))
        assert seen.status.phase != "Failed" and c.get(seen.status.conditions, c.FAILED) is None
    seen, _ = step(job, with_sync(observe(job, live), sync_pod(job, **crash_loop(exit_code=1))))
    assert counts(seen, "synchronizer") == (0, 0, 0, 1, 0)

    job, plan = step(job, with_sync(observe(job, live), sync_pod(job, **crash_loop())))
    assert job.status.phase == "Failed"
    assert cond(job, c.FAILED) == ("True", c.SYNCHRONIZER_STATE_UNUSABLE)
    assert cond(job, c.SYNCHRONIZER_READY) == ("False", c.SYNCHRONIZER_STATE_UNUSABLE)
    failed = c.get(job.status.conditions, c.FAILED)
    assert failed is not None
    assert "layout.json: format 9, this synchronizer reads 3" in failed.message
    assert "tiny-synchronizer-0" in failed.message and "INFO" not in failed.message
    assert [e.reason for e in plan.events] == ["Failed"]
    # the learners go (nothing they train can be merged); the synchronizer goes to zero
    assert sorted(a.name for a in plan.actions if a.verb == "delete") == sorted(pods)
    (sts,) = [a for a in plan.actions if a.kind == "StatefulSet"]
    assert sts.verb == "replace" and sts.body is not None and sts.body["spec"]["replicas"] == 0
    # the message quoted above is the container's termination message: its log's tail on exit
    (container,) = sts.body["spec"]["template"]["spec"]["containers"]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert created(plan) == []

    # its pod and the learners gone, the job stays Failed and makes nothing
    gone, plan = step(job, observe(job, ()))
    assert gone.status.phase == "Failed" and created(plan) == []
    assert "Failed" not in [e.reason for e in plan.events]
    # a new generation (e.g. a fixed image) starts it again
    fixed, plan = step(next_generation(gone, image="ddiloco:fixed"), observe(gone, ()))
    assert c.get(fixed.status.conditions, c.FAILED) is None
    assert len(created(plan)) == 2


def test_complete_and_failed_exclude_each_other() -> None:
    budget = {"model": "tiny", "totalTokens": 100}
    finished = {**ANSWER, "finished": True, "total_tokens": 100}
    limit0 = {"backoffSeconds": 0, "maxReplacementsPerSlot": 0}

    # done first: learners that end after the budget is merged are no failure
    job = make_job(training=budget, failurePolicy=limit0)
    pods: dict[str, PodView] = {}
    job = settle(job, pods)
    job, _ = step(job, observe(job, tuple(pods.values()), sync=finished))
    fail_learner(job, pods, 0)
    fail_learner(job, pods, 1)
    job, _ = step(job, observe(job, tuple(pods.values()), sync=finished))
    assert cond(job, c.COMPLETE) == ("True", c.TOKEN_BUDGET_REACHED)
    assert c.get(job.status.conditions, c.FAILED) is None and job.status.phase == "Succeeded"

    # Failed first: a synchronizer that then says the budget is merged changes nothing
    job = make_job(training=budget, failurePolicy=limit0)
    pods = {}
    job = settle(job, pods)
    fail_learner(job, pods, 0)
    fail_learner(job, pods, 1)
    job, _ = step(job, observe(job, tuple(pods.values())))
    assert job.status.phase == "Failed"
    job, _ = step(job, observe(job, tuple(pods.values()), sync=finished))
    assert job.status.phase == "Failed" and c.get(job.status.conditions, c.COMPLETE) is None


def test_components_count_suspended_pods_and_the_evaluator() -> None:
    job = make_job(
        [{"name": "a", "replicas": 2}, {"name": "b", "replicas": 1}],
        suspend=True,
        evaluation={"data": "/data/heldout.jsonl"},
    )
    obs = dataclasses.replace(
        observe(job), evaluator={"status": {"replicas": 0, "readyReplicas": 0}}
    )
    job, _ = step(job, obs)
    assert [x.name for x in job.status.components] == [
        "synchronizer", "learners-a", "learners-b", "evaluator",
    ]  # fmt: skip
    assert counts(job, "synchronizer") == (0, 0, 0, 0, 1)
    assert counts(job, "learners-a") == (0, 0, 0, 0, 2)
    assert counts(job, "learners-b") == (0, 0, 0, 0, 1)
    assert counts(job, "evaluator") == (0, 0, 0, 0, 1)
    resumed = with_spec(job, suspend=False)
    obs = dataclasses.replace(
        observe(resumed), evaluator={"status": {"replicas": 1, "readyReplicas": 1}}
    )
    resumed, _ = step(resumed, obs)
    assert counts(resumed, "evaluator") == (1, 1, 0, 0, 0)
    assert counts(resumed, "learners-a") == (0, 0, 0, 0, 0)  # asked for, not made yet
