"""Reconcile, purely: (job, what the clusters hold) -> (actions, status, events).

    plan = reconcile(job, observed, fresh_token="...")
    for action in plan.actions: ...          # runtime.py sends them; tests just read them

No I/O and no clock: `Observed` carries the time, and every decision is a function of the
job's spec, its last status and the observation, so the unit tests can replay any situation.
The flow is cert-manager's readiness controller: gather, evaluate into conditions, compare.

Learner slots. Each slot (`<group>-<index>`) has one pod with a fixed name, so the apiserver
itself forbids two pods per slot, also across an operator restart. A pod that fails (phase
Failed, e.g. Evicted or Preempted), starts terminating (e.g. the eviction API), or vanishes is
a *failure*: the slot records the dead pod's uid in `failedUid`, that status is written before
anything is deleted or created, and the replacement is created once the old pod is gone and
the backoff has passed. A replacement is *counted* when a pod with a new uid is observed in a
slot with a pending failure, so a crash between any two steps neither loses nor doubles a
count. Past `failurePolicy.maxReplacementsPerSlot` the slot stays empty and the job Degraded.
Spec changes reach new pods only (replacements and new slots), like a StatefulSet's OnDelete.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from ddiloco.operator import builders
from ddiloco.operator import conditions as c
from ddiloco.operator.api import (
    DecoupledDiLoCoJob,
    GroupStatus,
    LearnerGroup,
    SlotStatus,
    validate,
)
from ddiloco.operator.plan import (
    Action,
    ClusterView,
    Event,
    Observed,
    Plan,
    PodView,
    Target,
    home,
    iso,
    target_of,
    target_of_group,
)
from ddiloco.operator.status import summarize


def backoff(job: DecoupledDiLoCoJob, replacements: int) -> timedelta:
    policy = job.spec.failure_policy
    delay = policy.backoff_seconds * 2 ** min(replacements, 30)
    return timedelta(seconds=min(delay, policy.max_backoff_seconds))


def reconcile(job: DecoupledDiLoCoJob, obs: Observed, fresh_token: str) -> Plan:
    """The actions that move the clusters toward the spec, and the status that says where they are."""
    if not job.is_ours():
        return Plan()
    now, gen = iso(obs.now), job.generation
    problems = validate(job.spec)
    if problems:
        status = job.status.model_copy(
            update={
                "phase": "Invalid",
                "observed_generation": gen,
                "conditions": c.merge(
                    job.status.conditions,
                    [c.make(c.READY, False, c.INVALID_SPEC, "; ".join(problems))],
                    now,
                    gen,
                ),
            }
        )
        return Plan(status=status)

    plan = Plan()
    home_view = obs.clusters.get(home(job), ClusterView())
    token = home_view.token or fresh_token
    if home_view.token is None and home_view.problem is None:
        plan.actions.append(
            Action(
                "create",
                home(job),
                "Secret",
                builders.token_secret_name(job),
                builders.build_token_secret(job, token),
            )
        )
    _synchronizer(job, obs, plan)

    slots = {s.id: s for s in job.status.slots}
    old_groups = {g.name: g for g in job.status.groups}
    new_slots: list[SlotStatus] = []
    groups: list[GroupStatus] = []
    degraded: list[tuple[str, str]] = []
    not_ready: list[str] = []
    done = 0
    copied: set[Target] = set()
    for group in job.spec.learner_groups:
        tgt = target_of(job, group)
        view = obs.clusters.get(tgt, ClusterView(problem=(c.CLUSTER_UNREACHABLE, "not observed")))
        old = old_groups.get(group.name)
        gstat = GroupStatus(
            name=group.name,
            cluster=tgt.label,
            kubeconfig_secret=tgt.secret,
            namespace=tgt.namespace,
            desired=group.replicas,
            replaced=old.replaced if old else 0,
        )
        ids = [builders.learner_id(group.name, i) for i in range(group.replicas)]
        if view.problem is not None:  # keep the books as they were; act nowhere there
            reason, msg = view.problem
            degraded.append(
                (reason, f"Could not reach the cluster of learner group {group.name}: {msg}")
            )
            new_slots += [slots.get(i) or SlotStatus(id=i) for i in ids]
            not_ready += ids
            groups.append(gstat.model_copy(update={"ready": old.ready if old else 0}))
            continue
        if tgt.secret is not None and view.token != token and tgt not in copied:
            copied.add(tgt)
            verb = "create" if view.token is None else "replace"
            plan.actions.append(
                Action(
                    verb,
                    tgt,
                    "Secret",
                    builders.token_secret_name(job),
                    builders.build_token_secret(job, token, tgt.namespace, owned=False),
                )
            )
        pods = {(p.group, p.index): p for p in view.pods if p.job_uid == job.uid}
        ready = replaced = 0
        for index, sid in enumerate(ids):
            rec, pod = slots.get(sid) or SlotStatus(id=sid), pods.get((group.name, index))
            rec, counted = _slot(job, group, index, tgt, rec, pod, obs.now, plan)
            replaced += counted
            new_slots.append(rec)
            if pod is not None and pod.phase == "Succeeded":
                done += 1
            elif pod is not None and pod.ready and not pod.terminating and pod.phase == "Running":
                ready += 1
            else:
                not_ready.append(sid)
            if (
                rec.failed_uid
                and rec.replacements >= job.spec.failure_policy.max_replacements_per_slot
                and not job.spec.suspend
            ):
                degraded.append(
                    (
                        c.REPLACEMENT_LIMIT_REACHED,
                        (
                            f"Learner slot {sid} was replaced {rec.replacements} times, the failurePolicy "
                            f"limit; its last pod ended with {rec.last_failure_reason}"
                        ),
                    )
                )
        groups.append(
            gstat.model_copy(update={"ready": ready, "replaced": gstat.replaced + replaced})
        )
    _prune(job, obs, plan, groups)

    status = summarize(job, obs, groups, new_slots, degraded, not_ready, done)
    if status != job.status:
        plan.status = status
    return plan


def _slot(
    job: DecoupledDiLoCoJob,
    group: LearnerGroup,
    index: int,
    tgt: Target,
    rec: SlotStatus,
    pod: PodView | None,
    now: datetime,
    plan: Plan,
) -> tuple[SlotStatus, int]:
    """One slot's next step; returns its new record and 1 if a replacement was counted."""
    counted = 0
    if pod is not None and rec.failed_uid is not None and pod.uid != rec.failed_uid:
        counted = 1  # a pod we created after a failure: the replacement happened
        rec = rec.model_copy(update={"replacements": rec.replacements + 1, "failed_uid": None})
        plan.events.append(
            Event(
                "Normal",
                "LearnerReplaced",
                (
                    f"Replaced learner pod {pod.name} in slot {rec.id} after {rec.last_failure_reason} "
                    f"(replacement {rec.replacements} of {job.spec.failure_policy.max_replacements_per_slot})"
                ),
            )
        )
    if job.spec.suspend:  # not a failure: Kueue (or a person) took the resources back
        if pod is not None and not pod.terminating:
            plan.actions.append(Action("delete", tgt, "Pod", pod.name, uid=pod.uid))
        return rec.model_copy(update={"pod_uid": None, "failed_uid": None}), counted

    def failed(uid: str, reason: str) -> SlotStatus:
        plan.events.append(
            Event("Warning", "LearnerFailed", f"Learner pod of slot {rec.id} ended with {reason}")
        )
        return rec.model_copy(
            update={
                "pod_uid": None,
                "failed_uid": uid,
                "last_failure_reason": reason,
                "last_failure_time": iso(now),
            }
        )

    limit = job.spec.failure_policy.max_replacements_per_slot
    if pod is None:
        if rec.failed_uid is None and rec.pod_uid is not None:
            rec = failed(rec.pod_uid, "Deleted")
        if rec.failed_uid is not None:
            if rec.replacements >= limit:
                return rec, counted
            since = datetime.strptime(rec.last_failure_time or iso(now), "%Y-%m-%dT%H:%M:%SZ")
            if now.replace(tzinfo=None) < since + backoff(job, rec.replacements):
                return rec, counted
        plan.actions.append(
            Action(
                "create",
                tgt,
                "Pod",
                builders.learner_pod_name(job, group.name, index),
                builders.build_learner_pod(
                    job, group, index, tgt.namespace, owned=tgt.secret is None
                ),
            )
        )
        return rec, counted
    if pod.terminating and rec.pod_uid is None and rec.failed_uid is None:
        return rec, counted  # never seen alive: e.g. deleted by a suspend; just let it go
    if pod.terminating or pod.phase == "Failed":
        if pod.uid != rec.failed_uid:
            rec = failed(pod.uid, pod.reason or ("Deleted" if pod.terminating else "Failed"))
        if not pod.terminating and rec.replacements < limit:  # its containers have ended
            plan.actions.append(
                Action("delete", tgt, "Pod", pod.name, uid=pod.uid, grace_seconds=0)
            )
        return rec, counted
    return rec.model_copy(update={"pod_uid": pod.uid}), counted


