"""Admission by Kueue: a job labelled `kueue.x-k8s.io/queue-name` runs only while Kueue admits it.

    gate = kueue.Gate.of(job, workload, flavors)   # pure: what Kueue's Workload allows
    run = gate.job                                  # the job as admitted (reconcile plans this)

The operator integrates as Kueue's external frameworks do with a prebuilt Workload: it makes
one Workload per job (owned by the job, in its namespace) with one pod set per learner group
(`learners-<group>`, count = replicas, minCount = minReplicas) and one for the synchronizer
(count = shards), each with the resources, node selector and tolerations of its pods. Kueue
admits or preempts that Workload; the operator then plays the part Kueue's job framework plays
for its built-in kinds:

- not admitted (queued, over quota, or evicted): the job runs as if `spec.suspend` were true:
  no learner pods, the synchronizer at zero, its state claim kept. The Suspended condition
  quotes Kueue's reason (e.g. the quota a pod set does not fit).
- admitted: the job runs with the counts Kueue admitted (fewer learners than replicas under
  partial admission, never fewer than minReplicas) and with the node labels and tolerations
  of the ResourceFlavors it was admitted to added to each learner group's own. The
  synchronizer's pod set counts against the quota, but its pods keep their own placement
  (spec.synchronizer.affinity): it has no node selector to add a flavor's labels to.
- evicted (preempted, its queue stopped, ...): the pods are deleted as for a suspend, so each
  learner gets SIGTERM, hands over its fragments and exits 0; once none is left the operator
  gives the quota back (clears the Workload's admission, sets Requeued), and Kueue queues it
  again. Readmitted, the synchronizer starts from its kept state and the learners pull the
  global model: nothing that was accepted is lost.
- finished (the budget merged or every learner done: Complete) or Failed: the Workload is
  marked Finished (reason Succeeded or Failed), which frees its quota.

Why a Workload, not plain pod groups: the learner pods come and go (replacements, hot
spares, groups in other clusters, a synchronizer StatefulSet), and a pod group would need
every pod to exist, gated, before admission and to keep its group annotations through each
replacement; one Workload describes the job's shape once and leaves the operator's pod
handling as it is. Partial admission is Kueue's (its PartialAdmission feature, on by
default): it lowers the counts of pod sets that declare minCount until the Workload fits.
The Workload is made once, from the spec as it was then (Kueue does not let an admitted one
change): a group added later, or replicas raised, get no more than it admitted.

Growing when quota frees uses Kueue's workload slices (its ElasticJobsViaWorkloadSlices
feature gate, alpha and off by default). A job admitted with fewer learners than its
Workload asks for gets a second Workload, a slice (`<workload>-<uid>-<n>`) with the same pod sets
at their full counts and no minCount, annotated `workload-slice-replacement-for` the
admitted one. It waits in the queue; Kueue's scheduler counts only what it asks beyond the
admitted slice, and when that fits it marks the old slice Finished (WorkloadSliceReplaced)
and admits the new one in the same pass. The operator then follows the new slice: the
learner slots rise to its counts. Should the new slice hold quota while the old is not
Finished, the operator finishes the old (OutOfSync), as Kueue's job framework does. The
pending slice is deleted when the admitted one is evicted or done, and an evicted grown
slice gets its minCounts back once its quota is released, so a readmission may again be
partial. Whether the gate is on is asked of Kueue itself: a dry-run update lowering a pod
set's count on the admitted Workload, which Kueue's webhook allows only with the gate on
(rechecked every few minutes). On a plain Kueue no slice is made: an admitted job keeps its
count until it is preempted and readmitted.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from ddiloco.operator import builders, compute
from ddiloco.operator import conditions as c
from ddiloco.operator.api import (
    Condition,
    DecoupledDiLoCoJob,
    JobSpec,
    JobStatus,
    LearnerGroup,
    Toleration,
)

GROUP: Final = "kueue.x-k8s.io"
VERSION: Final = "v1beta2"
API_VERSION: Final = f"{GROUP}/{VERSION}"
WORKLOADS: Final = "workloads"
FLAVORS: Final = "resourceflavors"
PRIORITY_CLASSES: Final = "workloadpriorityclasses"
QUEUE_LABEL: Final = f"{GROUP}/queue-name"
PRIORITY_LABEL: Final = f"{GROUP}/priority-class"
SYNC_POD_SET: Final = "synchronizer"

# Workload condition types (Kueue's API)
QUOTA_RESERVED: Final = "QuotaReserved"
ADMITTED: Final = "Admitted"
EVICTED: Final = "Evicted"
REQUEUED: Final = "Requeued"
FINISHED: Final = "Finished"

# Workload slices (Kueue's ElasticJobsViaWorkloadSlices)
ELASTIC_ANNOTATION: Final = f"{GROUP}/elastic-job"
REPLACEMENT_FOR: Final = f"{GROUP}/workload-slice-replacement-for"
SLICE_NAME: Final = f"{GROUP}/workload-slice-name"
OUT_OF_SYNC: Final = "OutOfSync"  # Finished reason of a slice its replacement outran
SLICE_REPLACED: Final = "WorkloadSliceReplaced"  # Finished reason Kueue's scheduler writes
ELASTIC_PROBE_TTL_S: Final = 300.0
HANDOVER_S: Final = 30.0  # a replaced slice's admission holds this long for its successor

# Suspended reasons
QUEUED: Final = "Queued"  # waiting for Kueue to admit the Workload
ADMITTED_REASON: Final = "Admitted"
NO_KUEUE: Final = "KueueNotInstalled"


def queue_name(job: DecoupledDiLoCoJob) -> str | None:
    """The LocalQueue a job asks for (its queue-name label), or None: not queued."""
    labels = job.metadata.get("labels") or {}
    return labels.get(QUEUE_LABEL) or None


def priority_class(job: DecoupledDiLoCoJob) -> str | None:
    """The WorkloadPriorityClass a job names (its priority-class label), if any."""
    labels = job.metadata.get("labels") or {}
    return labels.get(PRIORITY_LABEL) or None


def workload_name(job: DecoupledDiLoCoJob) -> str:
    return f"ddiloco-{job.name}"


def pod_set_name(group: str) -> str:
    return f"learners-{group}"


def _template(
    image: str,
    container: str,
    resources: Mapping[str, Any],
    node_selector: Mapping[str, str],
    tolerations: Iterable[Mapping[str, Any]],
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": container, "image": image, "resources": dict(resources)}],
        "restartPolicy": "Never",
    }
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tols := list(tolerations):
        spec["tolerations"] = [dict(t) for t in tols]
    return {"spec": spec}


def _learner_template(job: DecoupledDiLoCoJob, group: LearnerGroup) -> dict[str, Any]:
    pod: dict[str, Any] = {"containers": [{"name": "learner", "image": job.spec.image}]}
    compute.apply(group, pod)  # the resources and the GPU toleration the real pods get
    return _template(
        job.spec.image,
        "learner",
        pod["containers"][0]["resources"],
        group.node_selector,
        [*(t.to_k8s() for t in group.tolerations), *pod.get("tolerations", [])],
    )


def build_workload(job: DecoupledDiLoCoJob, priority: int | None = None) -> dict[str, Any]:
    """The Workload that asks Kueue for the job's pods: one pod set per learner group with
    slots, and the synchronizer's shards."""
    queue = queue_name(job)
    assert queue is not None, "only a queued job has a Workload"
    sync = job.spec.synchronizer
    pod_sets: list[dict[str, Any]] = [
        {
            "name": SYNC_POD_SET,
            "count": sync.shards,
            "template": _template(
                job.spec.image,
                "synchronizer",
                sync.resources.to_k8s(),
                {},
                (),
            ),
        }
    ]
    for group in job.spec.learner_groups:
        if group.replicas == 0:
            continue
        ps: dict[str, Any] = {
            "name": pod_set_name(group.name),
            "count": group.replicas,
            "template": _learner_template(job, group),
        }
        if group.min_replicas is not None and group.min_replicas < group.replicas:
            ps["minCount"] = group.min_replicas
        pod_sets.append(ps)
    spec: dict[str, Any] = {"queueName": queue, "podSets": pod_sets}
    if (pc := priority_class(job)) is not None and priority is not None:
        spec["priorityClassRef"] = {"group": GROUP, "kind": "WorkloadPriorityClass", "name": pc}
        spec["priority"] = priority
    labels = {**builders.labels(job, "workload"), QUEUE_LABEL: queue}
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job),
            "namespace": job.namespace,
            "labels": labels,
            "ownerReferences": [builders.owner_reference(job)],
        },
        "spec": spec,
    }


