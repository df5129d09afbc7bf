"""Send a plan's actions to the clusters, and delete a job's objects (the finalizer's work).

    send(api_client, action, timeout=(5, 10))
    left = delete_job_objects(api_client, job, target, timeout=(5, 10))
    why = foreign(api_client, job, action, timeout)  # after a create got 409: whose is it?

Thin translations to kubernetes client calls; failures propagate as the client raises them
(ApiException, connection errors), and act.py and cleanup.py decide what they mean.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import kubernetes
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from ddiloco.operator import api as ddapi
from ddiloco.operator import builders, certs, evaluator_workload, tokens
from ddiloco.operator.plan import Action, Target

Timeout: TypeAlias = float | tuple[float, float]  # seconds, or (connect, read)


def get_or_none(call: Callable[[], Any]) -> Any:
    """The call's result, or None when the object does not exist (404)."""
    try:
        return call()
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def delete_job_objects(
    client: ApiClient, job: ddapi.DecoupledDiLoCoJob, tgt: Target, timeout: Timeout
) -> int:
    """Delete the job's objects in one target; return how many of its pods still exist.

    Only objects the job made: pods are selected by the job's uid, and each named object
    (the key and learner credentials Secrets; at home the synchronizer's StatefulSet,
    Services and claims, the evaluator's Deployment and credential) is read first and deleted
    only if it carries the job's uid (label or ownerReference), with the uid it was
    read with as a precondition, so a same-named object of someone else's is never touched.
    The shards' claims go with the StatefulSet (its retention policy) and are deleted here
    too, so the finalizer does not depend on the garbage collector's timing."""
    core, apps = kubernetes.client.CoreV1Api(client), kubernetes.client.AppsV1Api(client)
    ns = tgt.namespace
    kw: dict[str, Any] = {"_request_timeout": timeout}
    pods = core.list_namespaced_pod(ns, label_selector=builders.learner_selector(job), **kw).items
    mine = [p for p in pods if builders.made_by(job, p.metadata)]
    deletes: list[Callable[[], Any]] = [
        lambda p=p: core.delete_namespaced_pod(
            p.metadata.name, ns, body={"preconditions": {"uid": p.metadata.uid}}, **kw
        )
        for p in mine
        if not p.metadata.deletion_timestamp
    ]
    # the job key (home) and the groups' learner credentials there (tokens.py)
    keys = [builders.token_secret_name(job)] if tgt.is_home else []
    named: list[tuple[Callable[..., Any], Callable[..., Any], str]] = [
        (core.read_namespaced_secret, core.delete_namespaced_secret, name)
        for name in [*keys, *tokens.secret_names(job, tgt).values()]
    ]
    # the TLS Secrets (certs.py): CA, server certificate, trust bundle, client certificates
    named += [
        (core.read_namespaced_secret, core.delete_namespaced_secret, name)
        for name in certs.secret_names(job, tgt, all_clients=True)
    ]
    if tgt.is_home:  # the home cluster also holds the synchronizer
        sync = builders.synchronizer_name(job)
        shards = _shards(job)
        named += [
            (apps.read_namespaced_stateful_set, apps.delete_namespaced_stateful_set, sync),
            (
                apps.read_namespaced_deployment,
                apps.delete_namespaced_deployment,
                evaluator_workload.evaluator_name(job),
            ),
            (
                core.read_namespaced_secret,
                core.delete_namespaced_secret,
                evaluator_workload.evaluator_token_secret_name(job),
            ),
            (core.read_namespaced_service, core.delete_namespaced_service, sync),
            (
                core.read_namespaced_service,
                core.delete_namespaced_service,
                builders.shards_service_name(job),
            ),
        ]
        named += [
            (
                core.read_namespaced_persistent_volume_claim,
                core.delete_namespaced_persistent_volume_claim,
                name,
            )
            for name in [builders.shard_claim_name(job, i) for i in range(shards)]
        ]
    for read, delete, name in named:
        obj = get_or_none(lambda read=read, name=name: read(name, ns, **kw))
        if obj is not None and builders.made_by(job, obj.metadata):
            deletes.append(
                lambda delete=delete, name=name, uid=obj.metadata.uid: delete(
                    name, ns, body={"preconditions": {"uid": uid}}, **kw
                )
            )
    if tgt.is_home and job.spec is not None and job.spec.synchronizer.tls.issuer == "cert-manager":
        cert = get_or_none(
            lambda: _certificate_api(client, "get", ns, builders.certificate_name(job), timeout)
        )
        if cert is not None and builders.made_by(job, cert.get("metadata")):
            deletes.append(
                lambda: _certificate_api(
                    client, "delete", ns, builders.certificate_name(job), timeout
                )
            )
    for call in deletes:
        try:
            call()
        except ApiException as e:
            if e.status not in (404, 409):  # gone already; 409: replaced by another uid
                raise
    return len(mine)


def _shards(job: ddapi.DecoupledDiLoCoJob) -> int:
    """The job's synchronizer shards; for a spec that does not parse, what its status says."""
    if job.spec is not None:
        return job.spec.synchronizer.shards
    return (job.status.synchronizer.shards if job.status.synchronizer else None) or 1