def _synchronizer(job: DecoupledDiLoCoJob, obs: Observed, plan: Plan) -> None:
    h = home(job)
    if obs.clusters.get(h, ClusterView()).problem is not None:
        return
    if not obs.claim:
        plan.actions.append(
            Action(
                "create",
                h,
                "PersistentVolumeClaim",
                builders.state_claim_name(job),
                builders.build_state_claim(job),
            )
        )
    if not obs.service:
        plan.actions.append(
            Action(
                "create",
                h,
                "Service",
                builders.synchronizer_name(job),
                builders.build_synchronizer_service(job),
            )
        )
    want = builders.build_synchronizer_deployment(job)
    if obs.deployment is None:
        plan.actions.append(
            Action("create", h, "Deployment", builders.synchronizer_name(job), want)
        )
    else:
        have = (obs.deployment.get("metadata") or {}).get("annotations") or {}
        if (
            have.get(builders.ANNOTATION_SPEC_HASH)
            != want["metadata"]["annotations"][builders.ANNOTATION_SPEC_HASH]
        ):
            plan.actions.append(
                Action("replace", h, "Deployment", builders.synchronizer_name(job), want)
            )


def _prune(job: DecoupledDiLoCoJob, obs: Observed, plan: Plan, groups: list[GroupStatus]) -> None:
    """Delete pods of removed slots and groups, leftovers of an older job of the same name,
    and token copies no group needs any more. A removed group stays in the status until its
    cluster has been cleaned."""
    wanted = {(g.name, i) for g in job.spec.learner_groups for i in range(g.replicas)}
    in_spec = {g.name for g in job.spec.learner_groups}
    used = {target_of(job, g) for g in job.spec.learner_groups} | {home(job)}
    for old in job.status.groups:
        if old.name in in_spec:
            continue
        tgt = Target(old.kubeconfig_secret, old.namespace or job.namespace)
        view = obs.clusters.get(tgt)
        if view is None or view.problem is not None or any(p.group == old.name for p in view.pods):
            groups.append(old.model_copy(update={"desired": 0}))
    for tgt, view in obs.clusters.items():
        if view.problem is not None:
            continue
        for pod in view.pods:
            stale = pod.job_uid != job.uid
            if (
                stale
                or (pod.group, pod.index) not in wanted
                or tgt != target_of_group(job, pod.group)
            ) and not pod.terminating:
                plan.actions.append(Action("delete", tgt, "Pod", pod.name, uid=pod.uid))
        if tgt not in used and view.token is not None:
            plan.actions.append(Action("delete", tgt, "Secret", builders.token_secret_name(job)))
