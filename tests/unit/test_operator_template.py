"""Pod template fields and the job's token budget, on the pure builders and reconcile.

    .venv/bin/pytest tests/unit/test_operator_template.py

A learner group's (and the synchronizer's) pod template fields are merged into the pods the
operator builds, never over what it owns; `training.initFrom` and `training.totalTokens`
reach the learner and synchronizer pods; a synchronizer that says the budget is merged
makes the job Succeeded without replacing its learners.
"""

from __future__ import annotations

from typing import Any

import pytest

from ddiloco.operator import api, builders, sync_workload
from ddiloco.operator import conditions as c
from tests.unit.test_operator_reconcile import (
    cond,
    healthy_pods,
    observe,
    pod,
    step,
    verbs,
)
from tests.unit.test_operator_reconcile import make_job as make_reconcile_job

PVC_VOLUME = {"name": "data", "persistentVolumeClaim": {"claimName": "corpus", "readOnly": True}}
PVC_MOUNT = {"name": "data", "mountPath": "/data", "readOnly": True}


def make_job(group: dict[str, Any] | None = None, **spec: Any) -> api.DecoupledDiLoCoJob:
    body: dict[str, Any] = {
        "metadata": {"name": "tpl", "namespace": "ns", "uid": "job-1", "generation": 1},
        "spec": {
            "image": "ddiloco:dev",
            "training": {"model": "tiny"},
            "learnerGroups": [{"name": "a", "replicas": 2, **(group or {})}],
            **spec,
        },
    }
    return api.DecoupledDiLoCoJob.from_body(body)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_a_pvc_volume_and_mount_land_in_the_learner_and_the_spare_pod() -> None:
    job = make_job(
        {
            "volumes": [PVC_VOLUME],
            "volumeMounts": [PVC_MOUNT],
            "env": [{"name": "HF_HOME", "value": "/data/hf"}],
            "envFrom": [{"configMapRef": {"name": "team-env"}}],
            "serviceAccountName": "trainer",
            "imagePullSecrets": [{"name": "registry"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}},
            "securityContext": {"runAsUser": 1234},
            "containerSecurityContext": {"allowPrivilegeEscalation": False},
            "initContainers": [{"name": "fetch", "image": "busybox", "command": ["true"]}],
        },
        failurePolicy={"hotSpares": 1},
    )
    assert api.validate(job.spec) == []
    group = job.spec.learner_groups[0]
    for built in (
        builders.build_learner_pod(job, group, 1),
        builders.build_spare_pod(job, group, 0),
    ):
        spec = built["spec"]
        (container,) = spec["containers"]
        assert PVC_VOLUME in spec["volumes"] and PVC_MOUNT in container["volumeMounts"]
        # the operator's own volumes and mounts are all still there, first
        assert [v["name"] for v in spec["volumes"]][:1] == ["token"]
        assert container["volumeMounts"][0]["mountPath"] == builders.TOKEN_DIR
        env = env_of(container)
        assert env["HF_HOME"] == "/data/hf" and "DDILOCO_SYNC_URL" in env
        assert container["envFrom"] == [{"configMapRef": {"name": "team-env"}}]
        assert container["securityContext"] == {"allowPrivilegeEscalation": False}
        assert spec["serviceAccountName"] == "trainer"
        assert spec["imagePullSecrets"] == [{"name": "registry"}]
        assert "nodeAffinity" in spec["affinity"]
        # merged over the operator's: its fsGroup keeps the Secret files readable
        assert spec["securityContext"] == {"fsGroup": builders.IMAGE_UID, "runAsUser": 1234}
        assert spec["initContainers"] == [
            {"name": "fetch", "image": "busybox", "command": ["true"]}
        ]
        assert spec["automountServiceAccountToken"] is False


