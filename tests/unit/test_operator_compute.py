"""A learner pod's compute (operator/compute.py): gpusPerLearner, processes per learner,
/dev/shm, terminationGracePeriodSeconds and the SIGTERM drain budget, in slot and spare pods.

    .venv/bin/pytest tests/unit/test_operator_compute.py

The pods are the builders' own; the apiserver and scheduler see the same in
tests/integration/test_operator_gpus.py, and the learner reads the env in
tests/unit/test_env_contract.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from ddiloco.operator import api, builders, compute

CRD = (
    Path(__file__).resolve().parents[2] / "deploy" / "crds" / "ddiloco.dev_decoupleddilocojobs.yaml"
)


def make_job(**group: Any) -> api.DecoupledDiLoCoJob:
    return api.DecoupledDiLoCoJob.from_body(
        {
            "metadata": {"name": "g", "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": {
                "image": "ddiloco:dev",
                "training": {"model": "tiny"},
                "learnerGroups": [{"name": "a", "replicas": 2, **group}],
            },
        }
    )


def pod_of(job: api.DecoupledDiLoCoJob, spare: bool = False) -> dict[str, Any]:
    group = job.spec.learner_groups[0]
    if spare:
        return builders.build_spare_pod(job, group, 0)
    return builders.build_learner_pod(job, group, 0)


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def shm(pod: dict[str, Any]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The /dev/shm volume of a pod (or None) and the mounts of /dev/shm."""
    (container,) = pod["spec"]["containers"]
    mounts = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    names = {m["name"] for m in mounts}
    volumes = [v for v in pod["spec"]["volumes"] if v["name"] in names]
    assert len(volumes) <= 1
    return (volumes[0] if volumes else None), mounts


# --------------------------------------------------------------------------- GPUs and processes


def test_gpus_per_learner_become_the_pods_gpus_processes_shm_and_toleration() -> None:
    job = make_job(
        gpusPerLearner=8,
        resources={"requests": {"cpu": "48", "memory": "512Gi"}, "limits": {"memory": "640Gi"}},
    )
    pod = pod_of(job)
    (container,) = pod["spec"]["containers"]
    assert container["resources"] == {
        "requests": {"cpu": "48", "memory": "512Gi", "nvidia.com/gpu": "8"},
        "limits": {"memory": "640Gi", "nvidia.com/gpu": "8"},
    }
    assert env_of(pod)["DDILOCO_NPROC_PER_NODE"] == "8"
    volume, mounts = shm(pod)
    assert volume == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}
    assert mounts == [{"name": "dshm", "mountPath": "/dev/shm"}]  # writable, no subPath
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"][
        "tolerations"
    ]


def test_a_cpu_learner_is_one_process_without_a_shm_volume_or_gpu_toleration() -> None:
    pod = pod_of(make_job(resources={"requests": {"cpu": "2"}}))
    (container,) = pod["spec"]["containers"]
    assert container["resources"] == {"requests": {"cpu": "2"}}
    assert env_of(pod)["DDILOCO_NPROC_PER_NODE"] == "1"
    assert shm(pod) == (None, [])
    assert "tolerations" not in pod["spec"]


def test_the_older_gpu_spelling_in_resources_counts_the_same() -> None:
    # a job written before gpusPerLearner: its limit is the learner's GPU count
    pod = pod_of(make_job(resources={"limits": {"nvidia.com/gpu": 4}}))
    (container,) = pod["spec"]["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "4"}}
    assert env_of(pod)["DDILOCO_NPROC_PER_NODE"] == "4"
    assert shm(pod)[0]["emptyDir"]["sizeLimit"] == "4Gi"  # type: ignore[index]


def test_the_group_s_own_gpu_toleration_is_kept_not_doubled() -> None:
    mine = {
        "key": "nvidia.com/gpu",
        "operator": "Equal",
        "value": "present",
        "effect": "NoSchedule",
    }
    pod = pod_of(make_job(gpusPerLearner=1, tolerations=[mine]))
    assert pod["spec"]["tolerations"] == [mine]


@pytest.mark.parametrize(
    ("group", "size"),
    [
        ({"gpusPerLearner": 2}, "2Gi"),  # 1Gi per GPU without a memory limit
        ({"gpusPerLearner": 8, "resources": {"limits": {"memory": "6Gi"}}}, "3Gi"),  # half
        ({"gpusPerLearner": 8, "resources": {"limits": {"memory": "64G"}}}, "8Gi"),
        ({"gpusPerLearner": 4, "resources": {"limits": {"memory": "3000Mi"}}}, "1500Mi"),
        ({"gpusPerLearner": 8, "shmSize": "32Gi"}, "32Gi"),  # as the spec says
        ({"gpusPerLearner": 1, "shmSize": 268435456}, "268435456"),
        ({"shmSize": "2Gi"}, "2Gi"),  # a CPU learner gets one only when asked
    ],
)
def test_shm_size_defaults_to_1gi_per_gpu_within_half_the_memory_limit(
    group: dict[str, Any], size: str
) -> None:
    volume, mounts = shm(pod_of(make_job(**group)))
    assert volume is not None and len(mounts) == 1
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": size}


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("8Gi", 8 << 30),
        ("1.5Gi", 3 << 29),
        ("64G", 64 * 10**9),
        ("512M", 512 * 10**6),
        ("100k", 100_000),
        ("1e9", 10**9),
        ("4096", 4096),
        (".5Ki", 512),
        (4096, 4096),
        ("2m", None),  # milli-bytes: not a size
        ("lots", None),
        ("-1Gi", None),
    ],
)
def test_byte_quantities_parse_as_the_apiserver_reads_them(text: int | str, n: int | None) -> None:
    assert compute.parse_bytes(text) == n


