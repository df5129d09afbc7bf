"""The operator's Prometheus metrics: reconciles, learner replacements by cause, and how long
a failed learner's slot stays without a Running pod.

    metrics = OperatorMetrics()                       # its own registry (tests make several)
    with metrics.reconciling("default", "tiny"):      # counts ok/error, times the pass
        ...
    metrics.after_pass(job, before, after, observed)  # replacements, from the slot books
    metrics.serve(8081)                               # GET :8081/metrics (a daemon thread)

    curl -s localhost:8081/metrics | grep ddiloco_operator_

Series (labels namespace and job on each; the README's Metrics table lists them):
    ddiloco_operator_reconciles_total{result}          result = ok | error
    ddiloco_operator_reconcile_duration_seconds        histogram of one reconcile
    ddiloco_operator_replacements_total{cause}         cause = the failure's reason (Evicted,
                                                       Preempted, OOMKilled, Error, Deleted ...)
    ddiloco_operator_replacement_seconds               histogram: a pod's failure seen -> its
                                                       replacement Running and Ready
    ddiloco_operator_job_degraded{reason}              1 while the job's Degraded condition is
                                                       True (reason: the condition's), else 0
                                                       with reason "" (one series per job)
    ddiloco_operator_job_eval_loss                     the job's latest held-out loss of the
                                                       global model (status.evaluation), once
                                                       its evaluator reported one

Where the numbers come from: reconcile.py keeps every slot's books in the job status
(slots.py), and the runtime writes a status before it acts on it. `after_pass` compares the
books of the status a pass started from with those it wrote: a slot whose replacement count
went up was replaced (its cause is the reason of the failure the old books recorded, the
same pass emits the LearnerReplaced event), a slot newly failed starts the replacement
clock. The clock stops at the first observation of that slot's next pod Running and Ready;
an operator restarted meanwhile falls back to the failure time in the status (whole
seconds). Cardinality stays bounded: jobs come and go with their series (`forget`), causes
are CamelCase words of at most 32 characters and at most MAX_CAUSES distinct ones, the
rest counted as "Other".
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ddiloco.operator import conditions, slots
from ddiloco.operator.api import DecoupledDiLoCoJob, JobStatus
from ddiloco.operator.plan import Observed

log = logging.getLogger(__name__)

MAX_CAUSES = 24  # distinct cause label values per process; past that, "Other"
CAUSE = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,31}$")
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REPLACEMENT_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


class OperatorMetrics:
    """The operator's instruments on a registry of their own (not prometheus_client's
    global one, so nothing else a library registers there leaks into the operator's
    /metrics, and tests can make as many as they like)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        job = ("namespace", "job")
        self.reconciles = Counter(
            "ddiloco_operator_reconciles",
            "Reconciles of a job, by result (error: the pass raised; kopf retries it)",
            [*job, "result"],
            registry=self.registry,
        )
        self.reconcile_duration = Histogram(
            "ddiloco_operator_reconcile_duration_seconds",
            "Time of one reconcile of a job (observe every cluster, plan, write, act)",
            job,
            buckets=RECONCILE_BUCKETS,
            registry=self.registry,
        )
        self.replacements = Counter(
            "ddiloco_operator_replacements",
            "Learner pods replaced in their slot, by the cause of the failure",
            [*job, "cause"],
            registry=self.registry,
        )
        self.replacement_seconds = Histogram(
            "ddiloco_operator_replacement_seconds",
            "Time from a learner pod's failure seen to its replacement Running and Ready",
            job,
            buckets=REPLACEMENT_BUCKETS,
            registry=self.registry,
        )
        self.degraded = Gauge(
            "ddiloco_operator_job_degraded",
            "1 while the job's Degraded condition is True, labelled with its reason; else 0",
            [*job, "reason"],
            registry=self.registry,
        )
        self.eval_loss = Gauge(
            "ddiloco_operator_job_eval_loss",
            "The job's latest held-out loss of the global model (status.evaluation.loss)",
            job,
            registry=self.registry,
        )
        self._lock = threading.Lock()
        self._degraded: dict[str, str] = {}  # job uid -> the reason label its series has now
        self._causes: set[str] = set()
        # job uid -> (group, index) -> (failure time, epoch s; attempt that replaces it)
        self._pending: dict[str, dict[tuple[str, int], tuple[float, int]]] = {}
        self._server: Any = None

    # -- reconciles -------------------------------------------------------------------------
    @contextlib.contextmanager
    def reconciling(self, namespace: str, job: str) -> Iterator[None]:
        """Count and time one reconcile; an exception counts as an error and propagates."""
        start = time.perf_counter()
        result = "error"
        try:
            yield
            result = "ok"
        finally:
            self.reconcile_duration.labels(namespace, job).observe(time.perf_counter() - start)
            self.reconciles.labels(namespace, job, result).inc()

    # -- replacements -----------------------------------------------------------------------
    def cause(self, reason: str | None) -> str:
        """A failure reason as a bounded label value."""
        text = (reason or "Unknown").strip()
        if not CAUSE.match(text):
            return "Other"
        with self._lock:
            if text in self._causes:
                return text
            if len(self._causes) >= MAX_CAUSES:
                return "Other"
            self._causes.add(text)
            return text

    def after_pass(
        self,
        job: DecoupledDiLoCoJob,
        before: JobStatus,
        after: JobStatus | None,
        obs: Observed,
        now: float | None = None,
    ) -> None:
        """Account one pass: `before` the status it started from, `after` the status it
        wrote (None: it wrote none, nothing changed), `obs` what it saw of the pods."""
        now = time.time() if now is None else now
        ns, name = job.namespace, job.name
        self._export_degraded(job, after if after is not None else before)
        evaluation = (after if after is not None else before).evaluation
        if evaluation is not None:
            self.eval_loss.labels(ns, name).set(evaluation.loss)
        with self._lock:
            pending = self._pending.setdefault(job.uid, {})
        if after is not None:
            old, new = slots.decode(before.groups), slots.decode(after.groups)
            for key, rec in new.items():
                was = old.get(key) or slots.Slot(*key)
                if rec.replacements > was.replacements:
                    self.replacements.labels(ns, name, self.cause(was.reason)).inc()
                    if key not in pending and was.failed:  # restarted since the failure
                        pending[key] = (_epoch(was.time, now), rec.replacements)
                if rec.failed and not (was.failed and was.time == rec.time):
                    if rec.replacements < job.spec.failure_policy.max_replacements_per_slot:
                        pending[key] = (now, rec.replacements + 1)
                    else:
                        pending.pop(key, None)  # at the limit: nothing will replace it
                elif not rec.failed and key in pending and rec.replacements < pending[key][1]:
                    pending.pop(key, None)  # suspended: the failure was withdrawn
            for key in [k for k in pending if k not in new]:
                pending.pop(key)  # scaled away
        if not pending:
            return
        for view in obs.clusters.values():
            for pod in view.pods:
                key = (pod.group, pod.index)
                want = pending.get(key)
                if pod.job_uid != job.uid or pod.spare or want is None:
                    continue
                running = pod.phase == "Running" and pod.ready and not pod.terminating
                if pod.attempt >= want[1] and running:
                    self.replacement_seconds.labels(ns, name).observe(max(0.0, now - want[0]))
                    pending.pop(key)

    def _export_degraded(self, job: DecoupledDiLoCoJob, status: JobStatus) -> None:
        """One series per job: its Degraded condition as 1 (with the condition's reason) or 0
        (reason ""), the previous reason's series removed when it changes."""
        cond = conditions.get(status.conditions, conditions.DEGRADED)
        on, reason = False, ""
        if cond is not None and cond.status == "True":
            on, reason = True, cond.reason if CAUSE.match(cond.reason) else "Other"
        with self._lock:
            old = self._degraded.get(job.uid)
            self._degraded[job.uid] = reason
        if old is not None and old != reason:
            self.degraded.remove(job.namespace, job.name, old)
        self.degraded.labels(job.namespace, job.name, reason).set(1 if on else 0)

    def forget(self, job: DecoupledDiLoCoJob) -> None:
        """A deleted job's series go with it (a long-lived operator sees many jobs)."""
        with self._lock:
            self._pending.pop(job.uid, None)
            self._degraded.pop(job.uid, None)
        labels = {"namespace": job.namespace, "job": job.name}
        for metric in (
            self.reconciles,
            self.reconcile_duration,
            self.replacements,
            self.replacement_seconds,
            self.degraded,
            self.eval_loss,
        ):
            metric.remove_by_labels(labels)

    # -- the endpoint -----------------------------------------------------------------------
    def serve(self, port: int, address: str = "0.0.0.0") -> int | None:
        """Serve GET /metrics on a daemon thread; returns the port, None when it could not
        bind (logged: the operator goes on without its metrics rather than not at all)."""
        if self._server is not None:
            return int(self._server.server_port)
        try:
            self._server, _ = start_http_server(port, addr=address, registry=self.registry)
        except OSError as e:
            log.error("Operator metrics are off: cannot listen on %s:%s (%s)", address, port, e)
            return None
        log.info("Operator metrics on http://%s:%s/metrics", address, self._server.server_port)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _epoch(iso: str | None, default: float) -> float:
    try:
        t = datetime.strptime(iso or "", "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return default
    return t.timestamp()


METRICS = OperatorMetrics()
"""The process's instruments: what handlers.py serves and runtime.py records into."""