def test_without_template_fields_the_pod_is_as_before() -> None:
    job = make_job()
    spec = builders.build_learner_pod(job, job.spec.learner_groups[0], 0)["spec"]
    for key in ("affinity", "serviceAccountName", "imagePullSecrets", "initContainers"):
        assert key not in spec
    assert "envFrom" not in spec["containers"][0]
    assert spec["securityContext"] == {"fsGroup": builders.IMAGE_UID}


def test_the_synchronizer_takes_its_template_too() -> None:
    job = make_job(
        synchronizer={
            "volumes": [PVC_VOLUME],
            "volumeMounts": [PVC_MOUNT],
            "env": [{"name": "TZ", "value": "UTC"}],
            "serviceAccountName": "sync",
        }
    )
    template = sync_workload.build_synchronizer_statefulset(job)["spec"]["template"]["spec"]
    (container,) = template["containers"]
    assert PVC_VOLUME in template["volumes"] and PVC_MOUNT in container["volumeMounts"]
    assert env_of(container)["TZ"] == "UTC"
    assert template["serviceAccountName"] == "sync"
    assert template["securityContext"]["runAsNonRoot"] is True  # the operator's, kept


@pytest.mark.parametrize(
    ("template", "field", "named"),
    [
        ({"env": [{"name": "DDILOCO_SYNC_URL", "value": "http://evil"}]}, "env[0]", "DDILOCO_SYNC_URL"),
        ({"env": [{"name": "X", "value": "1"}, {"name": "DDILOCO_NEW"}]}, "env[1]", "DDILOCO_NEW"),
        ({"volumes": [{"name": "token", "emptyDir": {}}]}, "volumes[0]", "token"),
        ({"volumeMounts": [{"name": "data", "mountPath": "/var/run/ddiloco/token"}]}, "volumeMounts[0]", "/var/run/ddiloco/token"),
        ({"volumeMounts": [{"name": "data", "mountPath": "/var/run/ddiloco"}]}, "volumeMounts[0]", "/var/run/ddiloco"),
        ({"volumeMounts": [{"name": "data", "mountPath": "/dev/shm"}]}, "volumeMounts[0]", "/dev/shm"),
        ({"volumeMounts": [{"name": "trust", "mountPath": "/x"}]}, "volumeMounts[0]", "trust"),
        ({"initContainers": [{"name": "learner", "image": "x"}]}, "initContainers[0]", "learner"),
    ],
)  # fmt: skip
def test_a_template_that_overrides_an_owned_field_is_refused_naming_it(
    template: dict[str, Any], field: str, named: str
) -> None:
    job = make_job(template)
    problems = api.validate(job.spec)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"learnerGroups[a].{field}: ") and named in problems[0]
    sync_job = make_job(synchronizer=template)
    (problem,) = api.validate(sync_job.spec)
    assert problem.startswith(f"synchronizer.{field}: ")


def test_a_refused_template_makes_the_job_invalid_and_builds_nothing() -> None:
    job = make_reconcile_job(
        learnerGroups=[
            {"name": "home", "replicas": 1, "env": [{"name": "DDILOCO_H", "value": "1"}]}
        ]
    )
    job, plan = step(job, observe(job))
    assert plan.actions == [] and job.status.phase == "Invalid"
    ready = c.get(job.status.conditions, c.READY)
    assert ready is not None and ready.reason == c.INVALID_SPEC
    assert "learnerGroups[home].env[0]: env DDILOCO_H is set by the operator" in ready.message


def test_mounts_elsewhere_are_fine() -> None:
    job = make_job({"volumeMounts": [{"name": "x", "mountPath": "/var/run/ddiloco-data"}]})
    assert api.validate(job.spec) == []


