"""The kopf handlers of the DecoupledDiLoCoJob operator: thin, the work is in runtime.py (the
reconcile pass) and cleanup.py (the finalizer's deletion).

    ddiloco operator --all-namespaces          # production entry point (cli.py)
    kopf run -m ddiloco.operator.handlers -A   # the same handlers under kopf's own CLI

Two handlers per job: a timer that reconciles every `resync_seconds` (it also notices failed
learner pods in remote clusters, which no watch of ours covers), and the finalizer that
cleans every cluster on deletion; at startup, the metrics endpoint opens (metrics_port,
metrics.py). Handlers return nothing: kopf would store a return value under `status`, which
the structural schema prunes.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import kopf
import prometheus_client

from ddiloco.operator import api
from ddiloco.operator.cleanup import CleanupPending
from ddiloco.operator.clusters import home_api_client
from ddiloco.operator.config import get_settings
from ddiloco.operator.metrics import METRICS
from ddiloco.operator.plan import Event
from ddiloco.operator.runtime import Runtime

CFG = get_settings()


def is_ours(spec: Any, **_: Any) -> bool:
    """spec.managedBy unset or ours; else another controller (e.g. MultiKueue) owns the job."""
    return spec.get("managedBy") in (None, api.MANAGED_BY_US)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Watch timeouts, so a watch that a proxy silently dropped is noticed and reopened
    # (nolar/kopf#585; dask-kubernetes sets the same for the same reason).
    settings.watching.server_timeout = CFG.watch_server_timeout
    settings.watching.client_timeout = CFG.watch_client_timeout
    settings.watching.connect_timeout = CFG.watch_connect_timeout
    settings.watching.inactivity_timeout = CFG.watch_inactivity_timeout
    settings.networking.request_timeout = CFG.api_timeout_seconds * 3
    settings.networking.connect_timeout = CFG.api_timeout_seconds
    # Keep kopf's bookkeeping in annotations: the status belongs to our schema, which would
    # prune kopf's `status.kopf`, and the status is replaced whole by runtime.py.
    settings.persistence.finalizer = f"{api.GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=api.GROUP)
    # A reconcile may be running when a job is deleted; kopf keeps the finalizer until that
    # timer call returns and, by default, looks again only after 60 s. One second suffices.
    settings.background.cancellation_polling = 1.0
    settings.posting.reporting_component = "ddiloco-operator"
    settings.execution.max_workers = CFG.workers
    memo.runtime = Runtime(CFG, home_api_client())
    if CFG.metrics_port:  # GET /metrics (operator/metrics.py), without the *_created series
        prometheus_client.disable_created_metrics()
        METRICS.serve(CFG.metrics_port, CFG.metrics_address)


@kopf.timer(
    api.GROUP,
    api.VERSION,
    api.PLURAL,
    interval=CFG.resync_seconds,
    backoff=CFG.resync_seconds,
    when=is_ours,
)
def reconcile_job(
    name: str, namespace: str, body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    with _lock(memo):
        memo.runtime.reconcile(name, namespace, logger, _poster(body))


@kopf.on.delete(api.GROUP, api.VERSION, api.PLURAL, when=is_ours, backoff=2)
def clean_up(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    with _lock(memo):
        try:
            memo.runtime.clean_up(dict(body), logger, _poster(body))
        except CleanupPending as e:
            raise kopf.TemporaryError(str(e), delay=1) from None


def _lock(memo: kopf.Memo) -> threading.Lock:
    # memo is per object: one reconcile or cleanup of a job at a time, never two.
    lock: threading.Lock = memo.setdefault("lock", threading.Lock())
    return lock


def _poster(body: kopf.Body) -> Any:
    def post(event: Event) -> None:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)

    return post