def _cond(obj: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


def _true(obj: Mapping[str, Any] | None, type_: str) -> bool:
    cond = _cond(obj, type_)
    return cond is not None and cond.get("status") == "True"


@dataclass(frozen=True)
class Gate:
    """What Kueue's Workload allows a queued job, and the job as it may run now.

    `job` is the job with `spec.suspend` set while it is not admitted, each learner group's
    replicas at its admitted count, and the flavors' node labels and tolerations added to the
    pod sets'; `reason`/`message` say why it is suspended or how it was admitted.
    """

    job: DecoupledDiLoCoJob
    admitted: bool
    evicted: bool
    reason: str
    message: str
    counts: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        job: DecoupledDiLoCoJob,
        workload: Mapping[str, Any] | None,
        flavors: Mapping[str, Mapping[str, Any]],
    ) -> Gate:
        """Pure: the gate for a job given its Workload as read (None: not made yet) and the
        ResourceFlavors it was admitted to, by name."""
        queue = queue_name(job)
        suspended = job.spec.model_copy(update={"suspend": True})
        evicted = _true(workload, EVICTED)
        admission = ((workload or {}).get("status") or {}).get("admission")
        if workload is None or evicted or not _true(workload, ADMITTED) or not admission:
            if evicted:
                ev = _cond(workload, EVICTED) or {}
                reason = str(ev.get("reason") or EVICTED)
                message = f"Evicted by Kueue ({reason}): {ev.get('message', '')}".rstrip(": ")
            else:
                reason = QUEUED
                qr = _cond(workload, QUOTA_RESERVED)
                why = (qr or {}).get("message") or "waiting for Kueue to reserve quota"
                message = f"Waiting in LocalQueue {queue} to be admitted: {why}"
            return cls(
                job=job.model_copy(update={"spec": suspended}),
                admitted=False,
                evicted=evicted,
                reason=reason,
                message=message,
            )
        by_set = {a.get("name"): a for a in admission.get("podSetAssignments") or []}
        groups = []
        counts: dict[str, int] = {}
        for group in job.spec.learner_groups:
            a = by_set.get(pod_set_name(group.name))
            if a is None:  # no pod set: no slots then, or added since; nothing admitted
                groups.append(group.model_copy(update={"replicas": 0}))
                continue
            count = int(a.get("count", group.replicas))
            counts[group.name] = count
            selector, tolerations = _flavor_scheduling(a, flavors)
            groups.append(
                group.model_copy(
                    update={
                        "replicas": min(count, group.replicas),
                        "node_selector": {**group.node_selector, **selector},
                        "tolerations": [*group.tolerations, *tolerations],
                    }
                )
            )
        spec: JobSpec = job.spec.model_copy(update={"learner_groups": groups})
        cq = admission.get("clusterQueue", "?")
        shown = ", ".join(
            f"{g.name} {counts[g.name]} of {g.replicas}"
            for g in job.spec.learner_groups
            if g.name in counts
        )
        return cls(
            job=job.model_copy(update={"spec": spec}),
            admitted=True,
            evicted=False,
            reason=ADMITTED_REASON,
            message=f"Admitted by ClusterQueue {cq} (learners: {shown or 'none'})",
            counts=counts,
        )


