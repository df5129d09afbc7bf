"""Send a plan's actions to the clusters, and delete a job's objects (the finalizer's work).

    send(api_client, action, timeout=10)
    left = delete_job_objects(api_client, job, target, timeout=10)

Thin translations to kubernetes client calls; failures propagate as the client raises them
(ApiException, connection errors), and runtime.py decides what they mean.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kubernetes
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from ddiloco.operator import api as ddapi
from ddiloco.operator import builders
from ddiloco.operator.plan import Action, Target


def get_or_none(call: Callable[[], Any]) -> Any:
    """The call's result, or None when the object does not exist (404)."""
    try:
        return call()
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def delete_job_objects(
    client: ApiClient, job: ddapi.DecoupledDiLoCoJob, tgt: Target, timeout: float
) -> int:
    """Delete the job's objects in one target; return how many of its pods still exist."""
    core, apps = kubernetes.client.CoreV1Api(client), kubernetes.client.AppsV1Api(client)
    ns = tgt.namespace
    pods = core.list_namespaced_pod(
        ns, label_selector=builders.learner_selector(job), _request_timeout=timeout
    ).items
    mine = [p for p in pods if (p.metadata.labels or {}).get(builders.LABEL_JOB_UID) == job.uid]
    deletes: list[Callable[[], Any]] = [
        lambda p=p: core.delete_namespaced_pod(
            p.metadata.name,
            ns,
            _request_timeout=timeout,
            body={"preconditions": {"uid": p.metadata.uid}},
        )
        for p in mine
        if not p.metadata.deletion_timestamp
    ]
    secret = get_or_none(
        lambda: core.read_namespaced_secret(
            builders.token_secret_name(job), ns, _request_timeout=timeout
        )
    )
    if secret is not None and (secret.metadata.labels or {}).get(builders.LABEL_JOB_UID) == job.uid:
        deletes.append(
            lambda: core.delete_namespaced_secret(
                builders.token_secret_name(job), ns, _request_timeout=timeout
            )
        )
    if tgt.secret is None:  # the home cluster also holds the synchronizer
        name = builders.synchronizer_name(job)
        deletes += [
            lambda: apps.delete_namespaced_deployment(name, ns, _request_timeout=timeout),
            lambda: core.delete_namespaced_service(name, ns, _request_timeout=timeout),
            lambda: core.delete_namespaced_persistent_volume_claim(
                builders.state_claim_name(job), ns, _request_timeout=timeout
            ),
        ]
    for delete in deletes:
        get_or_none(delete)
    return len(mine)


def send(client: ApiClient, action: Action, timeout: float) -> None:
    """Perform one Action against the API it targets."""
    core, apps = kubernetes.client.CoreV1Api(client), kubernetes.client.AppsV1Api(client)
    ns, name, body = action.target.namespace, action.name, action.body
    kw: dict[str, Any] = {"_request_timeout": timeout}
    create = {
        "Pod": core.create_namespaced_pod,
        "Secret": core.create_namespaced_secret,
        "Service": core.create_namespaced_service,
        "PersistentVolumeClaim": core.create_namespaced_persistent_volume_claim,
        "Deployment": apps.create_namespaced_deployment,
    }
    replace = {
        "Secret": core.replace_namespaced_secret,
        "Deployment": apps.replace_namespaced_deployment,
    }
    delete = {"Pod": core.delete_namespaced_pod, "Secret": core.delete_namespaced_secret}
    if action.verb == "create":
        create[action.kind](ns, body, **kw)
    elif action.verb == "replace":
        replace[action.kind](name, ns, body, **kw)
    else:
        opts: dict[str, Any] = {}
        if action.uid:
            opts["preconditions"] = {"uid": action.uid}
        if action.grace_seconds is not None:
            opts["gracePeriodSeconds"] = action.grace_seconds
        delete[action.kind](name, ns, body=opts, **kw)
