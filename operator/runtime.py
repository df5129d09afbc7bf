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
from ddiloco.operator import builders, certs, redact, spares, tokens
from ddiloco.operator import conditions as c
from ddiloco.operator.apply import delete_job_objects, foreign, get_or_none, send
from ddiloco.operator.clusters import (
    UNREACHABLE_ERRORS,
    ClusterProblem,
    Clusters,
    api_message,
    api_reason,
    as_dict,
    request_timeout,
)
from ddiloco.operator.config import OperatorSettings
from ddiloco.operator.metrics import METRICS, OperatorMetrics
from ddiloco.operator.plan import (
    Action,
    Assignment,
    ClusterView,
    Event,
    Observed,
    PodView,
    SecretView,
    Target,
    home,
    status_targets,
    targets,
)
from ddiloco.operator.reconcile import reconcile
from ddiloco.operator.syncstatus import StatusReader

log = logging.getLogger(__name__)
MAX_PASSES = 3
CLEANUP_SWEEPS = 5
WARN_EVERY_S = 60.0
CLEANUP_INCOMPLETE = "CleanupIncomplete"  # Degraded reason on a job whose deletion left objects
PostEvent = Callable[[Event], None]


class CleanupPending(Exception):
    """Deletion has to wait: pods still terminating, or a cluster not answering yet."""


