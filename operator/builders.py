"""Manifests of everything a DecoupledDiLoCoJob owns, as plain dicts (like dask's build_*_spec).

    from ddiloco.operator import builders
    pod = builders.build_learner_pod(job, group, index)     # what the operator would create

Pure functions of the job (and, for Secrets, the token): no API calls, no clock. reconcile.py
decides which of them to create; clusters.py sends them. The synchronizer and learner are
configured only through environment variables (the contract of `ddiloco synchronizer` and
`ddiloco learner`); the token reaches them through a Secret, never through the pod spec.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any, Final

from ddiloco.operator.api import DecoupledDiLoCoJob, LearnerGroup

SYNC_PORT: Final = 8470
STATE_DIR: Final = "/var/lib/ddiloco"
TOKEN_KEY: Final = "token"

# Labels: the recommended app.kubernetes.io set, plus ours to select a job's objects. The job's
# uid tells a pod of this job from a leftover of an earlier job with the same name.
LABEL_JOB: Final = "ddiloco.dev/job"
LABEL_JOB_UID: Final = "ddiloco.dev/job-uid"
LABEL_GROUP: Final = "ddiloco.dev/group"
LABEL_SLOT: Final = "ddiloco.dev/slot"
LABEL_LEARNER_ID: Final = "ddiloco.dev/learner-id"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
ANNOTATION_SPEC_HASH: Final = "ddiloco.dev/spec-hash"
MANAGED_BY: Final = "ddiloco-operator"


def token_secret_name(job: DecoupledDiLoCoJob) -> str:
    return f"{job.name}-token"


def synchronizer_name(job: DecoupledDiLoCoJob) -> str:
    return f"{job.name}-synchronizer"


def state_claim_name(job: DecoupledDiLoCoJob) -> str:
    return f"{job.name}-synchronizer-state"


def learner_id(group: str, index: int) -> str:
    return f"{group}-{index}"


def learner_pod_name(job: DecoupledDiLoCoJob, group: str, index: int) -> str:
    return f"{job.name}-{group}-{index}"


def synchronizer_service_url(job: DecoupledDiLoCoJob) -> str:
    return f"http://{synchronizer_name(job)}.{job.namespace}.svc:{SYNC_PORT}"


def sync_url_for(job: DecoupledDiLoCoJob, group: LearnerGroup) -> str:
    return group.sync_url or synchronizer_service_url(job)


def learner_selector(job: DecoupledDiLoCoJob) -> str:
    """Label selector for the job's learner pods, in any cluster."""
    return f"{LABEL_JOB}={job.name},{LABEL_COMPONENT}=learner"


def labels(job: DecoupledDiLoCoJob, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "ddiloco",
        "app.kubernetes.io/instance": job.name,
        LABEL_COMPONENT: component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_JOB: job.name,
        LABEL_JOB_UID: job.uid,
    }


def owner_reference(job: DecoupledDiLoCoJob) -> dict[str, Any]:
    # Only for objects in the job's own cluster: owner references cannot cross clusters,
    # which is why deletion also goes through the finalizer.
    return {
        "apiVersion": job.api_version,
        "kind": job.kind,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
    }


def _metadata(
    job: DecoupledDiLoCoJob, name: str, component: str, namespace: str, owned: bool = True
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels(job, component)}
    if owned:
        meta["ownerReferences"] = [owner_reference(job)]
    return meta


