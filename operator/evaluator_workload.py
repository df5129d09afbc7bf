"""The evaluator's workload (`spec.evaluation`): a Deployment `<job>-evaluator` of one pod that
runs `ddiloco evaluate` (learner/evaluate.py), and its credential, Secret
`<job>-evaluator-token`; as plain dicts, and the actions that keep them as the spec says.

    from ddiloco.operator import evaluator_workload
    dep = evaluator_workload.build_evaluator_deployment(job)   # what the operator would apply
    actions = evaluator_workload.evaluator_actions(job, observed, token)   # reconcile.py's

The pod measures the global model with the learners' model and data settings (`training`:
model or modelEntry, data, tokenizer, dataField, sequenceLength, batchSize, seed, initFrom;
`evaluation.data` may name other data), given as flags, and reaches the synchronizer the way
in-cluster learners do (DDILOCO_SYNC_URL: the shards' URLs; DDILOCO_CA_FILE from `<job>-trust`
with TLS on). Its credential is an evaluator's (`evaluator:<job>-evaluator:<mac>`,
wire/auth.py), one line per line of the job key so that it follows a rotation
(tokens.py waits for it before dropping the old key), mounted as a file that the kubelet
keeps current: it may read the model and post evaluations, nothing else. Both objects live
in the home namespace with the job's labels and owner reference; a job without
`spec.evaluation` (or that drops it) has neither, and the finalizer deletes both
(apply.delete_job_objects). A suspended job keeps the Deployment at 0 replicas.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any, Final

from ddiloco.operator.api import DecoupledDiLoCoJob
from ddiloco.operator.builders import (
    ANNOTATION_SPEC_HASH,
    CA_KEY,
    IMAGE_UID,
    LABEL_COMPONENT,
    LABEL_JOB,
    TOKEN_DIR,
    TOKEN_KEY,
    TRUST_DIR,
    _env,
    _metadata,
    _mount,
    _secret_volume,
    apply_template,
    labels,
    made_by,
    shard_urls,
    spec_hash,
    trust_secret_name,
)
from ddiloco.operator.plan import Action, ClusterView, Observed, home
from ddiloco.wire.auth import derived_lines

COMPONENT: Final = "evaluator"


def evaluator_name(job: DecoupledDiLoCoJob) -> str:
    """The Deployment, and the name its credential carries."""
    return f"{job.name}-evaluator"


def evaluator_token_secret_name(job: DecoupledDiLoCoJob) -> str:
    return f"{job.name}-evaluator-token"


def credential(job: DecoupledDiLoCoJob, keys: list[str]) -> bytes:
    """The evaluator's credential file: one line per job key line, newest first."""
    return derived_lines(keys, "evaluator", evaluator_name(job)).encode()


def build_evaluator_token_secret(job: DecoupledDiLoCoJob, data: bytes) -> dict[str, Any]:
    meta = _metadata(job, evaluator_token_secret_name(job), "evaluator-token", job.namespace)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": meta,
        "data": {TOKEN_KEY: base64.b64encode(data).decode()},
    }


def evaluator_args(job: DecoupledDiLoCoJob) -> list[str]:
    """`ddiloco evaluate`'s flags: the learners' model and data settings, then the schedule."""
    t, e = job.spec.training, job.spec.evaluation
    assert e is not None
    pairs: list[tuple[str, Any]] = [
        ("--model", t.model),
        ("--model-entry", t.model_entry),
        ("--data", e.data or t.data),
        ("--tokenizer", t.tokenizer),
        ("--data-field", t.data_field),
        ("--seq-len", t.sequence_length),
        ("--batch-size", t.batch_size),
        ("--seed", t.seed),
        ("--init-from", t.init_from),
        ("--every-versions", e.every_versions),
        ("--every-seconds", f"{e.every_seconds:g}"),
        ("--eval-batches", e.eval_batches),
        ("--tensorboard", e.tensorboard_dir),
    ]
    return [x for flag, value in pairs if value is not None for x in (flag, str(value))]


def _selector(job: DecoupledDiLoCoJob) -> dict[str, str]:
    return {LABEL_JOB: job.name, LABEL_COMPONENT: COMPONENT}


