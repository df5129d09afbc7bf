"""The operator's Kueue integration, purely (operator/kueue.py): the Workload it asks Kueue
for, the job it runs once Kueue has (or has not) admitted it, and the Workload status that
gives the quota back (also for a Failed job); and the Suspended and Complete conditions
every job has (status.py).
The real Kueue's side: tests/integration/test_kueue.py."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ddiloco.operator import conditions as c
from ddiloco.operator import kueue
from ddiloco.operator.api import DecoupledDiLoCoJob, validate
from ddiloco.operator.plan import ClusterView, Observed, home
from ddiloco.operator.reconcile import reconcile


def make_job(labels: dict[str, str] | None = None, **spec: Any) -> DecoupledDiLoCoJob:
    body: dict[str, Any] = {
        "metadata": {
            "name": "tiny",
            "namespace": "ns",
            "uid": "job-1",
            "generation": 2,
            "labels": {kueue.QUEUE_LABEL: "team-a", **(labels or {})},
        },
        "spec": {
            "image": "ddiloco:dev",
            "training": {"model": "tiny"},
            "synchronizer": {"shards": 2, "resources": {"requests": {"cpu": "2"}}},
            "learnerGroups": [
                {
                    "name": "gpu",
                    "replicas": 4,
                    "minReplicas": 2,
                    "gpusPerLearner": 2,
                    "resources": {"requests": {"cpu": "8", "memory": "32Gi"}},
                    "nodeSelector": {"pool": "a100"},
                },
                {"name": "cpu", "replicas": 1, "resources": {"requests": {"cpu": "1"}}},
                {"name": "idle", "replicas": 0},
            ],
        },
    }
    body["spec"].update(spec)
    return DecoupledDiLoCoJob.from_body(body)


def admitted_workload(counts: dict[str, int], flavor: str = "spot") -> dict[str, Any]:
    return {
        "metadata": {"name": "ddiloco-tiny", "namespace": "ns", "generation": 1},
        "status": {
            "conditions": [
                {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved"},
                {"type": "Admitted", "status": "True", "reason": "Admitted"},
            ],
            "admission": {
                "clusterQueue": "cq",
                "podSetAssignments": [
                    {"name": name, "count": n, "flavors": {"cpu": flavor}}
                    for name, n in counts.items()
                ],
            },
        },
    }


FLAVORS = {
    "spot": {
        "spec": {
            "nodeLabels": {"cloud/spot": "true"},
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        }
    }
}


def test_the_workload_has_one_pod_set_per_group_with_slots_and_one_for_the_synchronizer() -> None:
    job = make_job(labels={kueue.PRIORITY_LABEL: "high"})
    wl = kueue.build_workload(job, priority=1000)
    assert wl["kind"] == "Workload" and wl["metadata"]["namespace"] == "ns"
    assert wl["metadata"]["ownerReferences"][0]["uid"] == "job-1"
    assert wl["spec"]["queueName"] == "team-a"
    assert wl["spec"]["priority"] == 1000
    assert wl["spec"]["priorityClassRef"]["name"] == "high"
    sets = {p["name"]: p for p in wl["spec"]["podSets"]}
    assert set(sets) == {"synchronizer", "learners-gpu", "learners-cpu"}  # "idle" has no slots
    assert sets["synchronizer"]["count"] == 2
    assert sets["synchronizer"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "2"}
    }
    gpu = sets["learners-gpu"]
    assert (gpu["count"], gpu["minCount"]) == (4, 2)
    pod = gpu["template"]["spec"]
    res = pod["containers"][0]["resources"]
    assert res["requests"] == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "2"}
    assert res["limits"] == {"nvidia.com/gpu": "2"}
    assert pod["nodeSelector"] == {"pool": "a100"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert "minCount" not in sets["learners-cpu"]  # all or nothing


def test_without_an_admission_the_job_runs_suspended_and_says_it_is_queued() -> None:
    job = make_job()
    for wl in (None, {"status": {"conditions": [
        {"type": "QuotaReserved", "status": "False", "reason": "Pending",
         "message": "couldn't assign flavors to pod set learners-gpu: insufficient quota"},
    ]}}):  # fmt: skip
        gate = kueue.Gate.of(job, wl, {})
        assert not gate.admitted and gate.job.spec.suspend
        assert gate.reason == kueue.QUEUED
        assert "team-a" in gate.message
    assert "insufficient quota" in gate.message  # Kueue's own words reach the condition
    cond = kueue.suspended_condition(gate, job)
    assert (cond.type, cond.status, cond.reason) == ("Suspended", "True", "Queued")


def test_admitted_it_runs_the_admitted_counts_on_the_flavors_nodes() -> None:
    job = make_job()
    wl = admitted_workload({"synchronizer": 2, "learners-gpu": 3, "learners-cpu": 1})
    gate = kueue.Gate.of(job, wl, FLAVORS)
    assert gate.admitted and not gate.job.spec.suspend
    groups = {g.name: g for g in gate.job.spec.learner_groups}
    assert groups["gpu"].replicas == 3 and groups["cpu"].replicas == 1
    assert groups["idle"].replicas == 0
    assert groups["gpu"].node_selector == {"pool": "a100", "cloud/spot": "true"}
    assert [t.key for t in groups["gpu"].tolerations] == ["spot"]
    assert "gpu 3 of 4" in gate.message and "cq" in gate.message
    assert not validate(gate.job.spec)  # what reconcile plans is a valid job
    assert job.spec.learner_groups[0].replicas == 4  # the spec itself is left as it is
    cond = kueue.suspended_condition(gate, job)
    assert (cond.status, cond.reason) == ("False", "Admitted")


def test_evicted_it_is_suspended_with_kueues_reason_until_readmitted() -> None:
    job = make_job()
    wl = admitted_workload({"synchronizer": 2, "learners-gpu": 4, "learners-cpu": 1})
    wl["status"]["conditions"].append(
        {"type": "Evicted", "status": "True", "reason": "Preempted",
         "message": "Preempted to accommodate a workload (UID: x) due to prioritization"}
    )  # fmt: skip
    gate = kueue.Gate.of(job, wl, FLAVORS)
    assert gate.evicted and not gate.admitted and gate.job.spec.suspend
    assert gate.reason == "Preempted" and "prioritization" in gate.message

    released = kueue.release_status(wl, "2026-01-01T00:00:00Z")
    assert released["admission"] is None
    conds = {x["type"]: x for x in released["conditions"]}
    assert conds["QuotaReserved"]["status"] == "False"
    assert conds["Admitted"]["status"] == "False"
    assert (conds["Requeued"]["status"], conds["Requeued"]["reason"]) == ("True", "Preempted")
    assert conds["Evicted"]["status"] == "True"  # Kueue clears it when it admits again


def test_a_user_suspend_stays_a_suspend_whatever_kueue_says() -> None:
    job = make_job(suspend=True)
    gate = kueue.Gate.of(job, admitted_workload({"synchronizer": 2, "learners-gpu": 4}), {})
    cond = kueue.suspended_condition(gate, job)
    assert (cond.status, cond.reason) == ("True", c.JOB_SUSPENDED)


def test_finishing_marks_the_workload_finished_and_stopped_needs_every_pod_gone() -> None:
    wl = admitted_workload({"synchronizer": 1})
    done = kueue.finish_status(wl, "The job is done", "2026-01-01T00:00:00Z")
    assert {x["type"]: x["status"] for x in done["conditions"]}["Finished"] == "True"

    class P:
        job_uid = "job-1"

    job = make_job()
    assert not kueue.stopped(job, [P()], None)
    assert not kueue.stopped(job, [], {"status": {"replicas": 1}})
    assert kueue.stopped(job, [], {"status": {"replicas": 0}})


def test_a_failed_job_finishes_its_workload_with_reason_failed() -> None:
    """Kueue frees the quota of a Finished Workload: a Failed job's says Failed and quotes
    why; a running job's is left alone."""
    failed = make_job().status.model_copy(
        update={
            "phase": "Failed",
            "conditions": [c.make(c.FAILED, True, c.LEARNERS_EXHAUSTED, "No learner is left")],
        }
    )
    assert kueue.finished_as(failed) == ("Failed", "No learner is left")
    done = failed.model_copy(update={"phase": "Succeeded"})
    assert kueue.finished_as(done) == ("Succeeded", "The job is done")
    assert kueue.finished_as(failed.model_copy(update={"phase": "Running"})) is None
    wl = admitted_workload({"synchronizer": 1})
    reason, message = kueue.finished_as(failed) or ("", "")
    out = kueue.finish_status(wl, message, "2026-01-01T00:00:00Z", reason=reason)
    fin = next(x for x in out["conditions"] if x["type"] == "Finished")
    assert (fin["status"], fin["reason"], fin["message"]) == (
        "True",
        "Failed",
        "No learner is left",
    )