class Runtime:
    """The operator's connection to the clusters; one per process, shared by all jobs.

    Keeps the cached remote clients (clusters.py), the last synchronizer answers
    (syncstatus.py), what the apiservers refused in each job's last pass, and when each
    repeated failure was last logged. A failed API call never raises out of a pass for a
    remote cluster: it becomes a Degraded condition or a log line, and the next tick tries
    again; a remote cluster that does not answer is skipped until it does (clusters.py), so
    the others go on. Failures of the home apiserver propagate to kopf, which retries the
    timer after its backoff.

    Ownership: the operator changes and deletes only objects carrying the job's uid (label or
    ownerReference, `builders.made_by`). An object of the name the job needs that is someone
    else's is left as it is and the job is refused there with a NameConflict: a foreign token
    Secret or synchronizer object at home holds back the whole job, one in a region holds back
    that region, a foreign pod holding a slot's name holds back that slot.
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
        self._warned: dict[str, float] = {}
        self._refused: dict[str, dict[str, tuple[str, str]]] = {}  # job uid -> key -> refusal
        self._delivered: dict[str, set[str]] = {}  # job uid -> promoted spares' pod uids
        self._resends: dict[str, spares.Resends] = {}  # job uid -> when to send again

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
            fresh = secrets.token_urlsafe(32)
            redact.register(fresh)
            obs = self.observe(job)
            plan = reconcile(job, obs, fresh_token=fresh)
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
            for event in plan.events:
                post(event)
            refused: dict[str, tuple[str, str]] = {}
            for action in plan.actions:
                if action.verb == "patch" and action.kind == "Pod":  # a spare's promotion
                    if self._patch(job, action, logger):
                        if action.then is not None:
                            self._assign(job, obs, [action.then], logger)
                        if action.event is not None:
                            post(action.event)
                    continue
                if (refusal := self._apply(job, action, logger, post)) is not None:
                    refused[action.describe()] = refusal
            self._refused[job.uid] = refused  # what the next pass reports
            self._assign(job, obs, plan.assignments, logger, every=True)
            if not plan.actions:
                return

    def observe(self, job: ddapi.DecoupledDiLoCoJob) -> Observed:
        views = {tgt: self._observe_target(job, tgt) for tgt in targets(job)}
        h = self.clusters.home
        kw: dict[str, Any] = {"_request_timeout": self.timeout}
        apps, core = kubernetes.client.AppsV1Api(h), kubernetes.client.CoreV1Api(h)
        sync, claim_name = builders.synchronizer_name(job), builders.state_claim_name(job)
        shards_svc = builders.shards_service_name(job)
        sts = get_or_none(lambda: apps.read_namespaced_stateful_set(sync, job.namespace, **kw))
        legacy = get_or_none(lambda: apps.read_namespaced_deployment(sync, job.namespace, **kw))
        service = get_or_none(lambda: core.read_namespaced_service(sync, job.namespace, **kw))
        headless = get_or_none(
            lambda: core.read_namespaced_service(shards_svc, job.namespace, **kw)
        )
        claim = get_or_none(
            lambda: core.read_namespaced_persistent_volume_claim(claim_name, job.namespace, **kw)
        )
        # The StatefulSet's claims (volumeClaimTemplates): its controller mounts a claim of
        # the template's name whoever made it, and then deletes it with the StatefulSet, so
        # one the job did not make must never meet the StatefulSet.
        shard_claims = [
            get_or_none(
                lambda i=i: core.read_namespaced_persistent_volume_claim(
                    builders.shard_claim_name(job, i), job.namespace, **kw
                )
            )
            for i in range(job.spec.synchronizer.shards)
        ]
        # Someone else's object of a name the synchronizer needs holds back the whole job:
        # learners would present the token to, or the synchronizer mount, what is not theirs.
        home_view = views[home(job)]
        conflicts = [] if home_view.problem is None else [home_view.problem]
        for kind, obj in (
            ("StatefulSet", sts),
            ("Deployment", legacy),
            ("Service", service),
            ("Service", headless),
            ("PersistentVolumeClaim", claim),
            *(("PersistentVolumeClaim", x) for x in shard_claims),
        ):
            if obj is not None and not builders.made_by(job, obj.metadata):
                conflicts.append(
                    (c.NAME_CONFLICT, _foreign(job, kind, job.namespace, obj.metadata.name))
                )
        if any(reason == c.NAME_CONFLICT for reason, _ in conflicts):
            problem = next(p for p in conflicts if p[0] == c.NAME_CONFLICT)
            views = {t: ClusterView(problem=problem) for t in views}
            sts = legacy = service = headless = claim = None
        sts_dict = as_dict(h, sts) if sts is not None else None
        available = int(((sts_dict or {}).get("status") or {}).get("availableReplicas") or 0)
        cert_manager, certificate = certs.observe_cert_manager(h, job, self.timeout)
        sync_status = (
            self.status.read(
                job,
                tokens.current(views[home(job)].token),
                self.status_tls.context(job, views[home(job)], datetime.now(UTC)),
            )
            if available >= job.spec.synchronizer.shards
            else None
        )
        return Observed(
            now=datetime.now(UTC),
            clusters=views,
            statefulset=sts_dict,
            service=service is not None,
            shards_service=headless is not None,
            service_ports=_ports(h, service),
            shards_service_ports=_ports(h, headless),
            claim=claim is not None,
            legacy_deployment=as_dict(h, legacy) if legacy is not None else None,
            sync_status=sync_status,
            cert_manager=cert_manager,
            certificate=certificate,
            refused=tuple(self._refused.get(job.uid, {}).values()),
        )

    def _observe_target(self, job: ddapi.DecoupledDiLoCoJob, tgt: Target) -> ClusterView:
        """One target's pods (of the groups it holds, in the spec or the last status) and the
        job's Secrets there, or why they cannot be seen. Every failure of a remote cluster
        (whatever it raised) becomes a problem; home's propagate.

        A Secret of a name the job needs that the job did not make holds the target back (a
        NameConflict): at home the key, anywhere a group's credentials, which its pods would
        mount. A remote `<job>-token` is only ever a copy an older operator made, to delete:
        someone else's of that name is left alone and is no conflict."""
        try:
            client = self.clusters.client(tgt, job.namespace)
            core = kubernetes.client.CoreV1Api(client)
            groups = tokens.secret_names(job, tgt)  # the groups this target holds
            pods = (
                core.list_namespaced_pod(
                    tgt.namespace,
                    label_selector=builders.learner_selector(job, groups),
                    _request_timeout=self.timeout,
                ).items
                if groups
                else []
            )
            secret = get_or_none(
                lambda: core.read_namespaced_secret(
                    builders.token_secret_name(job), tgt.namespace, _request_timeout=self.timeout
                )
            )
            creds = {
                name: get_or_none(
                    lambda name=name: core.read_namespaced_secret(
                        name, tgt.namespace, _request_timeout=self.timeout
                    )
                )
                for name in tokens.secret_names(job, tgt).values()
            }
            job_secrets = certs.observe_secrets(core, job, tgt, self.timeout)
        except ClusterProblem as p:
            return ClusterView(problem=(p.reason, p.message))
        except Exception as e:
            if tgt.is_home:
                raise
            p = self.clusters.failed(tgt, job.namespace, e)
            return ClusterView(problem=(p.reason, p.message))
        if secret is not None and not builders.made_by(job, secret.metadata):
            if tgt.is_home:
                name = builders.token_secret_name(job)
                return ClusterView(
                    problem=(c.NAME_CONFLICT, _foreign(job, "Secret", tgt.namespace, name, tgt))
                )
            secret = None  # someone else's, of the name an older operator's copy had
        for name, found in creds.items():
            if found is None:
                continue
            if not builders.made_by(job, found.metadata):
                if tgt.server is not None:  # a place left: only the job's is cleaned there
                    continue
                return ClusterView(
                    problem=(c.NAME_CONFLICT, _foreign(job, "Secret", tgt.namespace, name, tgt))
                )
            job_secrets[name] = SecretView.from_k8s(as_dict(client, found))
        if secret is not None:  # tokens.py keeps a rotation's state in its annotations
            job_secrets[builders.token_secret_name(job)] = SecretView.from_k8s(
                as_dict(client, secret)
            )
        token = builders.secret_token({"data": secret.data}) if secret is not None else None
        redact.register(token)
        for line in tokens.lines(token):  # "new\nold" during a rotation (tokens.py)
            redact.register(line)
        return ClusterView(
            pods=tuple(
                v
                for p in pods
                if builders.made_by(job, p.metadata)
                and (v := PodView.from_k8s(as_dict(client, p))) is not None
            ),
            token=token,
            secrets=job_secrets,
            server=self.clusters.server(client),
        )

    def _apply(
        self,
        job: ddapi.DecoupledDiLoCoJob,
        action: Action,
        logger: logging.Logger | logging.LoggerAdapter,
        post: PostEvent,
    ) -> tuple[str, str] | None:
        """Send one action; log and carry on when it fails (the next tick tries again).
        Returns what the apiserver refused, for the status: (Degraded reason, message); an
        event says it too, as a ReplicaSet's FailedCreate does."""
        refusal: tuple[str, str] | None = None
        client: ApiClient | None = None
        try:
            client = self.clusters.client(action.target, job.namespace)
            send(client, action, self.timeout)
            logger.debug("Done: %s", action.describe())
            if action.event is not None:
                post(action.event)
            return None
        except ClusterProblem as p:
            why = p.message
        except ApiException as e:
            why = api_reason(e)
            if e.status == 404 and action.verb == "delete":
                logger.debug("Already done: %s (%s)", action.describe(), why)
                return None
            if e.status == 409 and action.verb == "create" and client is not None:
                try:
                    conflict = foreign(client, job, action, self.timeout)
                except Exception as read_error:
                    conflict, why = None, api_reason(read_error)
                if conflict is None:
                    logger.debug("Already done: %s (%s)", action.describe(), why)
                    return None
                refusal, why = (c.NAME_CONFLICT, conflict), conflict
            elif e.status and 400 <= e.status < 500 and e.status not in (409, 429):
                if action.verb != "delete":
                    what = "create" if action.verb == "create" else "update"
                    refusal = (
                        c.FAILED_CREATE,
                        f"Could not {what} {action.kind} {action.target.namespace}/"
                        f"{action.name} in {action.target.label}: {api_message(e)}",
                    )
                    why = refusal[1]
            elif not action.target.is_home:
                self.clusters.failed(action.target, job.namespace, e)
        except Exception as e:
            if action.target.is_home and not isinstance(e, UNREACHABLE_ERRORS):
                raise
            if not action.target.is_home:
                self.clusters.failed(action.target, job.namespace, e)
            why = api_reason(e)
        # The same failure repeats every tick (e.g. a missing namespace in a region): say it
        # once a minute, not twice a second; a refusal also as an event on the job.
        key = f"{job.namespace}|{action.describe()}|{why}"
        now = time.monotonic()
        if now - self._warned.get(key, -1e9) >= WARN_EVERY_S:
            self._warned[key] = now
            logger.warning("Could not %s: %s", action.describe(), why)
            if refusal is not None:
                post(Event("Warning", refusal[0], refusal[1]))
        else:
            logger.debug("Could not %s: %s", action.describe(), why)
        return refusal

    def _patch(
        self,
        job: ddapi.DecoupledDiLoCoJob,
        action: Action,
        logger: logging.Logger | logging.LoggerAdapter,
    ) -> bool:
        """Promote a hot spare (its label patch, preconditions included); False when it was
        refused (the spare went, or was promoted meanwhile): the next pass decides again."""
        try:
            client = self.clusters.client(action.target, job.namespace)
            send(client, action, self.timeout)
        except ClusterProblem as p:
            logger.warning("Could not %s: %s", action.describe(), p.message)
            return False
        except ApiException as e:
            logger.info("Did not %s: %s", action.describe(), api_reason(e))
            if e.status in (404, 409, 422):  # gone, or a precondition failed
                return False
            if not action.target.is_home:
                self.clusters.failed(action.target, job.namespace, e)
                return False
            raise
        except Exception as e:
            if action.target.is_home and not isinstance(e, UNREACHABLE_ERRORS):
                raise
            if not action.target.is_home:
                self.clusters.failed(action.target, job.namespace, e)
            logger.warning("Could not %s: %s", action.describe(), api_reason(e))
            return False
        logger.info("Done: %s", action.describe())
        return True

    def _assign(
        self,
        job: ddapi.DecoupledDiLoCoJob,
        obs: Observed,
        items: list[Assignment],
        logger: logging.Logger | logging.LoggerAdapter,
        every: bool = False,
    ) -> None:
        """PUT promoted spares' assignments to the synchronizer, each until it says the spare
        fetched it (spares.py), when `spares.Resends` says it is due; a failure is logged and
        a later pass sends it again. `every`: `items` are all the pass's promoted pods that
        are alive (the others' backoff is forgotten)."""
        delivered = self._delivered.setdefault(job.uid, set())
        resends = self._resends.setdefault(job.uid, spares.Resends())
        if every:
            resends.keep({a.uid for a in items})
        clock = time.monotonic()
        todo = [a for a in items if a.uid not in delivered and resends.due(a, clock)]
        if not todo:
            return
        view = obs.clusters.get(home(job), ClusterView())
        token = tokens.current(view.token)
        if token is None:
            return
        url = self.status.url(job)
        context = self.status_tls.context(job, view, obs.now)
        for item in todo:
            try:
                done = spares.put_assignment(
                    url, token, context, item, self.settings.http_timeout_seconds
                )
            except (OSError, ValueError) as e:
                resends.sent(item, clock, delivered=False)
                logger.info(
                    "Could not send the assignment of spare %s to the synchronizer: %s",
                    item.pod,
                    type(e).__name__,
                )
                continue
            resends.sent(item, clock, delivered=done)
            logger.debug("Sent the assignment of spare %s (delivered: %s)", item.pod, done)
            if done:
                if len(delivered) > 100_000:
                    delivered.clear()
                delivered.add(item.uid)

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
        """Delete what the job made in every cluster; raise CleanupPending until pods are gone.

        A cluster that does not answer is waited for `cleanup_timeout_seconds` after the
        deletion began (a Degraded condition on the job says which, meanwhile), then given
        up: a CleanupSkipped event names the cluster and what was left there, and the
        finalizer goes. So `kubectl delete` ends within that bound, also with a region down."""
        job = _job_for_cleanup(body)
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
        self.status.forget(job.uid)
        self.status_tls.forget(job.uid)
        self._refused.pop(job.uid, None)
        self._delivered.pop(job.uid, None)
        self._resends.pop(job.uid, None)
        self.metrics.forget(job)
        logger.info("Deleted the objects of DecoupledDiLoCoJob %s in every cluster", job.name)

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
            key = f"cleanup|{job.uid}|{tgt}"
            if key not in self._warned:  # once per job and cluster, not per kopf retry
                self._warned[key] = time.monotonic()
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


def _foreign(
    job: ddapi.DecoupledDiLoCoJob, kind: str, namespace: str, name: str, tgt: Target | None = None
) -> str:
    where = "" if tgt is None or tgt.is_home else f" in the cluster of {tgt.label}"
    return (
        f"{kind} {namespace}/{name}{where} exists and was not created by this job (no "
        f"{builders.LABEL_JOB_UID}={job.uid}); the operator neither uses nor changes it. "
        f"Delete or rename it, or rename the job"
    )


def _ports(client: ApiClient, service: Any) -> tuple[dict[str, Any], ...] | None:
    """A Service's spec.ports as the API sends them (camelCase), or None without a Service."""
    if service is None:
        return None
    return tuple((as_dict(client, service).get("spec") or {}).get("ports") or ())


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
