"""What reconcile reads and what it returns: targets, observations, and the plan.

    from ddiloco.operator.plan import Observed, ClusterView, PodView, Target, targets
    obs = Observed(now=..., clusters={target: ClusterView(pods=(...), token=...)}, ...)

A `Target` is a cluster (the operator's own, or one reached through a kubeconfig Secret) and
a namespace in it. observe.py fills an `Observed` from the clusters, reconcile.py turns it
into a `Plan`, and act.py sends the plan's `Action`s. Everything here is plain data: the
unit tests build these by hand.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal

from ddiloco.operator import builders
from ddiloco.operator.api import DecoupledDiLoCoJob, JobStatus, LearnerGroup, SecretKeyRef


@dataclass(frozen=True)
class Target:
    """A cluster and namespace that holds some of a job's objects.

    `server` names a place where a group's objects were before its kubeconfig Secret came to
    point at another cluster (or its namespace changed): the API server URL recorded in the
    job's status (`GroupStatus.former`), reached with the credentials the operator last used
    there (held in memory only, clusters.py). Such a target is only cleaned, never written."""

    secret: SecretKeyRef | None  # None: the operator's own cluster (unless `server`)
    namespace: str
    server: str | None = None

    @property
    def is_home(self) -> bool:
        return self.secret is None and self.server is None

    @property
    def label(self) -> str:
        if self.server is not None:
            return self.server
        return "local" if self.secret is None else self.secret.name


def former_targets(job: DecoupledDiLoCoJob) -> list[Target]:
    """Where the status says groups' objects were left when their cluster changed."""
    return [Target(None, f.namespace, server=f.server) for g in job.status.groups for f in g.former]


def status_targets(job: DecoupledDiLoCoJob, gs: Any) -> list[Target]:
    """The targets a group of the last status holds objects in: its cluster, the same by the
    API server URL it was last seen at (where its objects are if its kubeconfig Secret was
    edited since), and the places it left (`former_targets`)."""
    ns = gs.namespace or job.namespace
    found = [Target(gs.kubeconfig_secret, ns)]
    found += [Target(None, ns, server=gs.server)] if gs.server else []
    return found + [Target(None, f.namespace, server=f.server) for f in gs.former]


def home(job: DecoupledDiLoCoJob) -> Target:
    return Target(None, job.namespace)


def target_of(job: DecoupledDiLoCoJob, group: LearnerGroup) -> Target:
    if group.cluster is None:
        return home(job)
    return Target(group.cluster.kubeconfig_secret, group.cluster.namespace or job.namespace)


def targets(job: DecoupledDiLoCoJob) -> list[Target]:
    """Every cluster to look at: the spec's, and those of groups removed since the last status."""
    found = [home(job)] + [target_of(job, g) for g in job.spec.learner_groups]
    found += [Target(g.kubeconfig_secret, g.namespace or job.namespace) for g in job.status.groups]
    return list(dict.fromkeys(found + former_targets(job)))