def test_the_owned_names_cover_every_volume_and_mount_the_operator_makes() -> None:
    job = make_job(
        {"gpusPerLearner": 1},
        synchronizer={"tls": {"mutual": True}},
        failurePolicy={"hotSpares": 1},
    )
    group = job.spec.learner_groups[0]
    sts = sync_workload.build_synchronizer_statefulset(job)
    pod_specs = [
        builders.build_learner_pod(job, group, 0)["spec"],
        builders.build_spare_pod(job, group, 0)["spec"],
        sts["spec"]["template"]["spec"],
    ]
    volumes = {v["name"] for s in pod_specs for v in s["volumes"]} | {builders.STATE_TEMPLATE}
    assert volumes <= set(api.OWNED_VOLUMES)
    for s in pod_specs:
        for m in s["containers"][0]["volumeMounts"]:
            assert any(
                m["mountPath"] == o or m["mountPath"].startswith(o + "/")
                for o in api.OWNED_MOUNT_PATHS
            ), m
        assert {x["name"] for x in s["containers"]} <= set(api.OWNED_CONTAINERS)
        assert all(e["name"].startswith(api.OWNED_ENV_PREFIX) for e in s["containers"][0]["env"])


def test_init_from_reaches_learners_and_spares_and_total_tokens_every_shard() -> None:
    job = make_job(
        training={
            "model": "tiny",
            "initFrom": "/models/start",
            "totalTokens": 1000,
            "fragments": 2,
        },
        synchronizer={"shards": 2},
        failurePolicy={"hotSpares": 1},
    )
    group = job.spec.learner_groups[0]
    for built in (
        builders.build_learner_pod(job, group, 0),
        builders.build_spare_pod(job, group, 0),
    ):
        assert env_of(built["spec"]["containers"][0])["DDILOCO_INIT_FROM"] == "/models/start"
    sts = sync_workload.build_synchronizer_statefulset(job)  # one template: every shard's pod
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert env_of(container)["DDILOCO_TOTAL_TOKENS"] == "1000"
    plain = make_job()
    assert "DDILOCO_INIT_FROM" not in env_of(
        builders.build_learner_pod(plain, plain.spec.learner_groups[0], 0)["spec"]["containers"][0]
    )
    (container,) = sync_workload.build_synchronizer_statefulset(plain)["spec"]["template"]["spec"][
        "containers"
    ]
    assert "DDILOCO_TOTAL_TOKENS" not in env_of(container)


def test_init_from_is_a_path_and_total_tokens_not_negative() -> None:
    with pytest.raises(ValueError):
        make_job(training={"model": "tiny", "initFrom": "relative/dir"})
    with pytest.raises(ValueError):
        make_job(training={"model": "tiny", "totalTokens": -1})


BUDGET = 10_000


def budget_job() -> api.DecoupledDiLoCoJob:
    return make_reconcile_job(
        training={"model": "tiny", "totalTokens": BUDGET},
        failurePolicy={"maxReplacementsPerSlot": 2, "backoffSeconds": 0, "hotSpares": 1},
    )


def answer(**fields: Any) -> dict[str, Any]:
    return {"global_version": 7, "tokens_merged": 4200, "total_tokens": BUDGET, **fields}


def test_progress_and_time_left_come_from_the_synchronizer() -> None:
    job = budget_job()
    home_pods, remote_pods = healthy_pods()
    sync = answer(progress=0.42, estimated_remaining_seconds=123.4)
    job, _ = step(job, observe(job, home_pods, remote_pods, sync=sync))
    assert job.status.progress_percentage == 42
    assert job.status.estimated_remaining_seconds == 123
    assert job.status.phase != "Succeeded"
    # a rate near zero: the estimate is capped, so the status stays writable
    far = answer(progress=0.0, estimated_remaining_seconds=1e30)
    job, _ = step(job, observe(job, home_pods, remote_pods, sync=far))
    assert job.status.estimated_remaining_seconds == 2**31 - 1
    job, _ = step(job, observe(job, home_pods, remote_pods, sync=sync))
    # not answering: the last figures stand
    job, _ = step(job, observe(job, home_pods, remote_pods, sync=None))
    assert (job.status.progress_percentage, job.status.estimated_remaining_seconds) == (42, 123)