def foreign(
    client: ApiClient, job: ddapi.DecoupledDiLoCoJob, action: Action, timeout: Timeout
) -> str | None:
    """After a create answered 409 AlreadyExists: None if the object there is the job's (made
    in an earlier pass), else a message naming the object that holds the name."""
    core, apps = kubernetes.client.CoreV1Api(client), kubernetes.client.AppsV1Api(client)
    read = {
        "Pod": core.read_namespaced_pod,
        "Secret": core.read_namespaced_secret,
        "Service": core.read_namespaced_service,
        "PersistentVolumeClaim": core.read_namespaced_persistent_volume_claim,
        "StatefulSet": apps.read_namespaced_stateful_set,
        "Deployment": apps.read_namespaced_deployment,
        "Certificate": lambda name, ns, **kw: _Meta(
            _certificate_api(client, "get", ns, name, kw["_request_timeout"])
        ),
    }[action.kind]
    ns = action.target.namespace
    obj = get_or_none(lambda: read(action.name, ns, _request_timeout=timeout))
    if obj is None:
        return None  # gone meanwhile: the next pass creates it
    ours = builders.made_by(job, obj.metadata)
    if ours and action.kind == "Pod" and action.body is not None:
        want = action.body["metadata"]["labels"]
        have = obj.metadata.labels or {}
        ours = all(have.get(k) == want[k] for k in (builders.LABEL_GROUP, builders.LABEL_SLOT))
    if ours:
        return None
    return (
        f"{action.kind} {ns}/{action.name} in {action.target.label} exists and was not "
        f"created by this job (no {builders.LABEL_JOB_UID}={job.uid}); it is left as it is"
    )


def send(client: ApiClient, action: Action, timeout: Timeout) -> None:
    """Perform one Action against the API it targets."""
    core, apps = kubernetes.client.CoreV1Api(client), kubernetes.client.AppsV1Api(client)
    ns, name, body = action.target.namespace, action.name, action.body
    kw: dict[str, Any] = {"_request_timeout": timeout}
    create = {
        "Pod": core.create_namespaced_pod,
        "Secret": core.create_namespaced_secret,
        "Service": core.create_namespaced_service,
        "PersistentVolumeClaim": core.create_namespaced_persistent_volume_claim,
        "StatefulSet": apps.create_namespaced_stateful_set,
        "Deployment": apps.create_namespaced_deployment,  # the evaluator's
    }
    replace = {
        "Secret": core.replace_namespaced_secret,
        "StatefulSet": apps.replace_namespaced_stateful_set,
        "Deployment": apps.replace_namespaced_deployment,
    }
    delete = {
        "Pod": core.delete_namespaced_pod,
        "Secret": core.delete_namespaced_secret,
        "Deployment": apps.delete_namespaced_deployment,  # the evaluator's
    }
    if action.kind == "Certificate":  # cert-manager's, through the custom objects API
        verb = {"create": "create", "replace": "replace", "delete": "delete"}[action.verb]
        _certificate_api(client, verb, ns, name, timeout, body)
        return
    if action.verb == "patch" and action.kind == "Service":
        # a JSON merge patch of spec.ports (sync_workload.service_ports_patch): it replaces
        # the list, where the client's default (strategic merge) would merge it by port
        assert body is not None
        kw["_content_type"] = "application/merge-patch+json"
        core.patch_namespaced_service(name, ns, body["patch"], **kw)
    elif action.verb == "patch":  # a JSON patch (a list: the client sends json-patch+json)
        assert action.kind == "Pod" and body is not None
        core.patch_namespaced_pod(name, ns, body["patch"], **kw)
    elif action.verb == "create":
        create[action.kind](ns, body, **kw)
    elif action.verb == "replace":
        replace[action.kind](name, ns, body, **kw)
    else:
        opts: dict[str, Any] = {}
        if action.uid:
            opts["preconditions"] = {"uid": action.uid}
        if action.grace_seconds is not None:
            opts["gracePeriodSeconds"] = action.grace_seconds
        if action.kind == "Deployment":  # gone only once its pod is: one writer per volume
            opts["propagationPolicy"] = "Foreground"
        delete[action.kind](name, ns, body=opts, **kw)


class _Meta:
    """A custom object's dict with `.metadata`, as the client's models have it."""

    def __init__(self, obj: dict[str, Any]) -> None:
        self.metadata = obj.get("metadata") or {}


def _certificate_api(
    client: ApiClient,
    verb: str,
    ns: str,
    name: str,
    timeout: Timeout,
    body: dict[str, Any] | None = None,
) -> Any:
    """get, create, replace or delete a cert-manager Certificate (cert-manager.io/v1)."""
    api = kubernetes.client.CustomObjectsApi(client)
    args = ("cert-manager.io", "v1", ns, "certificates")
    kw: dict[str, Any] = {"_request_timeout": timeout}
    if verb == "get":
        return api.get_namespaced_custom_object(*args, name, **kw)
    if verb == "create":
        return api.create_namespaced_custom_object(*args, body, **kw)
    if verb == "replace":
        return api.replace_namespaced_custom_object(*args, name, body, **kw)
    return api.delete_namespaced_custom_object(*args, name, **kw)