def _flavor_scheduling(
    assignment: Mapping[str, Any], flavors: Mapping[str, Mapping[str, Any]]
) -> tuple[dict[str, str], list[Toleration]]:
    """The node labels and tolerations of the flavors a pod set was admitted to."""
    selector: dict[str, str] = {}
    tolerations: list[Toleration] = []
    for name in sorted(set((assignment.get("flavors") or {}).values())):
        spec = (flavors.get(name) or {}).get("spec") or {}
        selector.update(spec.get("nodeLabels") or {})
        for t in spec.get("tolerations") or []:
            tol = Toleration.model_validate(t)
            if tol not in tolerations:
                tolerations.append(tol)
    return selector, tolerations


def flavor_names(workload: Mapping[str, Any] | None) -> set[str]:
    admission = ((workload or {}).get("status") or {}).get("admission") or {}
    return {
        str(f)
        for a in admission.get("podSetAssignments") or []
        for f in (a.get("flavors") or {}).values()
    }


def workload_key(wl: Mapping[str, Any]) -> str:
    """A Workload's `<namespace>/<name>`, as Kueue's slice annotations name one."""
    meta = wl.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


def _reserved(wl: Mapping[str, Any] | None) -> bool:
    return _true(wl, QUOTA_RESERVED) and bool(((wl or {}).get("status") or {}).get("admission"))


