"""Read the world for one reconcile pass: each target cluster's learner pods and the job's
Secrets there, the synchronizer's and the evaluator's objects at home, cert-manager's
Certificate, and the synchronizer's own status.

    observer = Observer(clusters, StatusReader(settings), certs.StatusTLS(), timeout)
    obs = observer.observe(job, refused)     # an Observed, which reconcile.py plans from

Reading only: nothing here creates, changes or deletes (act.py and cleanup.py do). A remote
cluster whose calls fail becomes a problem in its ClusterView and the other clusters go on
(clusters.py skips one that does not answer until it does); a failure of the home apiserver
propagates, and kopf retries the pass.

Ownership: only objects carrying the job's uid (label or ownerReference, `builders.made_by`)
are the job's. Someone else's object of a name the job needs becomes a NameConflict problem:
a foreign token Secret or synchronizer object at home holds back the whole job, a foreign
credentials Secret in a region holds back that region.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import kubernetes
from kubernetes.client import ApiClient

from ddiloco.operator import api as ddapi
from ddiloco.operator import builders, certs, evaluator_workload, redact, tokens
from ddiloco.operator import conditions as c
from ddiloco.operator.apply import Timeout, get_or_none
from ddiloco.operator.clusters import ClusterProblem, Clusters, as_dict
from ddiloco.operator.plan import (
    ClusterView,
    Observed,
    PodView,
    SecretView,
    Target,
    home,
    targets,
)
from ddiloco.operator.syncstatus import StatusReader


class Observer:
    """Reads what a pass needs, through the operator's cached cluster clients (clusters.py),
    its synchronizer status reader (syncstatus.py) and its own https client (certs.py)."""

    def __init__(
        self,
        clusters: Clusters,
        status: StatusReader,
        status_tls: certs.StatusTLS,
        timeout: Timeout,
    ) -> None:
        self.clusters = clusters
        self.status = status
        self.status_tls = status_tls
        self.timeout = timeout

    def observe(
        self, job: ddapi.DecoupledDiLoCoJob, refused: tuple[tuple[str, str], ...] = ()
    ) -> Observed:
        """What reconcile.py needs of the world for `job`; `refused`: what the apiservers
        refused in the job's last pass (Degraded reason, message), carried into the plan."""
        views = {tgt: self.target(job, tgt) for tgt in targets(job)}
        h = self.clusters.home
        kw: dict[str, Any] = {"_request_timeout": self.timeout}
        apps, core = kubernetes.client.AppsV1Api(h), kubernetes.client.CoreV1Api(h)
        sync = builders.synchronizer_name(job)
        shards_svc = builders.shards_service_name(job)
        sts = get_or_none(lambda: apps.read_namespaced_stateful_set(sync, job.namespace, **kw))
        evaluator = get_or_none(
            lambda: apps.read_namespaced_deployment(
                evaluator_workload.evaluator_name(job), job.namespace, **kw
            )
        )
        if evaluator is not None and not builders.made_by(job, evaluator.metadata):
            evaluator = None  # someone else's: never touched (a create reports the conflict)
        service = get_or_none(lambda: core.read_namespaced_service(sync, job.namespace, **kw))
        headless = get_or_none(
            lambda: core.read_namespaced_service(shards_svc, job.namespace, **kw)
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
            ("Service", service),
            ("Service", headless),
            *(("PersistentVolumeClaim", x) for x in shard_claims),
        ):
            if obj is not None and not builders.made_by(job, obj.metadata):
                conflicts.append(
                    (c.NAME_CONFLICT, foreign_message(job, kind, job.namespace, obj.metadata.name))
                )
        if any(reason == c.NAME_CONFLICT for reason, _ in conflicts):
            problem = next(p for p in conflicts if p[0] == c.NAME_CONFLICT)
            views = {t: ClusterView(problem=problem) for t in views}
            sts = service = headless = None
        sts_dict = as_dict(h, sts) if sts is not None else None
        sync_pods = (
            core.list_namespaced_pod(
                job.namespace,
                label_selector=f"{builders.LABEL_JOB_UID}={job.uid},"
                f"{builders.LABEL_COMPONENT}=synchronizer",
                **kw,
            ).items
            if sts is not None
            else []
        )
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
            synchronizer_pods=tuple(
                as_dict(h, p) for p in sync_pods if builders.made_by(job, p.metadata)
            ),
            service=service is not None,
            shards_service=headless is not None,
            service_ports=_ports(h, service),
            shards_service_ports=_ports(h, headless),
            sync_status=sync_status,
            cert_manager=cert_manager,
            certificate=certificate,
            refused=refused,
            evaluator=as_dict(h, evaluator) if evaluator is not None else None,
        )

    def target(self, job: ddapi.DecoupledDiLoCoJob, tgt: Target) -> ClusterView:
        """One target's pods (of the groups it holds, in the spec or the last status) and the
        job's Secrets there, or why they cannot be seen. Every failure of a remote cluster
        (whatever it raised) becomes a problem; home's propagate.

        A Secret of a name the job needs that the job did not make holds the target back (a
        NameConflict): at home the key, anywhere a group's credentials, which its pods would
        mount. The key is read at home only: remote targets hold learners' credentials."""
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
            secret = (
                get_or_none(
                    lambda: core.read_namespaced_secret(
                        builders.token_secret_name(job),
                        tgt.namespace,
                        _request_timeout=self.timeout,
                    )
                )
                if tgt.is_home
                else None
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
            if tgt.is_home:  # the evaluator's credential (evaluator_workload.py)
                name = evaluator_workload.evaluator_token_secret_name(job)
                found = get_or_none(
                    lambda: core.read_namespaced_secret(
                        name, tgt.namespace, _request_timeout=self.timeout
                    )
                )
                if found is not None and builders.made_by(job, found.metadata):
                    job_secrets[name] = SecretView.from_k8s(as_dict(client, found))
        except ClusterProblem as p:
            return ClusterView(problem=(p.reason, p.message))
        except Exception as e:
            if tgt.is_home:
                raise
            p = self.clusters.failed(tgt, job.namespace, e)
            return ClusterView(problem=(p.reason, p.message))
        if secret is not None and not builders.made_by(job, secret.metadata):
            name = builders.token_secret_name(job)
            return ClusterView(
                problem=(
                    c.NAME_CONFLICT,
                    foreign_message(job, "Secret", tgt.namespace, name, tgt),
                )
            )
        for name, found in creds.items():
            if found is None:
                continue
            if not builders.made_by(job, found.metadata):
                if tgt.server is not None:  # a place left: only the job's is cleaned there
                    continue
                return ClusterView(
                    problem=(
                        c.NAME_CONFLICT,
                        foreign_message(job, "Secret", tgt.namespace, name, tgt),
                    )
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


def foreign_message(
    job: ddapi.DecoupledDiLoCoJob, kind: str, namespace: str, name: str, tgt: Target | None = None
) -> str:
    """Why the job leaves an object of a name it needs alone: it is not the job's."""
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