@dataclass(frozen=True)
class PodView:
    """What reconcile needs to know of a learner pod."""

    name: str
    uid: str
    job_uid: str
    group: str
    index: int
    phase: str = "Pending"
    ready: bool = False
    terminating: bool = False
    reason: str | None = None
    message: str | None = None  # the learner container's termination message: its last log lines
    exit_code: int | None = None
    attempt: int = 0  # which incarnation of its slot (builders.LABEL_ATTEMPT)
    shard: tuple[int, int] | None = None  # (data part, count) it trains; None: not labelled
    spare: bool = False  # a hot spare holding no slot (index -1); operator/spares.py
    serial: int | None = None  # born a hot spare: its serial (kept when promoted)
    promoted_at: str | None = None  # when a spare was promoted to its slot (ISO time)
    ready_since: str | None = None  # its Ready condition's lastTransitionTime (ISO time)
    blocked: str | None = None
    """Why a pod that is not running cannot start, as the kubelet or the scheduler says: a
    missing Secret or ConfigMap (CreateContainerConfigError), an image it cannot pull, a
    claim that does not exist (Unschedulable). None: nothing stands in its way."""

    @classmethod
    def from_k8s(cls, pod: Mapping[str, Any]) -> PodView | None:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        labels = meta.get("labels") or {}
        spare = labels.get(builders.LABEL_ROLE) == builders.ROLE_SPARE
        try:
            index = -1 if spare else int(labels[builders.LABEL_SLOT])
            group = labels[builders.LABEL_GROUP]
        except (KeyError, ValueError):
            return None
        conds = {x.get("type"): x for x in status.get("conditions") or []}
        # The apiserver marks pods it evicts or the scheduler preempts with a DisruptionTarget
        # condition (EvictionByEvictionAPI, PreemptionByScheduler, ...); kubelets set
        # status.reason (Evicted, Preempted, OOMKilled ...) on pods they fail.
        disruption = conds.get("DisruptionTarget", {})
        reason = status.get("reason") or (
            disruption.get("reason") if disruption.get("status") == "True" else None
        )
        # Without those, the container's own end says why: OOMKilled, Error (exit code),
        # ContainerCannotRun ...; its message holds the last log lines (FallbackToLogsOnError).
        ended = _terminated(status)
        return cls(
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            job_uid=labels.get(builders.LABEL_JOB_UID, ""),
            group=group,
            index=index,
            phase=status.get("phase") or "Pending",
            ready=conds.get("Ready", {}).get("status") == "True",
            terminating=bool(meta.get("deletionTimestamp")),
            reason=reason or ended.get("reason") or None,
            message=ended.get("message") or status.get("message") or None,
            exit_code=ended.get("exitCode"),
            attempt=_int(labels.get(builders.LABEL_ATTEMPT)) or 0,
            shard=_shard(labels.get(builders.LABEL_DATA_PART)),
            spare=spare,
            serial=_int(labels.get(builders.LABEL_SPARE)),
            promoted_at=(meta.get("annotations") or {}).get(builders.ANNOTATION_PROMOTED_AT),
            ready_since=conds.get("Ready", {}).get("lastTransitionTime"),
            blocked=_blocked(status, conds.get("PodScheduled", {})),
        )


BLOCKING_WAITS: Final = frozenset(
    {
        "CreateContainerConfigError",  # a Secret or ConfigMap (env, envFrom) that is not there
        "CreateContainerError",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "RunContainerError",
    }
)
"""Waiting reasons of a container that will not start until the user changes something."""


def _blocked(status: Mapping[str, Any], scheduled: Mapping[str, Any]) -> str | None:
    """`PodView.blocked`: a container (init containers first) waiting for a reason in
    BLOCKING_WAITS, or the pod unschedulable (a missing claim, no node that fits)."""
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in status.get(key) or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in BLOCKING_WAITS:
                return f"{waiting['reason']}: {waiting.get('message') or cs.get('name', '')}"
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return f"Unschedulable: {scheduled.get('message') or 'no node fits'}"
    return None


def _terminated(status: Mapping[str, Any]) -> dict[str, Any]:
    """The learner container's terminated state (or, restarted, its last one), if it ended
    other than Completed; else {}."""
    for cs in status.get("containerStatuses") or []:
        for key in ("state", "lastState"):
            ended = (cs.get(key) or {}).get("terminated")
            if ended and ended.get("reason") != "Completed":
                return dict(ended)
    return {}


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _shard(label: str | None) -> tuple[int, int] | None:
    shard, _, count = (label or "").partition("-of-")
    a, b = _int(shard), _int(count)
    return (a, b) if a is not None and b is not None else None


@dataclass(frozen=True)
class SecretView:
    """A Secret of the job (labelled with its name) as observed: decoded data, annotations."""

    data: Mapping[str, bytes] = field(default_factory=dict, repr=False)
    job_uid: str = ""
    annotations: Mapping[str, str] = field(default_factory=dict)
    owners: tuple[str, ...] = ()  # uids of its ownerReferences (the job's, for home objects)

    @classmethod
    def from_k8s(cls, secret: Mapping[str, Any]) -> SecretView:
        meta = secret.get("metadata") or {}
        return cls(
            data={k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()},
            job_uid=(meta.get("labels") or {}).get(builders.LABEL_JOB_UID, ""),
            annotations=dict(meta.get("annotations") or {}),
            owners=tuple(r.get("uid", "") for r in meta.get("ownerReferences") or []),
        )