def build_evaluator_deployment(job: DecoupledDiLoCoJob) -> dict[str, Any]:
    """One evaluator pod (0 while suspended); Recreate: never two measuring at once."""
    spec, e = job.spec, job.spec.evaluation
    assert e is not None
    env = {"DDILOCO_SYNC_URL": ",".join(shard_urls(job))}
    env["DDILOCO_TOKEN_FILE"] = f"{TOKEN_DIR}/{TOKEN_KEY}"
    volumes = [_secret_volume("token", evaluator_token_secret_name(job))]
    mounts = [_mount("token", TOKEN_DIR)]
    if spec.synchronizer.tls.enabled:  # the in-cluster URLs are https: trust the job's CA
        env["DDILOCO_CA_FILE"] = f"{TRUST_DIR}/{CA_KEY}"
        volumes.append(_secret_volume("trust", trust_secret_name(job)))
        mounts.append(_mount("trust", TRUST_DIR))
    container: dict[str, Any] = {
        "name": COMPONENT,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["ddiloco", "evaluate"],
        "args": evaluator_args(job),
        "env": _env(env),
        "resources": e.resources.to_k8s(),
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        # the Secret files are 0440: readable through the group by the image's user
        "securityContext": {"runAsNonRoot": True, "fsGroup": IMAGE_UID},
        "volumes": volumes,
    }
    if e.node_selector:
        pod_spec["nodeSelector"] = dict(e.node_selector)
    if e.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in e.tolerations
        ]
    apply_template(e, pod_spec)  # the user's volumes (the data), env, ... (builders.py)
    dep_spec: dict[str, Any] = {
        "replicas": 0 if spec.suspend else 1,
        "strategy": {"type": "Recreate"},
        "selector": {"matchLabels": _selector(job)},
        "template": {"metadata": {"labels": labels(job, COMPONENT)}, "spec": pod_spec},
    }
    meta = _metadata(job, evaluator_name(job), COMPONENT, job.namespace)
    meta["annotations"] = {ANNOTATION_SPEC_HASH: spec_hash(dep_spec)}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": dep_spec}


def evaluator_actions(job: DecoupledDiLoCoJob, obs: Observed, token: str) -> list[Action]:
    """The writes that make the evaluator's credential and Deployment what the spec says
    (`token`: the job key Secret's content once this pass's writes are done), or delete the
    job's own when `spec.evaluation` is unset. Nothing while home cannot be seen; another's
    object of either name is never touched (a create then fails; the runtime reports it)."""
    h = home(job)
    view = obs.clusters.get(h, ClusterView())
    if view.problem is not None:
        return []
    secret_name, name = evaluator_token_secret_name(job), evaluator_name(job)
    have = view.secrets.get(secret_name)
    deployment = obs.evaluator
    out: list[Action] = []
    if job.spec.evaluation is None:
        if deployment is not None and made_by(job, deployment.get("metadata")):
            uid = (deployment.get("metadata") or {}).get("uid")
            out.append(Action("delete", h, "Deployment", name, uid=uid))
        if have is not None and have.job_uid == job.uid:
            out.append(Action("delete", h, "Secret", secret_name))
        return out
    keys = [x.strip() for x in token.splitlines() if x.strip()]
    data = credential(job, keys)
    if have is None or dict(have.data) != {TOKEN_KEY: data}:
        body = build_evaluator_token_secret(job, data)
        out.append(Action("create" if have is None else "replace", h, "Secret", secret_name, body))
    want = build_evaluator_deployment(job)
    if deployment is None:
        out.append(Action("create", h, "Deployment", name, want))
    elif _hash(deployment) != want["metadata"]["annotations"][ANNOTATION_SPEC_HASH]:
        out.append(Action("replace", h, "Deployment", name, want))
    return out


def caught_up(job: DecoupledDiLoCoJob, view: ClusterView, keys: list[str]) -> bool:
    """Whether the evaluator's credential Secret holds what `keys` derive (always, without
    `spec.evaluation`): a rotation keeps the old key accepted until it does."""
    if job.spec.evaluation is None:
        return True
    have = view.secrets.get(evaluator_token_secret_name(job))
    return have is not None and dict(have.data) == {TOKEN_KEY: credential(job, keys)}


def _hash(obj: Mapping[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_SPEC_HASH)