def test_min_replicas_above_replicas_is_refused() -> None:
    job = make_job(
        learnerGroups=[{"name": "g", "replicas": 2, "minReplicas": 3}],
    )
    assert any("minReplicas" in p for p in validate(job.spec))


def _pass(job: DecoupledDiLoCoJob, sync: dict[str, Any] | None = None) -> DecoupledDiLoCoJob:
    obs = Observed(
        now=datetime(2026, 11, 30, tzinfo=UTC),
        clusters={home(job): ClusterView(token="tok")},
        sync_status=sync,
    )
    plan = reconcile(job, obs, fresh_token="fresh")
    assert plan.status is not None
    return job.model_copy(update={"status": plan.status})


def test_suspended_and_complete_conditions_as_core_jobs_have_them() -> None:
    """Suspended appears when suspended and turns False (JobResumed) after; Complete appears
    once the job is done; neither is there on a job that never got there."""
    job = _pass(make_job(labels={}))
    types = {x.type for x in job.status.conditions}
    assert "Suspended" not in types and "Complete" not in types

    job = _pass(job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})}))
    suspended = c.get(job.status.conditions, "Suspended")
    assert suspended is not None and (suspended.status, suspended.reason) == (
        "True",
        c.JOB_SUSPENDED,
    )
    job = _pass(job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": False})}))
    resumed = c.get(job.status.conditions, "Suspended")
    assert resumed is not None and (resumed.status, resumed.reason) == ("False", c.JOB_RESUMED)

    training = job.spec.training.model_copy(update={"total_tokens": 100})
    job = job.model_copy(update={"spec": job.spec.model_copy(update={"training": training})})
    done = _pass(job, sync={"finished": True, "total_tokens": 100, "global_version": 9})
    complete = c.get(done.status.conditions, "Complete")
    assert complete is not None and (complete.status, complete.reason) == (
        "True",
        c.TOKEN_BUDGET_REACHED,
    )
    assert done.status.phase == "Succeeded"


def _slice(
    name: str,
    at: str,
    counts: dict[str, int] | None = None,
    replaces: str | None = None,
    finished: str | None = None,
    owner: str = "job-1",
) -> dict[str, Any]:
    """A Workload slice of the job as read: admitted with `counts` (None: waiting), made at
    `at`, optionally replacing `ns/<replaces>` and Finished with reason `finished`."""
    wl: dict[str, Any] = (
        admitted_workload(counts) if counts is not None else {"status": {"conditions": []}}
    )
    wl["metadata"] = {
        "name": name,
        "namespace": "ns",
        "creationTimestamp": at,
        "resourceVersion": "7",
        "labels": {"ddiloco.dev/job-uid": owner},
        "ownerReferences": [{"uid": owner, "kind": "DecoupledDiLoCoJob", "name": "tiny"}],
        "annotations": {kueue.REPLACEMENT_FOR: f"ns/{replaces}"} if replaces else {},
    }
    wl["spec"] = {
        "queueName": "team-a",
        "podSets": [
            {"name": "synchronizer", "count": 2, "template": {}},
            {"name": "learners-gpu", "count": 4, "minCount": 2, "template": {}},
            {"name": "learners-cpu", "count": 1, "template": {}},
        ],
    }
    if finished:
        wl["status"]["conditions"].append(
            {"type": "Finished", "status": "True", "reason": finished}
        )
    return wl


SHORT = {"synchronizer": 2, "learners-gpu": 2, "learners-cpu": 1}
FULL = {"synchronizer": 2, "learners-gpu": 4, "learners-cpu": 1}


def test_a_short_admission_asks_for_a_larger_slice_that_replaces_it() -> None:
    """Admitted with 2 of 4: the slice that follows asks for the full counts with no minCount
    (a smaller admission would only replace it with its like), names the admitted one as
    the one it replaces, and is the job's, in its queue."""
    job = make_job()
    first = _slice("ddiloco-tiny", "2026-01-01T00:00:00Z", SHORT)
    assert kueue.short_sets(first) == {"learners-gpu": (2, 4)}
    assert not kueue.short_sets(_slice("ddiloco-tiny", "2026-01-01T00:00:00Z", FULL))
    assert not kueue.short_sets(_slice("ddiloco-tiny", "2026-01-01T00:00:00Z"))  # waiting

    grow = kueue.build_growth(job, first)
    meta = grow["metadata"]
    assert meta["name"] == "ddiloco-tiny-job-1-2" and meta["namespace"] == "ns"
    assert meta["annotations"][kueue.REPLACEMENT_FOR] == "ns/ddiloco-tiny"
    assert meta["annotations"][kueue.SLICE_NAME] == "ddiloco-tiny"
    assert meta["annotations"][kueue.ELASTIC_ANNOTATION] == "true"
    assert meta["ownerReferences"][0]["uid"] == "job-1"
    assert grow["spec"]["queueName"] == "team-a"
    assert {p["name"]: p["count"] for p in grow["spec"]["podSets"]} == {
        "synchronizer": 2,
        "learners-gpu": 4,
        "learners-cpu": 1,
    }
    assert not any("minCount" in p for p in grow["spec"]["podSets"])
    assert first["spec"]["podSets"][1]["minCount"] == 2  # the admitted one is left as read
    assert kueue.slice_name(job, "ddiloco-tiny-job-1-2") == "ddiloco-tiny-job-1-3"


def test_which_slice_the_job_follows() -> None:
    first = _slice("ddiloco-tiny", "2026-01-01T00:00:00Z", SHORT)
    waiting = _slice("ddiloco-tiny-2", "2026-01-01T00:00:05Z", replaces="ddiloco-tiny")
    s = kueue.Slices.of("job-1", [waiting, first])
    assert (s.current, s.growth, s.stale) == (first, waiting, None)

    # Kueue admitted the larger slice and finished the first: the job follows the new one
    replaced = _slice(
        "ddiloco-tiny", "2026-01-01T00:00:00Z", SHORT, finished="WorkloadSliceReplaced"
    )
    grown = _slice("ddiloco-tiny-2", "2026-01-01T00:00:05Z", FULL, replaces="ddiloco-tiny")
    assert kueue.Slices.of("job-1", [replaced, grown]) == kueue.Slices(current=grown)
    # read between Kueue finishing the first and admitting its successor: the job keeps the
    # admission it has for a while (the waiting slice stays), then waits like a queued one
    replaced["status"]["conditions"][-1]["lastTransitionTime"] = "2026-01-01T00:01:00Z"
    soon, late = (datetime(2026, 1, 1, 0, 1, s, tzinfo=UTC) for s in (2, 59))
    assert kueue.Slices.of("job-1", [replaced, waiting], soon) == kueue.Slices(
        current=replaced, growth=waiting
    )
    assert kueue.Gate.of(make_job(), replaced, {}).counts["gpu"] == 2
    assert kueue.Slices.of("job-1", [replaced, waiting], late) == kueue.Slices(current=waiting)
    # admitted while the first is not Finished: that one is to be finished (OutOfSync)
    s = kueue.Slices.of("job-1", [first, grown])
    assert (s.current, s.growth, s.stale) == (grown, None, first)
    # made within the same second: the annotation orders them
    same = _slice("ddiloco-tiny-2", "2026-01-01T00:00:00Z", replaces="ddiloco-tiny")
    assert kueue.Slices.of("job-1", [same, first]).current is first

    # the job ended with a larger slice waiting: it follows the finished one (still done)
    done = _slice("ddiloco-tiny", "2026-01-01T00:00:00Z", SHORT, finished="Succeeded")
    s = kueue.Slices.of("job-1", [done, waiting])
    assert (s.current, s.growth) == (done, waiting)
    assert kueue.Gate.of(make_job(), s.current, {}).admitted
    assert not kueue.short_sets(done)  # nothing to grow into: the waiting one goes

    # another job's Workload (a former job of the same name) is not this job's
    other = _slice("ddiloco-tiny", "2026-01-01T00:00:00Z", FULL, owner="job-0")
    assert kueue.Slices.of("job-1", [other]) == kueue.Slices()


def test_the_probe_lowers_a_short_set_and_a_released_grown_slice_gets_its_min_back() -> None:
    first = _slice("ddiloco-tiny", "2026-01-01T00:00:00Z", SHORT)
    probe = kueue.probe_pod_sets(first)
    assert probe is not None
    assert {p["name"]: p["count"] for p in probe} == {
        "synchronizer": 2,
        "learners-gpu": 3,  # still at least the 2 admitted, and minCount <= count
        "learners-cpu": 1,
    }
    assert kueue.probe_pod_sets(_slice("ddiloco-tiny", "2026-01-01T00:00:00Z", FULL)) is None

    job = make_job()
    grown = kueue.build_growth(job, first)
    restored = kueue.restored_pod_sets(job, grown)
    assert restored is not None
    sets = {p["name"]: p for p in restored}
    assert sets["learners-gpu"]["minCount"] == 2 and "minCount" not in sets["learners-cpu"]
    assert kueue.restored_pod_sets(job, first) is None  # it has them already
