"""GPU learners on a real control plane: gpusPerLearner, /dev/shm, the grace period.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_gpus.py

The operator runs as in production (operator_helpers.py) against a real apiserver and
scheduler; kwok's fake nodes advertise 8 `nvidia.com/gpu` each (k8senv.FAKE_NODE_CAPACITY),
two per cluster, so the scheduler's own accounting says whether the pods asked for what the
spec meant: 16 GPUs fit four learners of 4 (three slots and a hot spare) and not a fifth.
The apiserver's schema and CEL rules refuse bad values before the operator sees them.
"""

from __future__ import annotations

from typing import Any

import k8senv
import operator_helpers as h
import pytest
import yaml
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration

GROUP = {
    "name": "gpu",
    "replicas": 3,
    "gpusPerLearner": 4,
    "resources": {"requests": {"cpu": "8", "memory": "48Gi"}, "limits": {"memory": "64Gi"}},
    "terminationGracePeriodSeconds": 30,
}


def env_of(pod: Any) -> dict[str, Any]:
    return {e.name: e.value for e in pod.spec.containers[0].env}


def check_compute(pod: Any) -> None:
    """What a learner pod of GROUP must carry, as the apiserver stored it."""
    (container,) = pod.spec.containers
    assert container.resources.requests == {"cpu": "8", "memory": "48Gi", "nvidia.com/gpu": "4"}
    assert container.resources.limits == {"memory": "64Gi", "nvidia.com/gpu": "4"}
    env = env_of(pod)
    assert (env["DDILOCO_NPROC_PER_NODE"], env["DDILOCO_DRAIN_S"]) == ("4", "22.5")
    assert pod.spec.termination_grace_period_seconds == 30
    (shm,) = [v for v in pod.spec.volumes if v.empty_dir is not None]
    assert (shm.empty_dir.medium, shm.empty_dir.size_limit) == ("Memory", "4Gi")
    (mount,) = [m for m in container.volume_mounts if m.mount_path == "/dev/shm"]
    assert mount.name == shm.name and not mount.read_only
    assert any(t.key == "nvidia.com/gpu" and t.operator == "Exists" for t in pod.spec.tolerations)


def test_a_gpu_job_gets_its_gpus_shm_and_grace_and_the_scheduler_counts_them(
    cl: h.Clusters, operator: h.Operator
) -> None:
    body = h.job_manifest("gpus", [GROUP], failurePolicy={"hotSpares": 1, "backoffSeconds": 0.5})
    body["spec"]["training"]["dataParts"] = 4  # scaling to 4 below restarts no learner
    h.create_job(cl, body)
    job = h.wait_condition(cl, "gpus", "Ready", timeout=90)
    assert job["status"]["readyLearners"] == 3

    def placed() -> list[Any] | None:
        pods = cl.pods("home", "gpus")
        ok = len(pods) == 4 and all(p.spec.node_name and p.status.phase == "Running" for p in pods)
        return pods if ok else None

    pods = k8senv.wait_until("3 slots and a spare bound and Running", placed, timeout=60)
    roles = sorted(p.metadata.labels.get("ddiloco.dev/role", "learner") for p in pods)
    assert roles == ["learner", "learner", "learner", "spare"]
    for p in pods:  # the hot spare is compute-wise a slot's pod
        check_compute(p)
    per_node: dict[str, int] = {}
    for p in pods:
        per_node[p.spec.node_name] = per_node.get(p.spec.node_name, 0) + 4
    assert sorted(per_node.values()) == [8, 8]  # 4 GPUs each: two per 8-GPU node, no more

    # a fourth slot asks for GPUs no node has left: the scheduler says so, the job waits
    cl.kubectl(
        "patch", "ddj", "gpus", "--type=json",
        "-p", '[{"op": "replace", "path": "/spec/learnerGroups/0/replicas", "value": 4}]',
    )  # fmt: skip

    def unschedulable() -> str | None:
        for p in cl.pods("home", "gpus"):
            if p.metadata.labels.get("ddiloco.dev/learner-id") != "gpu-3":
                continue
            for cond in p.status.conditions or []:
                if cond.type == "PodScheduled" and cond.reason == "Unschedulable":
                    return str(cond.message)
        return None

    try:
        message = k8senv.wait_until("slot gpu-3 unschedulable", unschedulable, timeout=60)
    except TimeoutError as e:
        seen = [
            (p.metadata.name, p.status.phase, p.spec.node_name) for p in cl.pods("home", "gpus")
        ]
        raise TimeoutError(f"{e}; pods: {seen}\n{operator.tail()}") from None
    assert "nvidia.com/gpu" in message, message
    job = h.wait_condition(cl, "gpus", "LearnersReady", "False", "LearnersNotReady", timeout=30)
    assert "gpu-3" in h.condition(job, "LearnersReady")["message"]


REFUSED = [
    (
        "gpus named twice",
        {"gpusPerLearner": 2, "resources": {"limits": {"nvidia.com/gpu": 2}}},
        "name the GPUs once, in gpusPerLearner",
    ),
    ("too many gpus", {"gpusPerLearner": 65}, "should be less than or equal to 64"),
    ("shm not a size", {"shmSize": "lots"}, "shmSize"),
    ("shm in milli-bytes", {"shmSize": "100m"}, "shmSize"),
    ("grace too short", {"terminationGracePeriodSeconds": 5}, "greater than or equal to 10"),
]


@pytest.mark.parametrize(("what", "group", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_bad_compute_values_are_refused_by_the_apiserver(
    cl: h.Clusters, what: str, group: dict[str, Any], message: str
) -> None:
    body = h.job_manifest("bad", [{"name": "a", "replicas": 1, **group}])
    done = cl.kubectl("apply", "-f", "-", input=yaml.safe_dump(body), check=False)
    assert done.returncode != 0, f"{what}: accepted"
    assert message in done.stderr, done.stderr
    assert "bad" not in cl.kubectl("get", "ddj", "-o", "name").stdout


def test_a_good_shm_size_and_the_older_gpu_spelling_are_accepted(cl: h.Clusters) -> None:
    # the CEL rule and the pattern must not refuse what they should let through
    groups = [
        {"name": "a", "replicas": 1, "gpusPerLearner": 2, "shmSize": "1536Mi"},
        {"name": "b", "replicas": 1, "shmSize": 1073741824},
        {"name": "c", "replicas": 1, "resources": {"limits": {"nvidia.com/gpu": 1}}},
    ]
    h.create_job(cl, h.job_manifest("fine", groups), volume=False)
    stored = cl.job("fine")["spec"]["learnerGroups"]
    assert [g.get("shmSize") for g in stored] == ["1536Mi", 1073741824, None]
    assert [g["terminationGracePeriodSeconds"] for g in stored] == [60, 60, 60]  # defaulted
