"""A learner pod's compute: GPUs, processes per learner, /dev/shm and the SIGTERM budget.

    from ddiloco.operator import compute
    compute.gpus(group)                  # gpusPerLearner, or resources' nvidia.com/gpu
    compute.apply(group, pod_spec)       # builders.build_learner_pod calls it

Pure functions of a learner group (builders.py puts the result into the pod):

- `gpusPerLearner: N` requests and limits N `nvidia.com/gpu`, tolerates the `nvidia.com/gpu`
  taint GPU pools carry, and runs the learner as a group of N processes
  (DDILOCO_NPROC_PER_NODE; `ddiloco learner` spawns them, one per GPU).
- /dev/shm is an emptyDir of medium Memory with a size limit (`shmSize`, else `default_shm`),
  mounted over the runtime's 64 MiB one: NCCL's shared-memory transport and data loader workers
  need more than that between a learner's processes.
- `terminationGracePeriodSeconds` goes into the pod, and DDILOCO_DRAIN_S = that minus a margin
  (`drain_seconds`): the learner's SIGTERM flush (hand over every fragment, wait up to drain_s
  for the uploads) ends before the kubelet's SIGKILL.
"""

from __future__ import annotations

import math
import re
from typing import Any, Final

from ddiloco.operator.api import GPU_RESOURCE, LearnerGroup

SHM_VOLUME: Final = "dshm"
SHM_PATH: Final = "/dev/shm"
SHM_PER_GPU: Final = 1 << 30
"""Default /dev/shm per GPU (1 GiB). NCCL's shared-memory segments grow with the number of
local peers and channels (NCCL_BUFFSIZE, 4 MiB, per channel and peer), and each rank's data
loader workers pass whole batches through it; 1 GiB is what NVIDIA's containers are commonly
run with (`--shm-size=1g`), here per rank. Only what is written is allocated."""
SHM_MEMORY_SHARE: Final = 0.5
"""The default never exceeds this share of the container's memory limit: tmpfs pages count
against the pod's memory cgroup, so a bigger limit would turn a clear "No space left on device"
from NCCL into an OOM kill of the training processes."""
DRAIN_MARGIN_SHARE: Final = 0.25
DRAIN_MARGIN_MIN_S: Final = 5.0
"""drain_s = grace - max(5 s, grace / 4): the margin covers what comes before and after the
wait for uploads (finishing the current inner step, process exit, CUDA and NCCL teardown)."""
GPU_TOLERATION: Final = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}

_QUANTITY: Final = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[kMGTPE]|[eE][0-9]+)?$")
_FACTOR: Final = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    **{s: 1 << (10 * (i + 1)) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
}


def parse_bytes(value: int | str) -> int | None:
    """Bytes of a Kubernetes byte quantity (8Gi, 512M, 1e9, 1073741824); None if it is not one
    (e.g. milli-units, which no memory size uses)."""
    if isinstance(value, int):
        return value
    match = _QUANTITY.match(value.strip())
    if match is None:
        return None
    number, suffix = match.group(1), match.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return math.ceil(float(number) * 10 ** int(suffix[1:]))
    return math.ceil(float(number) * _FACTOR[suffix])


def format_bytes(n: int) -> str:
    """The shortest exact binary quantity for n bytes: 8Gi, 1536Mi, 1000."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = _FACTOR[suffix]
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def gpus(group: LearnerGroup) -> int:
    """GPUs of one learner pod: gpusPerLearner, else a whole nvidia.com/gpu in resources (the
    spelling before gpusPerLearner; the CRD refuses both at once), else 0."""
    if group.gpus_per_learner:
        return group.gpus_per_learner
    for where in (group.resources.limits, group.resources.requests):
        value = where.get(GPU_RESOURCE)
        if value is not None and str(value).isdigit():
            return int(str(value))
    return 0


def nproc(group: LearnerGroup) -> int:
    """Training processes of one learner: one per GPU, one on CPU."""
    return max(1, gpus(group))


def memory_limit(group: LearnerGroup) -> int | None:
    value = group.resources.limits.get("memory")
    return parse_bytes(value) if value is not None else None


def default_shm(group: LearnerGroup) -> int | None:
    """Bytes of /dev/shm without a shmSize: SHM_PER_GPU per GPU, at most SHM_MEMORY_SHARE of
    the memory limit; None (the runtime's own) for a CPU learner."""
    n = gpus(group)
    if n == 0:
        return None
    size = SHM_PER_GPU * n
    limit = memory_limit(group)
    if limit is not None:
        size = min(size, int(limit * SHM_MEMORY_SHARE))
    return size


def shm_size(group: LearnerGroup) -> str | None:
    """The sizeLimit of the learner's /dev/shm volume, or None for no such volume."""
    if group.shm_size is not None:
        return str(group.shm_size)
    size = default_shm(group)
    return format_bytes(size) if size else None


def drain_seconds(grace_s: float) -> float:
    """DDILOCO_DRAIN_S for a pod with this terminationGracePeriodSeconds (DRAIN_MARGIN_*)."""
    return max(0.0, grace_s - max(DRAIN_MARGIN_MIN_S, grace_s * DRAIN_MARGIN_SHARE))


def env(group: LearnerGroup) -> dict[str, Any]:
    """The learner's environment from its group's compute (builders._env turns it into a list)."""
    return {
        "DDILOCO_NPROC_PER_NODE": nproc(group),
        "DDILOCO_DRAIN_S": drain_seconds(group.termination_grace_period_seconds),
    }


def resources(group: LearnerGroup) -> dict[str, dict[str, str]]:
    """The container's resources: the group's, plus gpusPerLearner as requests and limits
    (an extended resource must have both equal, or limits alone)."""
    out = group.resources.to_k8s()
    if group.gpus_per_learner:
        for key in ("requests", "limits"):
            out.setdefault(key, {})[GPU_RESOURCE] = str(group.gpus_per_learner)
    return out


def apply(group: LearnerGroup, pod_spec: dict[str, Any]) -> None:
    """Put the group's compute into a learner pod spec (one container, the learner): its
    resources, the grace period, /dev/shm and, with GPUs, the GPU taint's toleration."""
    (container,) = pod_spec["containers"]
    container["resources"] = resources(group)
    pod_spec["terminationGracePeriodSeconds"] = group.termination_grace_period_seconds
    size = shm_size(group)
    if size is not None:
        pod_spec["volumes"] = [
            *pod_spec.get("volumes", []),
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": size}},
        ]
        container["volumeMounts"] = [
            *container.get("volumeMounts", []),
            {"name": SHM_VOLUME, "mountPath": SHM_PATH},
        ]
    if gpus(group):
        tolerations = pod_spec.get("tolerations", [])
        if not any(_tolerates(t) for t in tolerations):
            pod_spec["tolerations"] = [*tolerations, dict(GPU_TOLERATION)]


def _tolerates(t: dict[str, Any]) -> bool:
    """Whether the group already says how to treat the nvidia.com/gpu taint (its own key, any
    value or effect), or tolerates every taint."""
    return t.get("key") == GPU_RESOURCE or (not t.get("key") and t.get("operator") == "Exists")
