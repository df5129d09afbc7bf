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
An admitted job does not grow when quota frees; it gets its full count when admitted again.
The Workload is made once, from the spec as it was then (Kueue does not let an admitted one
change): a group added later, or replicas raised, get no more than it admitted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
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

    def _api(self) -> Any:
        import kubernetes

        return kubernetes.client.CustomObjectsApi(self.home)

    def gate(self, job: DecoupledDiLoCoJob) -> Gate | None:
        """The job's gate (its Workload made first if missing); None for a job with no queue."""
        from kubernetes.client.exceptions import ApiException

        from ddiloco.operator.apply import get_or_none

        if queue_name(job) is None:
            return None
        api, ns, name = self._api(), job.namespace, workload_name(job)
        read = lambda: get_or_none(  # noqa: E731
            lambda: api.get_namespaced_custom_object(
                GROUP, VERSION, ns, WORKLOADS, name, _request_timeout=self.timeout
            )
        )
        wl = read()
        if wl is not None and not any(
            o.get("uid") == job.uid for o in wl["metadata"].get("ownerReferences") or []
        ):
            wl = None  # a former job's of the same name, on its way out: wait for it to go
        elif wl is None:
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
                if e.status == 404:  # no Workload API: Kueue is not installed here
                    return Gate(
                        job=job.model_copy(
                            update={"spec": job.spec.model_copy(update={"suspend": True})}
                        ),
                        admitted=False,
                        evicted=False,
                        reason=NO_KUEUE,
                        message=f"The job names LocalQueue {queue_name(job)}, but this cluster "
                        f"does not serve Kueue's Workload API ({API_VERSION})",
                    )
                if e.status != 409:
                    raise
                wl = None  # made meanwhile: read on the next pass
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
            self._workloads[job.uid] = dict(wl)
        return Gate.of(job, wl, flavors)

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

    def _patch(self, meta: Mapping[str, Any], body: dict[str, Any]) -> None:
        self._api().patch_namespaced_custom_object_status(
            GROUP, VERSION, meta["namespace"], WORKLOADS, meta["name"], body,
            _request_timeout=self.timeout,
        )  # fmt: skip

    def forget(self, uid: str) -> None:
        self._workloads.pop(uid, None)