def test_a_job_without_a_budget_shows_no_progress() -> None:
    job = make_reconcile_job()
    home_pods, remote_pods = healthy_pods()
    job, _ = step(job, observe(job, home_pods, remote_pods, sync=answer(progress=0.5)))
    assert job.status.progress_percentage is None
    assert job.status.estimated_remaining_seconds is None


def test_the_merged_budget_makes_the_job_succeed_without_replacing_learners() -> None:
    job = budget_job()
    done = answer(progress=1.0, estimated_remaining_seconds=0.0, finished=True)
    # learners exit 0 (one already did, one is still handing over, one pod is gone)
    home_pods = (pod("home", 0, "h0", phase="Succeeded", ready=False), pod("home", 1, "h1"))
    job, plan = step(job, observe(job, home_pods, (), sync=done))
    assert job.status.phase == "Succeeded"
    assert cond(job, c.READY) == ("False", c.TOKEN_BUDGET_REACHED)
    ready = c.get(job.status.conditions, c.READY)
    assert ready is not None and f"training.totalTokens ({BUDGET} tokens)" in ready.message
    assert (job.status.progress_percentage, job.status.estimated_remaining_seconds) == (100, 0)
    assert not [v for v in verbs(plan) if v[:2] == ("create", "Pod")]  # no learner, no spare
    assert job.status.unhealthy_slots == 0
    # every learner has exited 0; the synchronizer no longer needs to answer
    home_pods = (pod("home", 0, "h0", "Succeeded", False), pod("home", 1, "h1", "Succeeded", False))
    remote_pods = (pod("ra", 0, "r0", "Succeeded", False),)
    job, plan = step(job, observe(job, home_pods, remote_pods, sync=None))
    assert job.status.phase == "Succeeded"
    assert cond(job, c.READY) == ("False", c.TOKEN_BUDGET_REACHED)
    assert not [v for v in verbs(plan) if v[0] in ("create", "delete") and v[1] == "Pod"]


def test_an_answer_for_another_budget_does_not_finish_the_job() -> None:
    job = budget_job()
    home_pods, remote_pods = healthy_pods()
    stale = answer(total_tokens=BUDGET // 2, progress=1.0, finished=True)
    job, _ = step(job, observe(job, home_pods, remote_pods, sync=stale))
    assert job.status.phase != "Succeeded"
    assert job.status.progress_percentage is None


def test_before_the_budget_a_pod_that_exits_0_is_not_replaced_but_a_failed_one_is() -> None:
    job = budget_job()
    home_pods = (pod("home", 0, "h0", "Succeeded", False), pod("home", 1, "h1", "Failed", False))
    remote_pods = (pod("ra", 0, "r0"),)
    job, _ = step(job, observe(job, home_pods, remote_pods, sync=answer(progress=0.5)))
    job, plan = step(job, observe(job, home_pods[:1], remote_pods, sync=answer(progress=0.5)))
    created = [v for v in verbs(plan) if v[:2] == ("create", "Pod") and "spare" not in v[2]]
    assert created == [("create", "Pod", "tiny-home-1")]


def test_the_crd_prints_progress_and_time_left() -> None:
    from ddiloco.operator import crd

    columns = {col["name"]: col["jsonPath"] for col in crd.PRINTER_COLUMNS}
    assert columns["Progress"] == ".status.progressPercentage"
    assert columns["Remaining"] == ".status.estimatedRemainingSeconds"
    status = crd.openapi_schema()["properties"]["status"]["properties"]
    assert status["progressPercentage"]["type"] == "integer"
    group = crd.openapi_schema()["properties"]["spec"]["properties"]["learnerGroups"]["items"]
    env_item = group["properties"]["env"]["items"]
    assert env_item["x-kubernetes-preserve-unknown-fields"] is True
    assert "DDILOCO_" in env_item["x-kubernetes-validations"][0]["rule"]