def test_formatted_sizes_are_exact_and_parse_back() -> None:
    for n in (1 << 30, 3 << 29, 1536 << 20, 1000, 7, 5 << 40):
        text = compute.format_bytes(n)
        assert compute.parse_bytes(text) == n
    assert (compute.format_bytes(8 << 30), compute.format_bytes(1536 << 20)) == ("8Gi", "1536Mi")


# --------------------------------------------------------------------------- grace and drain


def test_grace_period_defaults_to_60s_and_drain_ends_before_sigkill() -> None:
    pod = pod_of(make_job())
    assert pod["spec"]["terminationGracePeriodSeconds"] == 60
    assert float(env_of(pod)["DDILOCO_DRAIN_S"]) == 45.0


@pytest.mark.parametrize(("grace", "drain"), [(10, 5.0), (15, 10.0), (30, 22.5), (120, 90.0)])
def test_drain_is_the_grace_period_minus_a_margin(grace: int, drain: float) -> None:
    pod = pod_of(make_job(terminationGracePeriodSeconds=grace))
    assert pod["spec"]["terminationGracePeriodSeconds"] == grace
    got = float(env_of(pod)["DDILOCO_DRAIN_S"])
    assert got == drain
    assert 0 < got <= grace - compute.DRAIN_MARGIN_MIN_S  # at least 5 s left for the exit


def test_a_hot_spare_gets_the_slot_pods_compute() -> None:
    job = make_job(
        gpusPerLearner=4, terminationGracePeriodSeconds=90, resources={"limits": {"memory": "64Gi"}}
    )
    slot, spare = pod_of(job), pod_of(job, spare=True)
    for key in ("terminationGracePeriodSeconds", "tolerations"):
        assert spare["spec"][key] == slot["spec"][key]
    assert spare["spec"]["containers"][0]["resources"] == slot["spec"]["containers"][0]["resources"]
    assert shm(spare) == shm(slot) and shm(spare)[0] is not None
    for name in ("DDILOCO_NPROC_PER_NODE", "DDILOCO_DRAIN_S"):
        assert env_of(spare)[name] == env_of(slot)[name]
    assert (env_of(spare)["DDILOCO_NPROC_PER_NODE"], env_of(spare)["DDILOCO_DRAIN_S"]) == (
        "4",
        "67.5",
    )


# --------------------------------------------------------------------------- what is refused


@pytest.mark.parametrize(
    ("group", "field"),
    [
        ({"gpusPerLearner": -1}, "gpusPerLearner"),
        ({"gpusPerLearner": 65}, "gpusPerLearner"),
        ({"shmSize": "lots"}, "shmSize"),
        ({"shmSize": "2m"}, "shmSize"),
        ({"shmSize": 0}, "shmSize"),
        ({"terminationGracePeriodSeconds": 5}, "terminationGracePeriodSeconds"),
        ({"terminationGracePeriodSeconds": 7200}, "terminationGracePeriodSeconds"),
    ],
)
def test_bad_compute_values_are_refused_by_the_models(group: dict[str, Any], field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        make_job(**group)
    assert field in str(err.value) or compute_field(field) in str(err.value)


def compute_field(alias: str) -> str:
    """The Python name of a LearnerGroup field, as pydantic may name it in an error."""
    return next(n for n, f in api.LearnerGroup.model_fields.items() if f.alias == alias)


def test_gpus_named_twice_are_refused_with_one_clear_sentence() -> None:
    job = make_job(gpusPerLearner=2, resources={"limits": {"nvidia.com/gpu": 2}})
    (problem,) = api.validate(job.spec)
    assert problem.startswith("learnerGroups[a]: ") and "gpusPerLearner" in problem
    assert "once" in problem


def test_the_crd_carries_the_bounds_the_pattern_and_the_rule() -> None:
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    group = spec["properties"]["learnerGroups"]["items"]
    props = group["properties"]
    gpus = props["gpusPerLearner"]
    assert (gpus["type"], gpus["minimum"], gpus["maximum"], gpus["default"]) == (
        "integer",
        0,
        64,
        0,
    )
    grace = props["terminationGracePeriodSeconds"]
    assert (grace["minimum"], grace["maximum"], grace["default"]) == (10, 3600, 60)
    size = props["shmSize"]
    assert size["x-kubernetes-int-or-string"] and size["pattern"] == api.BYTES_QUANTITY
    rules = [r["message"] for r in group["x-kubernetes-validations"]]
    assert api.GPU_TWICE_MESSAGE in rules