@dataclass(frozen=True)
class Slices:
    """A job's Workloads as slices: `current` is the one the job follows (admitted or
    queued; the newest, Finished, once the job is done), `growth` a larger slice waiting in
    the queue to replace it, `stale` an old slice whose replacement already holds quota but
    that Kueue has not marked Finished."""

    current: Mapping[str, Any] | None = None
    growth: Mapping[str, Any] | None = None
    stale: Mapping[str, Any] | None = None

    @classmethod
    def of(
        cls, uid: str, workloads: Iterable[Mapping[str, Any]], now: datetime | None = None
    ) -> Slices:
        """Pure: the slices among the Workloads read (only those the job `uid` owns count).
        A slice Kueue finished as replaced stays the job's for HANDOVER_S after `now` while
        its successor is not yet admitted; after that (Kueue could not admit it) the job
        waits for the successor like any queued job."""
        owned = [
            w
            for w in workloads
            if any(
                o.get("uid") == uid for o in (w.get("metadata") or {}).get("ownerReferences") or []
            )
        ]
        owned.sort(key=lambda w: str((w.get("metadata") or {}).get("creationTimestamp") or ""))
        live = [w for w in owned if not _true(w, FINISHED)]
        if len(live) >= 2 and _replaces(live[0], live[-1]):  # made within the same second
            live[0], live[-1] = live[-1], live[0]
        if not live:
            return cls(current=owned[-1] if owned else None)
        old, new = live[0], live[-1]
        if len(live) == 1:
            prior = [w for w in owned if _replaces(old, w)]
            if prior and not _reserved(old):
                before = prior[-1]
                if not _replaced(before):  # the job ended with a larger slice waiting
                    return cls(current=before, growth=old)
                if now is not None and _finished_since(before, now) < HANDOVER_S:
                    # Kueue finishes the replaced slice, then admits its successor: in
                    # between, the job keeps the admission it has
                    return cls(current=before, growth=old)
            return cls(current=old)
        if _reserved(new):
            return cls(current=new, stale=old)
        return cls(current=old, growth=new)


