"""The operator's reconcile pass: observe the clusters, plan, write the job's status, act.

    runtime = Runtime(get_settings(), home_api_client())
    runtime.reconcile("tiny", "default", logger, post)   # one pass (what the kopf timer calls)
    runtime.clean_up(body, logger, post)                  # what the finalizer handler calls

One reconcile for a job runs at a time (handlers.py holds a per-job lock). Each pass reads the
job afresh, observes every target cluster (observe.py), asks reconcile.py for a plan (pure:
no I/O), writes the status first (optimistic concurrency: a conflict ends the pass, the next
tick retries) and only then acts on the plan (act.py). That order is what makes a
replacement crash-safe (reconcile.py). Deletion is cleanup.py's; this module then drops what
it kept of the job in memory.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from datetime import UTC, datetime
from typing import Any

import kubernetes
import pydantic
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from ddiloco.operator import api as ddapi
from ddiloco.operator import certs, redact
from ddiloco.operator.act import WARN_EVERY_S, Actor, PostEvent
from ddiloco.operator.apply import get_or_none
from ddiloco.operator.cleanup import Cleaner
from ddiloco.operator.clusters import Clusters, api_reason, request_timeout
from ddiloco.operator.config import OperatorSettings
from ddiloco.operator.kueue import Queue
from ddiloco.operator.metrics import METRICS, OperatorMetrics
from ddiloco.operator.observe import Observer
from ddiloco.operator.plan import Event, iso
from ddiloco.operator.reconcile import reconcile
from ddiloco.operator.syncstatus import StatusReader

MAX_PASSES = 3


class Runtime:
    """The operator's connection to the clusters; one per process, shared by all jobs.

    Holds the cached remote clients (clusters.py), the last synchronizer answers
    (syncstatus.py) and the operator's own https client (certs.py), shared by its observer
    (observe.py), its actor (act.py) and its cleaner (cleanup.py); and, per job, what the
    apiservers refused in its last pass, which the next status reports.
    """

    def __init__(
        self,
        settings: OperatorSettings,
        home_client: ApiClient,
        metrics: OperatorMetrics = METRICS,
    ) -> None:
        redact.install()
        self.settings = settings
        self.metrics = metrics  # reconciles and replacements (metrics.py)
        self.clusters = Clusters(home_client, settings.api_timeout_seconds)
        self.status = StatusReader(settings)
        self.status_tls = certs.StatusTLS()  # the operator's own https client (certs.py)
        self.timeout = request_timeout(settings.api_timeout_seconds)
        self.observer = Observer(self.clusters, self.status, self.status_tls, self.timeout)
        self.actor = Actor(settings, self.clusters, self.status, self.status_tls, self.timeout)
        self.cleaner = Cleaner(settings, self.clusters, self.timeout)
        self.queue = Queue(home_client, self.timeout)  # Kueue's Workloads (kueue.py)
        self._warned: dict[str, float] = {}  # status refusals: when each was last logged
        self._refused: dict[str, dict[str, tuple[str, str]]] = {}  # job uid -> key -> refusal

    # -- the kopf timer's work -------------------------------------------------------------
    def reconcile(
        self,
        name: str,
        namespace: str,
        logger: logging.Logger | logging.LoggerAdapter,
        post: PostEvent,
    ) -> None:
        """Reconcile one job: up to MAX_PASSES observe-plan-apply passes, so that a pod
        deleted in one pass is recreated in the next instead of a tick later. Counted and
        timed (ddiloco_operator_reconciles_total, ..._reconcile_duration_seconds)."""
        with self.metrics.reconciling(namespace, name):
            self._reconcile(name, namespace, logger, post)

    def _reconcile(
        self,
        name: str,
        namespace: str,
        logger: logging.Logger | logging.LoggerAdapter,
        post: PostEvent,
    ) -> None:
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
            gate = self.queue.gate(job)  # Kueue's admission (kueue.py); None: not queued
            run = job if gate is None else gate.job
            fresh = secrets.token_urlsafe(32)
            redact.register(fresh)
            obs = self.observer.observe(run, tuple(self._refused.get(job.uid, {}).values()))
            plan = reconcile(run, obs, fresh_token=fresh)
            if gate is not None:
                pods = [p for view in obs.clusters.values() for p in view.pods]
                status = self.queue.settle(
                    job, gate, plan.status, pods, obs.statefulset, iso(obs.now), post
                )
                plan = dataclasses.replace(plan, status=status)
                job = run
            written = True
            if plan.status is not None:
                try:
                    body = self._write_status(body, plan.status, logger)
                except ApiException as e:
                    if not (e.status and 400 <= e.status < 500):
                        raise
                    # Refused as invalid: the status cannot say so, an event does; the
                    # actions go on (they never depend on a status write that cannot happen).
                    self._status_refused(job, e, logger, post)
                    written = False
                if body is None:
                    return  # changed meanwhile: the next tick sees the new version
            if written:
                self.metrics.after_pass(job, job.status, plan.status, obs)  # written: count it
            self._refused[job.uid] = self.actor.act(job, obs, plan, logger, post)
            self.actor.assign(job, obs, plan.assignments, logger, every=True)
            if not plan.actions:
                return

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

    def _status_refused(
        self,
        job: ddapi.DecoupledDiLoCoJob,
        error: ApiException,
        logger: logging.Logger | logging.LoggerAdapter,
        post: PostEvent,
    ) -> None:
        """Say, once a minute, that the apiserver refused the job's status."""
        why = api_reason(error)
        key = f"status|{job.uid}|{why}"
        now = time.monotonic()
        if now - self._warned.get(key, -1e9) < WARN_EVERY_S:
            logger.debug("Status not written: %s", why)
            return
        self._warned[key] = now
        logger.warning("The apiserver refused the job's status (%s); acting on the pass", why)
        post(
            Event(
                "Warning",
                "StatusNotWritten",
                f"The apiserver refused the job's status ({why}); the operator goes on acting",
            )
        )

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
        """Delete what the job made in every cluster (cleanup.py; raises CleanupPending until
        its pods are gone), then forget what this process kept of it."""
        job = self.cleaner.clean_up(body, post)
        self.status.forget(job.uid)
        self.status_tls.forget(job.uid)
        self._refused.pop(job.uid, None)
        self.actor.forget(job.uid)
        self.queue.forget(job.uid)
        self.metrics.forget(job)
        logger.info("Deleted the objects of DecoupledDiLoCoJob %s in every cluster", job.name)