@dataclass(frozen=True)
class ClusterView:
    """One target as observed: the job's pods and Secrets there, or why it can't be seen."""

    pods: tuple[PodView, ...] = ()
    # the job key Secret's content (home only: remote clusters hold learners' credentials)
    token: str | None = None
    problem: tuple[str, str] | None = None  # (condition reason, message): not reachable
    # the job's Secrets there, by name, each read by name (TLS material, the groups' learner
    # credentials, the token with its rotation annotations); observe.py reads them
    secrets: Mapping[str, SecretView] = field(default_factory=dict)
    server: str | None = None  # the API server URL it was observed at (no credentials)


@dataclass(frozen=True)
class Observed:
    now: datetime
    clusters: Mapping[Target, ClusterView]
    statefulset: Mapping[str, Any] | None = None  # the synchronizer StatefulSet as read
    # the synchronizer's pods as read (the job's own, at home): their container statuses
    # say when it crash-loops (status.py's Failed rules, status.components)
    synchronizer_pods: tuple[Mapping[str, Any], ...] = ()
    service: bool = False  # the ClusterIP Service exists
    shards_service: bool = False  # the headless Service exists
    # their spec.ports as read (None: not read); reconcile sets them to what the builder wants
    service_ports: tuple[Mapping[str, Any], ...] | None = None
    shards_service_ports: tuple[Mapping[str, Any], ...] | None = None
    sync_status: Mapping[str, Any] | None = None  # last answer of GET /v1/status, if any
    # cert-manager, observed only when the job's tls.issuer is cert-manager: whether its
    # Certificate CRD is installed, and the job's Certificate as read
    cert_manager: bool = False
    certificate: Mapping[str, Any] | None = None
    # What the apiservers refused when the last pass sent its actions: (Degraded reason,
    # message naming the object and quoting the apiserver), e.g. an exceeded ResourceQuota
    # (FailedCreate) or a name taken by an object the job did not make (NameConflict).
    refused: tuple[tuple[str, str], ...] = ()
    # the evaluator's Deployment as read (spec.evaluation, evaluator_workload.py); None when
    # there is none or the name is someone else's
    evaluator: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Assignment:
    """A slot's identity for a hot spare pod: PUT to the synchronizer's /v1/spares/<pod>,
    where the spare's long poll picks it up (operator/spares.py)."""

    pod: str
    uid: str
    body: Mapping[str, Any]  # learner_id, learner_index, num_learners, group, slot, attempt
    young: bool = True  # promoted less than spares.RESEND_S ago: sent on every pass


@dataclass(frozen=True)
class Action:
    verb: Literal["create", "replace", "delete", "patch"]
    target: Target
    kind: str
    name: str
    body: dict[str, Any] | None = field(default=None, repr=False)  # may hold the token
    uid: str | None = None  # delete only this incarnation
    grace_seconds: int | None = None  # delete: None keeps the pod's own grace period
    then: Assignment | None = None  # patch of a promoted spare: send this once it is done
    event: Event | None = None  # post this once the action is done (never if it was refused)

    def describe(self) -> str:
        return f"{self.verb} {self.kind} {self.target.namespace}/{self.name} in {self.target.label}"


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    status: JobStatus | None = None  # None: leave the status alone
    events: list[Event] = field(default_factory=list)
    # assignments of promoted spares to (re)send to the synchronizer; not actions (they
    # do not make the runtime observe again): act.py sends each until it is delivered
    assignments: list[Assignment] = field(default_factory=list)


def iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def target_of_group(job: DecoupledDiLoCoJob, name: str) -> Target | None:
    return next((target_of(job, g) for g in job.spec.learner_groups if g.name == name), None)


def place(obs: Observed, tgt: Target | None) -> tuple[str, str] | None:
    """(API server URL, namespace) a target was observed at, or None when unknown: two
    targets at one place are one namespace (two kubeconfig Secrets for one cluster, or one
    pointing back home), where neither may clean up what the other holds."""
    view = obs.clusters.get(tgt) if tgt is not None else None
    if tgt is None or view is None or view.problem is not None or view.server is None:
        return None
    return (view.server, tgt.namespace)