def _replaces(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    annotations = (new.get("metadata") or {}).get("annotations") or {}
    return annotations.get(REPLACEMENT_FOR) == workload_key(old)


def _replaced(wl: Mapping[str, Any]) -> bool:
    """Finished because a larger slice took its place (not because the job ended)."""
    fin = _cond(wl, FINISHED) or {}
    return fin.get("status") == "True" and fin.get("reason") in (SLICE_REPLACED, OUT_OF_SYNC)


def _finished_since(wl: Mapping[str, Any], now: datetime) -> float:
    """Seconds since the slice's Finished condition turned True (unreadable: forever)."""
    at = (_cond(wl, FINISHED) or {}).get("lastTransitionTime")
    try:
        then = datetime.strptime(str(at), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return float("inf")
    return (now - then).total_seconds()


def short_sets(wl: Mapping[str, Any] | None) -> dict[str, tuple[int, int]]:
    """The learner pod sets an admitted, running Workload got fewer pods for than it asks:
    name -> (admitted count, asked count). Empty when it is not admitted, evicted or done."""
    if wl is None or not _reserved(wl) or _true(wl, EVICTED) or _true(wl, FINISHED):
        return {}
    asked = {
        str(ps.get("name")): int(ps.get("count", 0))
        for ps in (wl.get("spec") or {}).get("podSets") or []
        if str(ps.get("name", "")).startswith("learners-")
    }
    out: dict[str, tuple[int, int]] = {}
    for a in (wl.get("status") or {}).get("admission", {}).get("podSetAssignments") or []:
        name = str(a.get("name"))
        if name in asked and int(a.get("count", asked[name])) < asked[name]:
            out[name] = (int(a.get("count", 0)), asked[name])
    return out


def slice_name(job: DecoupledDiLoCoJob, after: str) -> str:
    """The name of the slice that follows `after`: `<workload>-<uid>-2`, `-3`, ... (the
    job's uid keeps it apart from another job's Workload: a job named `<name>-2` has
    `<workload>-2`)."""
    prefix = f"{workload_name(job)}-{job.uid[:8]}-"
    n = (
        int(after[len(prefix) :])
        if after.startswith(prefix) and after[len(prefix) :].isdigit()
        else 1
    )
    return f"{prefix}{n + 1}"


def build_growth(job: DecoupledDiLoCoJob, current: Mapping[str, Any]) -> dict[str, Any]:
    """The slice that asks Kueue for the full counts of an admitted Workload: its pod sets
    without minCount (a smaller admission would only replace it with its like), annotated
    as Kueue's job framework annotates a scaled-up slice."""
    meta = current.get("metadata") or {}
    spec = dict(current.get("spec") or {})
    spec["podSets"] = [
        {k: v for k, v in ps.items() if k != "minCount"} for ps in spec.get("podSets") or []
    ]
    origin = (meta.get("annotations") or {}).get(SLICE_NAME) or meta.get("name")
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": slice_name(job, str(meta.get("name"))),
            "namespace": meta.get("namespace"),
            "labels": dict(meta.get("labels") or {}),
            "annotations": {
                ELASTIC_ANNOTATION: "true",
                REPLACEMENT_FOR: workload_key(current),
                SLICE_NAME: origin,
            },
            "ownerReferences": [dict(o) for o in meta.get("ownerReferences") or []],
        },
        "spec": spec,
    }


def probe_pod_sets(wl: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The pod sets of an admitted, short Workload with one short set's count lowered by
    one (still at least what was admitted): what Kueue's webhook accepts as an update only
    with workload slices on. None when no set is short."""
    short = short_sets(wl)
    if not short:
        return None
    name = sorted(short)[0]
    return [
        {**ps, "count": int(ps["count"]) - 1} if ps.get("name") == name else dict(ps)
        for ps in (wl.get("spec") or {}).get("podSets") or []
    ]


def restored_pod_sets(
    job: DecoupledDiLoCoJob, wl: Mapping[str, Any]
) -> list[dict[str, Any]] | None:
    """A grown slice's pod sets with the minCount of each learner group put back (for its
    next admission after an eviction); None when nothing is to put back."""
    mins = {
        pod_set_name(g.name): g.min_replicas
        for g in job.spec.learner_groups
        if g.min_replicas is not None
    }
    changed, out = False, []
    for ps in (wl.get("spec") or {}).get("podSets") or []:
        ps = dict(ps)
        m = mins.get(str(ps.get("name")))
        if m is not None and m < int(ps.get("count", 0)) and ps.get("minCount") != m:
            ps["minCount"] = m
            changed = True
        out.append(ps)
    return out if changed else None


def _set_condition(
    conds: list[dict[str, Any]], type_: str, status: bool, reason: str, message: str, now: str
) -> list[dict[str, Any]]:
    value = "True" if status else "False"
    out, found = [], False
    for cond in conds:
        if cond.get("type") == type_:
            found = True
            since = cond.get("lastTransitionTime") if cond.get("status") == value else now
            cond = {**cond, "status": value, "reason": reason, "message": message}
            cond["lastTransitionTime"] = since
        out.append(cond)
    if not found:
        out.append(
            {
                "type": type_,
                "status": value,
                "reason": reason,
                "message": message,
                "lastTransitionTime": now,
            }
        )
    return out


def release_status(workload: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The Workload status that gives an evicted job's quota back once its pods are gone, as
    Kueue's job framework does: no admission, QuotaReserved and Admitted False, Requeued
    True (so Kueue queues it again)."""
    ev = _cond(workload, EVICTED) or {}
    reason, message = str(ev.get("reason") or EVICTED), str(ev.get("message") or "")
    gen = (workload.get("metadata") or {}).get("generation")
    conds = [dict(x) for x in (workload.get("status") or {}).get("conditions") or []]
    conds = _set_condition(conds, QUOTA_RESERVED, False, "Pending", message, now)
    conds = _set_condition(
        conds, ADMITTED, False, "NoReservation", "The workload has no reservation", now
    )
    conds = _set_condition(conds, REQUEUED, True, reason, message, now)
    for cond in conds:
        cond["observedGeneration"] = gen
    return {"admission": None, "conditions": conds}


