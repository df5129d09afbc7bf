"""Delete what a job made in every cluster, for the finalizer of a job being deleted.

    cleaner = Cleaner(settings, clusters, timeout)
    job = cleaner.clean_up(body, post)     # raises CleanupPending while pods are still going

Each sweep deletes, in every place the spec or the status names (a group's cluster also by
its server URL), the job's objects there (apply.py `delete_job_objects`: only what carries
the job's uid). Pods take a moment to go, so a pass sweeps a few times before handing back
to kopf. A cluster that does not answer is waited for `cleanup_timeout_seconds` after the
deletion began (a Degraded condition on the job says which, meanwhile), then given up: a
CleanupSkipped event names the cluster and what was left there, and the finalizer goes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import kubernetes
import pydantic
from kubernetes.client.exceptions import ApiException

from ddiloco.operator import api as ddapi
from ddiloco.operator import builders
from ddiloco.operator import conditions as c
from ddiloco.operator.apply import Timeout, delete_job_objects
from ddiloco.operator.clusters import UNREACHABLE_ERRORS, ClusterProblem, Clusters, api_reason
from ddiloco.operator.config import OperatorSettings
from ddiloco.operator.plan import Event, Target, home, status_targets, targets

log = logging.getLogger(__name__)
CLEANUP_SWEEPS = 5
CLEANUP_INCOMPLETE = "CleanupIncomplete"  # Degraded reason on a job whose deletion left objects
PostEvent = Callable[[Event], None]


class CleanupPending(Exception):
    """Deletion has to wait: pods still terminating, or a cluster not answering yet."""


class Cleaner:
    """Deletes a job's objects through the operator's cached cluster clients (clusters.py);
    remembers which clusters it has already reported giving up on, per job."""

    def __init__(self, settings: OperatorSettings, clusters: Clusters, timeout: Timeout) -> None:
        self.settings = settings
        self.clusters = clusters
        self.timeout = timeout
        self._reported: set[str] = set()  # "job uid|target" given up on, said once

    def clean_up(self, body: dict[str, Any], post: PostEvent) -> ddapi.DecoupledDiLoCoJob:
        """Delete what the job made in every cluster; raise CleanupPending until pods are gone.
        Returns the job (as far as its body can be read), whose in-memory state the caller
        may then drop.

        A cluster that does not answer is waited for `cleanup_timeout_seconds` after the
        deletion began (a Degraded condition on the job says which, meanwhile), then given
        up: a CleanupSkipped event names the cluster and what was left there, and the
        finalizer goes. So `kubectl delete` ends within that bound, also with a region down."""
        job = job_for_cleanup(body)
        deleted_at = body["metadata"].get("deletionTimestamp") or ""
        # every place the status records, also by server URL: a kubeconfig Secret edited
        # since the last pass points elsewhere, and its group's objects are where they were
        # (reached after the Secrets' own clients, which may be the way there)
        tgts = list(
            dict.fromkeys(
                (targets(job) if job.spec is not None else [home(job)])
                + [t for g in job.status.groups for t in status_targets(job, g)]
            )
        )
        # Pods take a moment to go (kwok: at once; a kubelet: their grace period). Look again
        # a few times before handing back to kopf, which logs every retry as an error.
        left_behind: list[str] = []
        for _ in range(CLEANUP_SWEEPS):
            waiting, unreachable, left_behind = self._sweep(job, tgts, deleted_at, post)
            if not waiting or unreachable:
                break
            time.sleep(1.0)
        if unreachable:
            self._note_cleanup(
                body,
                c.CLUSTER_UNREACHABLE,
                "Deleting: waiting for "
                + "; ".join(w for w in waiting if w.startswith("cluster "))
                + f"; given up {self.settings.cleanup_timeout_seconds:.0f}s after the deletion",
            )
        if waiting:
            raise CleanupPending("Waiting for " + ", ".join(waiting))
        if left_behind:
            self._note_cleanup(body, CLEANUP_INCOMPLETE, "; ".join(left_behind))
        return job

    def _sweep(
        self, job: ddapi.DecoupledDiLoCoJob, tgts: list[Target], deleted_at: str, post: PostEvent
    ) -> tuple[list[str], bool, list[str]]:
        """Delete the job's objects in each target; say what is still there, whether a
        cluster could not be reached, and what was left behind in clusters given up on."""
        waiting: list[str] = []
        unreachable = False
        left_behind: list[str] = []
        failed: set[str | None] = set()  # servers that did not answer in this sweep
        for tgt in tgts:
            try:
                client = self.clusters.client(tgt, job.namespace, allow_stale=True)
                left = delete_job_objects(client, job, tgt, self.timeout)
                if left:
                    waiting.append(f"{left} pods in {tgt.label}")
                continue
            except ClusterProblem as e:
                p = e
            except Exception as e:
                if tgt.is_home and not isinstance(e, UNREACHABLE_ERRORS):
                    raise
                p = self.clusters.failed(tgt, job.namespace, e)
            server = self.clusters.known_server(tgt, job.namespace)
            if tgt.server is not None and server in failed:
                continue  # a group's place by its URL, already reported by its Secret's name
            failed.add(server)
            if _age(deleted_at) < self.settings.cleanup_timeout_seconds:
                waiting.append(f"cluster {tgt.label} ({p.message})")
                unreachable = True
                continue
            what = (
                f"Gave up cleaning the cluster of {tgt.label} {_age(deleted_at):.0f}s after the "
                f"deletion: {p.message}. Left behind in its namespace {tgt.namespace}, unless "
                f"already gone: the learner pods labelled {builders.LABEL_JOB_UID}={job.uid} "
                f"and Secret {builders.token_secret_name(job)}"
                + (
                    f", StatefulSet and Service {builders.synchronizer_name(job)}, Service "
                    f"{builders.shards_service_name(job)}, the PersistentVolumeClaims "
                    f"labelled {builders.LABEL_JOB_UID}={job.uid}"
                    if tgt.is_home
                    else ""
                )
            )
            left_behind.append(what)
            key = f"{job.uid}|{tgt}"
            if key not in self._reported:  # once per job and cluster, not per kopf retry
                self._reported.add(key)
                post(Event("Warning", "CleanupSkipped", what))
        return waiting, unreachable, left_behind

    def _note_cleanup(self, body: dict[str, Any], reason: str, message: str) -> None:
        """Say on the job being deleted what its deletion waits for or left behind (the
        Degraded condition), so `kubectl describe` shows it while the finalizer holds."""
        meta = body["metadata"]
        old = list((body.get("status") or {}).get("conditions") or [])
        before = next((x for x in old if x.get("type") == c.DEGRADED), {})
        if before.get("reason") == reason and before.get("message") == message:
            return
        cond = {
            "type": c.DEGRADED,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastTransitionTime": before.get("lastTransitionTime")
            if before.get("status") == "True"
            else datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "observedGeneration": meta.get("generation"),
        }
        conds = [x for x in old if x.get("type") != c.DEGRADED] + [cond]
        try:
            out = kubernetes.client.CustomObjectsApi(
                self.clusters.home
            ).patch_namespaced_custom_object_status(
                ddapi.GROUP,
                ddapi.VERSION,
                meta["namespace"],
                ddapi.PLURAL,
                meta["name"],
                {"status": {"conditions": conds}},
                _request_timeout=self.timeout,
            )
            body["status"] = dict(out.get("status") or {})
        except (ApiException, *UNREACHABLE_ERRORS) as e:
            log.debug("Deletion condition not written (%s)", api_reason(e))


def job_for_cleanup(body: dict[str, Any]) -> ddapi.DecoupledDiLoCoJob:
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