def build_token_secret(
    job: DecoupledDiLoCoJob, token: str, namespace: str | None = None, owned: bool = True
) -> dict[str, Any]:
    """The bearer token learners present to the synchronizer; copied into remote clusters."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(
            job, token_secret_name(job), "token", namespace or job.namespace, owned
        ),
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def secret_token(secret: dict[str, Any] | None) -> str | None:
    """The token held by a Secret as the API returns it (base64 data), if any."""
    data = ((secret or {}).get("data") or {}).get(TOKEN_KEY)
    return base64.b64decode(data).decode() if data else None


def _token_env(job: DecoupledDiLoCoJob) -> dict[str, Any]:
    return {
        "name": "DDILOCO_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": token_secret_name(job), "key": TOKEN_KEY}},
    }


def _env(pairs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": k, "value": str(v)} for k, v in pairs.items() if v is not None]


def build_synchronizer_service(job: DecoupledDiLoCoJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, synchronizer_name(job), "synchronizer", job.namespace),
        "spec": {
            "type": "ClusterIP",
            "selector": {LABEL_JOB: job.name, LABEL_COMPONENT: "synchronizer"},
            "ports": [
                {
                    "name": "http",
                    "port": SYNC_PORT,
                    "targetPort": "http",
                    "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c",
                }
            ],
        },
    }


def build_state_claim(job: DecoupledDiLoCoJob) -> dict[str, Any]:
    storage = job.spec.synchronizer.storage
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": str(storage.size)}},
    }
    if storage.storage_class_name is not None:
        spec["storageClassName"] = storage.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(job, state_claim_name(job), "synchronizer", job.namespace),
        "spec": spec,
    }


IMAGE_UID = 10001  # the non-root user of the project's Dockerfile

COUNTER_CAP_H: Final = 4
"""The synchronizer caps the steps a contribution may claim at this many H (README, "Weights
and merge"; `ddiloco local` sets the same). Its own default, 96, is 4H only for H = 24."""


def build_synchronizer_deployment(job: DecoupledDiLoCoJob) -> dict[str, Any]:
    """One synchronizer pod (Recreate: never two writing the same state volume)."""
    spec, sync = job.spec, job.spec.synchronizer
    env = [
        _token_env(job),
        *_env(
            {
                "DDILOCO_HOST": "0.0.0.0",
                "DDILOCO_STATE_DIR": STATE_DIR,
                "DDILOCO_PORT": SYNC_PORT,
                "DDILOCO_QUORUM": sync.quorum,
                "DDILOCO_GRACE_GAMMA": sync.grace_gamma,
                "DDILOCO_GRACE_CAP_STEPS": sync.grace_cap_steps,
                "DDILOCO_MERGE": sync.merge,
                "DDILOCO_OUTER_LR": sync.outer_learning_rate,
                "DDILOCO_OUTER_MOMENTUM": sync.outer_momentum,
                "DDILOCO_MAX_STALENESS": sync.max_staleness,
                "DDILOCO_TAU": spec.training.overlap_steps,
                "DDILOCO_COUNTER_CAP_STEPS": COUNTER_CAP_H * spec.training.inner_steps,
            }
        ),
    ]
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10}
    container = {
        "name": "synchronizer",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["ddiloco", "synchronizer"],
        "env": env,
        "ports": [{"name": "http", "containerPort": SYNC_PORT, "protocol": "TCP"}],
        "readinessProbe": {**probe, "periodSeconds": 5},
        "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": sync.resources.to_k8s(),
        "volumeMounts": [{"name": "state", "mountPath": STATE_DIR}],
    }
    selector = {LABEL_JOB: job.name, LABEL_COMPONENT: "synchronizer"}
    template = {
        "metadata": {"labels": labels(job, "synchronizer")},
        "spec": {
            "containers": [container],
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            # The image runs as uid 10001 (Dockerfile); fsGroup makes the state volume writable
            # for it on storage classes that mount volumes root-owned.
            "securityContext": {"runAsNonRoot": True, "fsGroup": IMAGE_UID},
            "volumes": [
                {"name": "state", "persistentVolumeClaim": {"claimName": state_claim_name(job)}}
            ],
        },
    }
    deployment_spec = {
        "replicas": 0 if spec.suspend else 1,
        "strategy": {"type": "Recreate"},
        "selector": {"matchLabels": selector},
        "template": template,
    }
    meta = _metadata(job, synchronizer_name(job), "synchronizer", job.namespace)
    meta["annotations"] = {ANNOTATION_SPEC_HASH: spec_hash(deployment_spec)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": deployment_spec,
    }


def global_index(job: DecoupledDiLoCoJob, group: LearnerGroup, index: int) -> int:
    """Position of a slot among all learners, for data sharding (groups in spec order)."""
    offset = 0
    for g in job.spec.learner_groups:
        if g.name == group.name:
            return offset + index
        offset += g.replicas
    raise KeyError(group.name)


def build_learner_pod(
    job: DecoupledDiLoCoJob,
    group: LearnerGroup,
    index: int,
    namespace: str | None = None,
    owned: bool = True,
) -> dict[str, Any]:
    """One learner slot. restartPolicy Never: a failed pod is replaced whole, by the operator."""
    spec, training = job.spec, job.spec.training
    lid = learner_id(group.name, index)
    env = [
        _token_env(job),
        *_env(
            {
                "DDILOCO_SYNC_URL": sync_url_for(job, group),
                "DDILOCO_LEARNER_ID": lid,
                "DDILOCO_LEARNER_INDEX": global_index(job, group, index),
                "DDILOCO_NUM_LEARNERS": spec.total_replicas(),
                "DDILOCO_MODEL": training.model,
                "DDILOCO_MODEL_ENTRY": training.model_entry,
                "DDILOCO_DATA": training.data,
                "DDILOCO_H": training.inner_steps,
                "DDILOCO_P": training.fragments,
                "DDILOCO_INNER_LR": training.inner_learning_rate,
                "DDILOCO_MAX_STEPS": training.max_steps,
                "DDILOCO_MAX_TOKENS": training.max_tokens,
                "DDILOCO_MAX_SECONDS": training.max_seconds,
            }
        ),
    ]
    meta = _metadata(
        job, learner_pod_name(job, group.name, index), "learner", namespace or job.namespace, owned
    )
    meta["labels"].update({LABEL_GROUP: group.name, LABEL_SLOT: str(index), LABEL_LEARNER_ID: lid})
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "containers": [
            {
                "name": "learner",
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": ["ddiloco", "learner"],
                "env": env,
                "resources": group.resources.to_k8s(),
            }
        ],
    }
    if group.node_selector:
        pod_spec["nodeSelector"] = dict(group.node_selector)
    if group.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in group.tolerations
        ]
    if group.priority_class_name:
        pod_spec["priorityClassName"] = group.priority_class_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def spec_hash(obj: Any) -> str:
    """A short digest of a manifest, to notice drift without comparing server-defaulted fields."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