def finish_status(
    workload: Mapping[str, Any], message: str, now: str, reason: str = "Succeeded"
) -> dict[str, Any]:
    """The Workload status that frees the quota of a job that is done (reason Succeeded) or
    has Failed (reason Failed), as Kueue's job framework writes it."""
    gen = (workload.get("metadata") or {}).get("generation")
    conds = [dict(x) for x in (workload.get("status") or {}).get("conditions") or []]
    conds = _set_condition(conds, FINISHED, True, reason, message, now)
    for cond in conds:
        cond.setdefault("observedGeneration", gen)
    return {"conditions": conds}


def finished_as(status: JobStatus) -> tuple[str, str] | None:
    """(Kueue's Finished reason, message) for a job that is done (Succeeded) or has Failed
    (Failed, quoting the job's Failed condition); None while it runs on."""
    if status.phase == "Succeeded":
        return "Succeeded", "The job is done"
    if status.phase == "Failed":
        failed = c.get(status.conditions, c.FAILED)
        return "Failed", failed.message if failed is not None else "The job failed"
    return None


def stopped(
    job: DecoupledDiLoCoJob, pods: Iterable[Any], statefulset: Mapping[str, Any] | None
) -> bool:
    """No pod of the job is left: no learner or spare pod, no synchronizer replica."""
    if any(p.job_uid == job.uid for p in pods):
        return False
    sts = (statefulset or {}).get("status") or {}
    return not int(sts.get("replicas") or 0)


def suspended_condition(gate: Gate, job: DecoupledDiLoCoJob) -> Condition:
    """The job's Suspended condition under Kueue: True with Kueue's reason while not
    admitted; False once admitted (saying how many learners it got)."""
    if job.spec.suspend:
        return c.make(
            c.SUSPENDED_TYPE, True, c.JOB_SUSPENDED, "The job is suspended (spec.suspend)"
        )
    if not gate.admitted:
        return c.make(c.SUSPENDED_TYPE, True, gate.reason, gate.message)
    return c.make(c.SUSPENDED_TYPE, False, gate.reason, gate.message)


