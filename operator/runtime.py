"""The operator's I/O around the pure reconcile: observe the clusters, apply a plan, write status.

    runtime = Runtime(get_settings(), home_api_client())
    runtime.reconcile("tiny", "default", logger, post)   # one pass (what the kopf timer calls)
    runtime.clean_up(body, logger)                        # what the finalizer handler calls

One reconcile for a job runs at a time (handlers.py holds a per-job lock). Each pass reads the
job afresh, observes every target cluster, asks reconcile.py for a plan, writes the status
first (optimistic concurrency: a conflict ends the pass, the next tick retries) and only then
creates and deletes. That order is what makes a replacement crash-safe (reconcile.py).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import kubernetes
import pydantic
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from ddiloco.operator import api as ddapi
from ddiloco.operator import builders
from ddiloco.operator.apply import delete_job_objects, get_or_none, send
from ddiloco.operator.clusters import (
    UNREACHABLE_ERRORS,
    ClusterProblem,
    Clusters,
    api_reason,
    as_dict,
    describe_failure,
)
from ddiloco.operator.config import OperatorSettings
from ddiloco.operator.plan import (
    Action,
    ClusterView,
    Event,
    Observed,
    PodView,
    Target,
    home,
    targets,
)
from ddiloco.operator.reconcile import reconcile
from ddiloco.operator.syncstatus import StatusReader

log = logging.getLogger(__name__)
MAX_PASSES = 3
CLEANUP_SWEEPS = 5
WARN_EVERY_S = 60.0
PostEvent = Callable[[Event], None]


class CleanupPending(Exception):
    """Deletion has to wait: pods still terminating, or a cluster not answering yet."""


class Runtime:
    """The operator's connection to the clusters; one per process, shared by all jobs.

    Keeps the cached remote clients (clusters.py), the last synchronizer answers
    (syncstatus.py) and when each repeated failure was last logged. A failed API call never
    raises out of a pass for a remote cluster: it becomes a Degraded condition or a log line,
    and the next tick tries again. Failures of the home apiserver propagate to kopf, which
    retries the timer after its backoff.
    """

    def __init__(self, settings: OperatorSettings, home_client: ApiClient) -> None:
        self.settings = settings
        self.clusters = Clusters(home_client)
        self.status = StatusReader(settings)
        self.timeout = settings.api_timeout_seconds
        self._warned: dict[str, float] = {}

    # -- the kopf timer's work -------------------------------------------------------------
    def reconcile(
        self,
        name: str,
        namespace: str,
        logger: logging.Logger | logging.LoggerAdapter,
        post: PostEvent,
    ) -> None:
        """Reconcile one job: up to MAX_PASSES observe-plan-apply passes, so that a pod
        deleted in one pass is recreated in the next instead of a tick later."""
        body = self._read_job(name, namespace)
        for _ in range(MAX_PASSES):
            if body is None or body.get("metadata", {}).get("deletionTimestamp"):
                return
            try:
                job = ddapi.DecoupledDiLoCoJob.from_body(body)
            except pydantic.ValidationError as e:
                self._write_invalid(body, e, logger)
                return
            if not job.is_ours():
                return
            plan = reconcile(job, self.observe(job), fresh_token=secrets.token_urlsafe(32))
            if plan.status is not None:
                body = self._write_status(body, plan.status, logger)
                if body is None:
                    return  # changed meanwhile: the next tick sees the new version
            for event in plan.events:
                post(event)
            if not plan.actions:
                return
            for action in plan.actions:
                self._apply(action, job.namespace, logger)

    def observe(self, job: ddapi.DecoupledDiLoCoJob) -> Observed:
        views: dict[Target, ClusterView] = {}
        for tgt in targets(job):
            try:
                client = self.clusters.client(tgt, job.namespace)
                core = kubernetes.client.CoreV1Api(client)
                pods = core.list_namespaced_pod(
                    tgt.namespace,
                    label_selector=builders.learner_selector(job),
                    _request_timeout=self.timeout,
                )
                views[tgt] = ClusterView(
                    pods=tuple(
                        v
                        for p in pods.items
                        if (v := PodView.from_k8s(as_dict(client, p))) is not None
                    ),
                    token=self._token(core, job, tgt),
                )
            except ClusterProblem as p:
                views[tgt] = ClusterView(problem=(p.reason, p.message))
            except (ApiException, *UNREACHABLE_ERRORS) as e:
                if tgt.secret is None:
                    raise
                p = describe_failure(e, tgt, job.namespace)
                views[tgt] = ClusterView(problem=(p.reason, p.message))
        h = self.clusters.home
        deployment = get_or_none(
            lambda: kubernetes.client.AppsV1Api(h).read_namespaced_deployment(
                builders.synchronizer_name(job), job.namespace, _request_timeout=self.timeout
            )
        )
        service = get_or_none(
            lambda: kubernetes.client.CoreV1Api(h).read_namespaced_service(
                builders.synchronizer_name(job), job.namespace, _request_timeout=self.timeout
            )
        )
        claim = get_or_none(
            lambda: kubernetes.client.CoreV1Api(h).read_namespaced_persistent_volume_claim(
                builders.state_claim_name(job), job.namespace, _request_timeout=self.timeout
            )
        )
        dep = as_dict(h, deployment) if deployment is not None else None
        available = int(((dep or {}).get("status") or {}).get("availableReplicas") or 0) > 0
        sync = self.status.read(job, views[home(job)].token) if available else None
        return Observed(
            now=datetime.now(UTC),
            clusters=views,
            deployment=dep,
            service=service is not None,
            claim=claim is not None,
            sync_status=sync,
        )

    def _token(
        self, core: kubernetes.client.CoreV1Api, job: ddapi.DecoupledDiLoCoJob, tgt: Target
    ) -> str | None:
        secret = get_or_none(
            lambda: core.read_namespaced_secret(
                builders.token_secret_name(job), tgt.namespace, _request_timeout=self.timeout
            )
        )
        return builders.secret_token({"data": secret.data}) if secret is not None else None

    def _apply(
        self, action: Action, secret_namespace: str, logger: logging.Logger | logging.LoggerAdapter
    ) -> None:
        """Send one action; log and carry on when it fails (the next tick tries again)."""
        try:
            client = self.clusters.client(action.target, secret_namespace)
            send(client, action, self.timeout)
            logger.debug("Done: %s", action.describe())
            return
        except ClusterProblem as p:
            why = p.message
        except ApiException as e:
            if e.status == 409 or (e.status == 404 and action.verb == "delete"):
                logger.debug("Already done: %s (%s)", action.describe(), api_reason(e))
                return
            why = api_reason(e)
        except UNREACHABLE_ERRORS as e:
            why = api_reason(e)
        # The same failure repeats every tick (e.g. a missing namespace in a region): say it
        # once a minute, not twice a second.
        key = f"{secret_namespace}|{action.describe()}|{why}"
        now = time.monotonic()
        if now - self._warned.get(key, -1e9) >= WARN_EVERY_S:
            self._warned[key] = now
            logger.warning("Could not %s: %s", action.describe(), why)
        else:
            logger.debug("Could not %s: %s", action.describe(), why)

    # -- status ------------------------------------------------------------------------------
    def _read_job(self, name: str, namespace: str) -> dict[str, Any] | None:
        return get_or_none(
            lambda: kubernetes.client.CustomObjectsApi(
                self.clusters.home
            ).get_namespaced_custom_object(
                ddapi.GROUP,
                ddapi.VERSION,
                namespace,
                ddapi.PLURAL,
                name,
                _request_timeout=self.timeout,
            )
        )

    def _write_status(
        self,
        body: dict[str, Any],
        status: ddapi.JobStatus,
        logger: logging.Logger | logging.LoggerAdapter,
    ) -> dict[str, Any] | None:
        """Replace the status subresource, conditional on the resourceVersion we computed from."""
        new = {**body, "status": status.model_dump(by_alias=True, exclude_none=True, mode="json")}
        meta = body["metadata"]
        try:
            out = kubernetes.client.CustomObjectsApi(
                self.clusters.home
            ).replace_namespaced_custom_object_status(
                ddapi.GROUP,
                ddapi.VERSION,
                meta["namespace"],
                ddapi.PLURAL,
                meta["name"],
                new,
                _request_timeout=self.timeout,
            )
        except ApiException as e:
            if e.status in (404, 409):
                logger.debug("Status not written (%s); retrying on the next tick", api_reason(e))
                return None
            raise
        return dict(out)

    def _write_invalid(
        self,
        body: dict[str, Any],
        error: pydantic.ValidationError,
        logger: logging.Logger | logging.LoggerAdapter,
    ) -> None:
        # The CRD's schema and CEL rules should refuse such a job; this covers a CRD older
        # than the operator. The timer keeps running, so fixing the spec recovers.
        first = error.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        message = f"spec is invalid at {where}: {first['msg']}"
        old = dict(body.get("status") or {})
        conds = [x for x in old.get("conditions") or [] if x.get("type") != "Ready"]
        ready = {
            "type": "Ready",
            "status": "False",
            "reason": "InvalidSpec",
            "message": message,
            "lastTransitionTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "observedGeneration": body["metadata"].get("generation"),
        }
        before = next((x for x in old.get("conditions") or [] if x.get("type") == "Ready"), {})
        if before.get("reason") == "InvalidSpec" and before.get("message") == message:
            return
        logger.error("Refused DecoupledDiLoCoJob: %s", message)
        status = {
            **old,
            "phase": "Invalid",
            "conditions": [ready, *conds],
            "observedGeneration": body["metadata"].get("generation"),
        }
        try:
            kubernetes.client.CustomObjectsApi(
                self.clusters.home
            ).replace_namespaced_custom_object_status(
                ddapi.GROUP,
                ddapi.VERSION,
                body["metadata"]["namespace"],
                ddapi.PLURAL,
                body["metadata"]["name"],
                {**body, "status": status},
                _request_timeout=self.timeout,
            )
        except ApiException as e:
            logger.debug("Status not written (%s)", api_reason(e))

    # -- the finalizer's work ----------------------------------------------------------------
    def clean_up(
        self, body: dict[str, Any], logger: logging.Logger | logging.LoggerAdapter, post: PostEvent
    ) -> None:
        """Delete what the job made in every cluster; raise CleanupPending until pods are gone."""
        job = _job_for_cleanup(body)
        deleted_at = body["metadata"].get("deletionTimestamp") or ""
        tgts = list(
            dict.fromkeys(
                targets(job)
                if job.spec is not None
                else [home(job)]
                + [
                    Target(g.kubeconfig_secret, g.namespace or job.namespace)
                    for g in job.status.groups
                ]
            )
        )
        # Pods take a moment to go (kwok: at once; a kubelet: their grace period). Look again
        # a few times before handing back to kopf, which logs every retry as an error.
        for _ in range(CLEANUP_SWEEPS):
            waiting, unreachable = self._sweep(job, tgts, deleted_at, post)
            if not waiting or unreachable:
                break
            time.sleep(1.0)
        self.status.forget(job.uid)
        if waiting:
            raise CleanupPending("Waiting for " + ", ".join(waiting))
        logger.info("Deleted the objects of DecoupledDiLoCoJob %s in every cluster", job.name)

    def _sweep(
        self, job: ddapi.DecoupledDiLoCoJob, tgts: list[Target], deleted_at: str, post: PostEvent
    ) -> tuple[list[str], bool]:
        """Delete the job's objects in each target; say what is still there, and whether a
        cluster could not be reached. A target given up on is dropped from `tgts`."""
        waiting: list[str] = []
        unreachable = False
        for tgt in list(tgts):
            try:
                client = self.clusters.client(tgt, job.namespace, allow_stale=True)
                left = delete_job_objects(client, job, tgt, self.timeout)
                if left:
                    waiting.append(f"{left} pods in {tgt.label}")
            except (ClusterProblem, ApiException, *UNREACHABLE_ERRORS) as e:
                p = e if isinstance(e, ClusterProblem) else describe_failure(e, tgt, job.namespace)
                if _age(deleted_at) < self.settings.cleanup_timeout_seconds:
                    waiting.append(f"cluster {tgt.label} ({p.message})")
                    unreachable = True
                else:
                    msg = f"Gave up cleaning the cluster of {tgt.label}: {p.message}"
                    post(Event("Warning", "CleanupSkipped", msg))
                    tgts.remove(tgt)  # once
        return waiting, unreachable


def _job_for_cleanup(body: dict[str, Any]) -> ddapi.DecoupledDiLoCoJob:
    """The job to clean up; with an unreadable spec, what its status says it made is enough."""
    try:
        return ddapi.DecoupledDiLoCoJob.from_body(body)
    except pydantic.ValidationError:
        status = ddapi.JobStatus.model_validate(ddapi.known_status(dict(body.get("status") or {})))
        return ddapi.DecoupledDiLoCoJob.model_construct(
            metadata=dict(body["metadata"]), spec=None, status=status
        )


def _age(timestamp: str) -> float:
    try:
        t = datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return 0.0
    return (datetime.now(UTC) - t).total_seconds()