class Queue:
    """The operator's side of Kueue for queued jobs, on the home cluster: reads and makes each
    job's Workload, reads the flavors it was admitted to, gives the quota back after an
    eviction and when the job is done, and says so in the job's events and status."""

    def __init__(self, home: Any, timeout: Any) -> None:
        self.home = home
        self.timeout = timeout
        self._workloads: dict[str, dict[str, Any]] = {}  # job uid -> its Workload as last read
        self._grown: set[str] = set()  # job uids whose larger slice was just admitted
        self._probed: tuple[float, bool] | None = None  # (when, workload slices on?)

    def _api(self) -> Any:
        import kubernetes

        return kubernetes.client.CustomObjectsApi(self.home)

    def gate(self, job: DecoupledDiLoCoJob) -> Gate | None:
        """The job's gate (its Workload made first if missing); None for a job with no queue.
        Also keeps the job's slices in order: finishes a replaced one Kueue left unfinished,
        asks for a larger slice while the job runs short (workload slices on), and deletes
        a waiting one the job can no longer grow into."""
        from kubernetes.client.exceptions import ApiException

        from ddiloco.operator.apply import get_or_none
        from ddiloco.operator.builders import LABEL_JOB_UID

        if queue_name(job) is None:
            return None
        api, ns = self._api(), job.namespace
        try:
            listed = api.list_namespaced_custom_object(
                GROUP, VERSION, ns, WORKLOADS, label_selector=f"{LABEL_JOB_UID}={job.uid}",
                _request_timeout=self.timeout,
            )  # fmt: skip
        except ApiException as e:
            if e.status == 404:  # no Workload API: Kueue is not installed here
                return self._no_kueue(job)
            raise
        slices = Slices.of(job.uid, listed.get("items") or [], datetime.now(UTC))
        if slices.stale is not None:
            self._patch_status(
                slices.stale,
                finish_status(
                    slices.stale,
                    "The workload slice is out of sync with its parent job",
                    _now(),
                    reason=OUT_OF_SYNC,
                ),
            )
        wl = slices.current
        if wl is None:
            priority = None
            if (pc := priority_class(job)) is not None:
                wpc = get_or_none(
                    lambda: api.get_cluster_custom_object(
                        GROUP, VERSION, PRIORITY_CLASSES, pc, _request_timeout=self.timeout
                    )
                )
                priority = int(wpc["value"]) if wpc else None
            try:
                wl = api.create_namespaced_custom_object(
                    GROUP, VERSION, ns, WORKLOADS, build_workload(job, priority),
                    _request_timeout=self.timeout,
                )  # fmt: skip
            except ApiException as e:
                if e.status == 404:
                    return self._no_kueue(job)
                if e.status != 409:
                    raise
                wl = None  # made meanwhile, or a former job's of the same name on its way out
        growth = slices.growth
        if wl is not None:
            if growth is not None and not short_sets(wl) and not _replaced(wl):
                self._delete(growth)  # evicted, done, or no longer short: nothing to grow into
                growth = None
            elif growth is None and short_sets(wl) and self._elastic(wl):
                try:
                    growth = api.create_namespaced_custom_object(
                        GROUP, VERSION, ns, WORKLOADS, build_growth(job, wl),
                        _request_timeout=self.timeout,
                    )  # fmt: skip
                except ApiException as e:
                    if e.status not in (400, 403, 409, 422):
                        raise
                    growth = None  # made meanwhile, or refused: the job runs as admitted
        flavors: dict[str, Mapping[str, Any]] = {}
        for f in flavor_names(wl):
            got = get_or_none(
                lambda f=f: api.get_cluster_custom_object(
                    GROUP, VERSION, FLAVORS, f, _request_timeout=self.timeout
                )
            )
            if got is not None:
                flavors[f] = got
        if wl is not None:
            before = self._workloads.get(job.uid)
            if before is not None and _replaces(wl, before) and _reserved(wl):
                self._grown.add(job.uid)
            self._workloads[job.uid] = dict(wl)
        gate = Gate.of(job, wl, flavors)
        if gate.admitted and growth is not None:
            name = (growth.get("metadata") or {}).get("name")
            gate = dataclasses.replace(
                gate, message=f"{gate.message}; Workload {name} asks Kueue for the rest"
            )
        return gate

    def _no_kueue(self, job: DecoupledDiLoCoJob) -> Gate:
        return Gate(
            job=job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})}),
            admitted=False,
            evicted=False,
            reason=NO_KUEUE,
            message=f"The job names LocalQueue {queue_name(job)}, but this cluster "
            f"does not serve Kueue's Workload API ({API_VERSION})",
        )

    def _elastic(self, wl: Mapping[str, Any]) -> bool:
        """Whether this Kueue runs with workload slices (ElasticJobsViaWorkloadSlices): asked
        by a dry-run update that lowers a short pod set's count on the admitted Workload,
        which Kueue's webhook refuses (the pod sets of an admitted Workload are immutable)
        unless the gate is on. Nothing is changed; the answer is kept a few minutes."""
        from kubernetes.client.exceptions import ApiException

        now = time.monotonic()
        if self._probed is not None and now - self._probed[0] < ELASTIC_PROBE_TTL_S:
            return self._probed[1]
        pod_sets = probe_pod_sets(wl)
        if pod_sets is None:
            return False
        meta = wl["metadata"]
        try:
            self._api().patch_namespaced_custom_object(
                GROUP, VERSION, meta["namespace"], WORKLOADS, meta["name"],
                {"metadata": {"resourceVersion": meta["resourceVersion"]},
                 "spec": {"podSets": pod_sets}},
                dry_run="All", _request_timeout=self.timeout,
            )  # fmt: skip
            answer = True
        except ApiException as e:
            if e.status in (404, 409):
                return False  # changed or gone meanwhile: ask again on the next pass
            if e.status not in (400, 403, 422):
                raise
            answer = False  # refused: a plain Kueue
        self._probed = (now, answer)
        return answer

    def _delete(self, wl: Mapping[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        meta = wl["metadata"]
        try:
            self._api().delete_namespaced_custom_object(
                GROUP, VERSION, meta["namespace"], WORKLOADS, meta["name"],
                _request_timeout=self.timeout,
            )  # fmt: skip
        except ApiException as e:
            if e.status not in (403, 404, 409):
                raise

    def settle(
        self,
        job: DecoupledDiLoCoJob,
        gate: Gate,
        status: Any,
        pods: Iterable[Any],
        statefulset: Mapping[str, Any] | None,
        now: str,
        post: Any,
    ) -> Any:
        """After a pass over the gated job: give the quota back (evicted and no pod left, or
        done), post the admission events, and put Kueue's word into the Suspended condition.
        Returns the status to write (or None)."""
        from ddiloco.operator.plan import Event

        wl = self._workloads.get(job.uid)
        if wl is not None:
            admission = (wl.get("status") or {}).get("admission")
            if gate.evicted and admission and stopped(job, pods, statefulset):
                if self._patch_status(wl, release_status(wl, now)):
                    post(Event("Normal", "QuotaReleased", "Every pod is gone: the quota "
                               "goes back to Kueue, which queues the job again"))  # fmt: skip
                    if (pod_sets := restored_pod_sets(job, wl)) is not None:
                        self._patch_spec(wl, pod_sets)  # a grown slice: partial again
            elif (
                admission
                and not _true(wl, FINISHED)
                and (end := finished_as(status if status is not None else job.status))
            ):  # (the status as written, or as it stands after a pass that changed nothing)
                self._patch_status(wl, finish_status(wl, end[1], now, reason=end[0]))
        before = c.get(job.status.conditions, c.SUSPENDED_TYPE)
        was_evicted = (
            before is not None
            and before.status == "True"
            and before.reason not in (QUEUED, NO_KUEUE, c.JOB_SUSPENDED)
        )
        if gate.admitted and job.uid in self._grown:
            self._grown.discard(job.uid)
            post(Event("Normal", "Grown", f"Kueue admitted a larger slice: {gate.message}"))
        if gate.admitted and (before is None or before.status == "True"):
            post(Event("Normal", "Admitted", gate.message))
            if was_evicted:
                post(Event("Normal", "Resumed", "Readmitted by Kueue: the synchronizer starts "
                           "from its kept state and the learners from the global model"))  # fmt: skip
        elif not gate.admitted and (
            before is None
            or before.status != "True"
            or (gate.evicted and before.reason != gate.reason)
        ):
            post(Event("Normal", "Suspended", gate.message))
        if status is None:
            return None
        cond = suspended_condition(gate, job)
        rest = [x for x in status.conditions if x.type != c.SUSPENDED_TYPE]
        return status.model_copy(
            update={
                "conditions": c.merge(job.status.conditions, [*rest, cond], now, job.generation)
            }
        )

    def _patch_status(self, wl: Mapping[str, Any], status: dict[str, Any]) -> bool:
        from kubernetes.client.exceptions import ApiException

        meta = wl["metadata"]
        body = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": status}
        try:
            self._patch(meta, body)
        except ApiException as e:
            if e.status not in (404, 409):
                raise
            return False  # changed or gone meanwhile: the next pass reads it again
        return True

    def _patch_spec(self, wl: Mapping[str, Any], pod_sets: list[dict[str, Any]]) -> None:
        """Put a released slice's pod sets back (no quota is held: Kueue lets them change);
        a conflict leaves them as they are."""
        from kubernetes.client.exceptions import ApiException

        meta = wl["metadata"]
        try:
            self._api().patch_namespaced_custom_object(
                GROUP, VERSION, meta["namespace"], WORKLOADS, meta["name"],
                {"spec": {"podSets": pod_sets}}, _request_timeout=self.timeout,
            )  # fmt: skip
        except ApiException as e:
            if e.status not in (400, 403, 404, 409, 422):
                raise

    def _patch(self, meta: Mapping[str, Any], body: dict[str, Any]) -> None:
        self._api().patch_namespaced_custom_object_status(
            GROUP, VERSION, meta["namespace"], WORKLOADS, meta["name"], body,
            _request_timeout=self.timeout,
        )  # fmt: skip

    def forget(self, uid: str) -> None:
        self._workloads.pop(uid, None)
        self._grown.discard(uid)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
