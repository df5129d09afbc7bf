"""Reconcile, purely: (job, what the clusters hold) -> (actions, status, events).

    plan = reconcile(job, observed, fresh_token="...")
    for action in plan.actions: ...          # runtime.py sends them; tests just read them

No I/O and no clock: `Observed` carries the time, and every decision is a function of the
job's spec, its last status and the observation, so the unit tests can replay any situation.
The flow is cert-manager's readiness controller: gather, evaluate into conditions, compare.

Learner slots. Each slot (`<group>-<index>`) has one pod with a fixed name, so the apiserver
itself forbids two pods per slot, also across an operator restart. A pod that fails (phase
Failed, e.g. Evicted, Preempted or OOMKilled), starts terminating (e.g. the eviction API), or
vanishes is a *failure*: the slot records it (slots.py keeps the books, compactly, in
status.groups), that status is written before anything is deleted or created, and the
replacement is created once the old pod is gone and the backoff has passed. Every pod carries
its slot's attempt number; a replacement is *counted* when a pod with a higher attempt is
observed, so a crash between any two steps neither loses nor doubles a count. Past
`failurePolicy.maxReplacementsPerSlot` the slot stays empty (its failed pod kept, for its
logs) and the job Degraded; Failed once no slot can train any more (conditions.py), after
which no pod is made. The LearnerFailed event quotes the pod's reason, exit code and last
log lines (its termination message), so they outlive the pod. Spec changes reach new pods
only (replacements and new slots), like a StatefulSet's OnDelete, with one exception: a
new division of the data (slots.py) restarts the learners whose data part changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from ddiloco.operator import (
    builders,
    evaluator_workload,
    names,
    slots,
    spares,
    sync_workload,
    syncstatus,
    tokens,
)
from ddiloco.operator import conditions as c
from ddiloco.operator.api import (
    DecoupledDiLoCoJob,
    FormerPlace,
    GroupStatus,
    LearnerGroup,
    validate,
)
from ddiloco.operator.certs import tls_plan
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
    place,
    target_of,
    target_of_group,
)
from ddiloco.operator.slots import Slot
from ddiloco.operator.status import budget_reached, failing, learners_exhausted, summarize
from ddiloco.operator.tokens import token_plan

MAX_EVENT_TAIL = 800  # characters of a failed learner's last output quoted in its event


def backoff(job: DecoupledDiLoCoJob, replacements: int) -> timedelta:
    policy = job.spec.failure_policy
    delay = policy.backoff_seconds * 2 ** min(replacements, 30)
    return timedelta(seconds=min(delay, policy.max_backoff_seconds))


def reconcile(job: DecoupledDiLoCoJob, obs: Observed, fresh_token: str) -> Plan:
    """The actions that move the clusters toward the spec, and the status that says where they are."""
    if not job.is_ours():
        return Plan()
    now, gen = iso(obs.now), job.generation
    problems = validate(job.spec) + names.problems(job)
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
    tok = token_plan(job, obs, fresh_token)  # the job key Secret, and its rotation (tokens.py)
    token = tok.token
    plan.actions += [tok.action] if tok.action is not None else []
    plan.events += [tok.event] if tok.event is not None else []
    tls = tls_plan(job, obs, plan)  # certificates and their Secrets (certs.py)
    failure = failing(job, obs)  # Failed: no pod is made any more (conditions.py)
    halted = job  # the synchronizer as the spec says, or at zero when it is the cause
    if failure is not None and failure[0] == c.SYNCHRONIZER_STATE_UNUSABLE:
        halted = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})})
    _synchronizer(_draining(job, obs) if halted is job else halted, obs, plan, tls.revision)
    plan.actions += evaluator_workload.evaluator_actions(halted, obs, token)  # spec.evaluation

    sync_status, bad = syncstatus.checked(obs.sync_status)
    obs = dataclasses.replace(obs, sync_status=sync_status)
    budget_done = budget_reached(job, sync_status)  # nothing left to train or replace
    books = slots.decode(job.status.groups)
    shard_count, reshard = slots.allocate_shards(job, books)
    limit = job.spec.failure_policy.max_replacements_per_slot
    old_groups = {g.name: g for g in job.status.groups}
    new_slots: list[Slot] = []
    at_limit: list[Slot] = []
    groups: list[GroupStatus] = []
    degraded: list[tuple[str, str]] = list(tls.problems)
    not_ready: list[str] = []
    done = 0
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
        gstat, moved = _moved(job, obs, gstat, old, tgt, view)
        degraded += [d for d in _former_problems(obs, gstat) if d not in degraded]
        if moved:  # its pods there are not its slots' failures: the slots start afresh here
            for key, rec in list(books.items()):
                if key[0] == group.name:
                    books[key] = rec.update(seen=False)
        if view.problem is not None:  # keep the books as they were; act nowhere there
            reason, msg = view.problem
            degraded.append(
                (
                    reason,
                    f"Learner group {group.name} is held back: {msg}"
                    if reason == c.NAME_CONFLICT
                    else f"Could not reach the cluster of learner group {group.name}: {msg}",
                )
            )
            kept = [books.get((group.name, i)) or Slot(group.name, i) for i in range(len(ids))]
            new_slots += kept
            not_ready += ids
            keep = ("ready", "spares", "spares_ready", "promoted")
            groups.append(
                slots.encode(
                    gstat.model_copy(update={k: getattr(old, k) for k in keep} if old else {}),
                    kept,
                )
            )
            continue
        # the group's learner credentials, derived from the key, before the pods that mount them
        if (creds := tokens.credentials_action(job, group, tgt, view, token)) is not None:
            plan.actions.append(creds)
        pods = {(p.group, p.index): p for p in view.pods if p.job_uid == job.uid and not p.spare}
        hot = spares.observe(job, group, view.pods)  # hot spares (operator/spares.py)
        ready = replaced = promoted = finished = 0
        mine: list[Slot] = []
        for index, sid in enumerate(ids):
            rec, pod = books[(group.name, index)], pods.get((group.name, index))
            rec, counted = _slot(
                job, group, index, tgt, rec, pod, obs.now, plan, shard_count, hot.take,
                budget_done, halted=failure is not None,
            )  # fmt: skip
            replaced += counted
            promoted += counted if pod is not None and pod.serial is not None else 0
            mine.append(rec)
            if pod is not None and pod.phase == "Succeeded" and not pod.terminating:
                # (a deleted pod is Succeeded too once its learner flushed on SIGTERM and
                # exited 0: an eviction, a failure like any other, _slot replaces it)
                finished += 1
            elif pod is not None and pod.ready and not pod.terminating and pod.phase == "Running":
                ready += 1
            elif pod is not None and pod.blocked and not pod.terminating:
                not_ready.append(f"{sid} ({pod.blocked[:200]})")  # what to fix, in the status
            else:
                not_ready.append(sid)
            if rec.failed and rec.replacements >= limit and not job.spec.suspend:
                at_limit.append(rec)
        new_slots += mine
        done += finished
        if (silent := _unheard(group.name, ids, pods, sync_status, obs.now)) is not None:
            degraded.append(
                (
                    c.LEARNER_GROUP_UNHEARD,
                    f"The synchronizer no longer hears learner group {group.name} ({tgt.label}):"
                    f" {silent}; the network between its cluster and the synchronizer may be "
                    "cut (its learners go on training and hand over their work when it returns)",
                )
            )
        # once every slot of the group has finished, its spares only hold (GPU) nodes
        spares.refill(
            job,
            group,
            tgt,
            hot,
            plan,
            finished=budget_done or failure is not None or 0 < group.replicas == finished,
        )
        spares.resend(job, group, view.pods, obs.now, plan)
        standing, standing_ready = hot.counts()
        groups.append(
            slots.encode(
                gstat.model_copy(
                    update={
                        "ready": ready,
                        "replaced": gstat.replaced + replaced,
                        "spares": standing,
                        "spares_ready": standing_ready,
                        "promoted": (old.promoted if old else 0) + promoted,
                    }
                ),
                mine,
            )
        )
    if at_limit:
        degraded.append((c.REPLACEMENT_LIMIT_REACHED, _limit_message(at_limit, limit)))
    if reshard:
        plan.events.append(
            Event(
                "Normal",
                "DataRedivided",
                f"The training data is now cut into {shard_count} shards; learner pods on "
                "another shard are restarted on their new one",
            )
        )
    degraded += [r for r in obs.refused if r not in degraded]  # what the apiservers refused
    _prune(job, obs, plan, groups)
    if bad:
        degraded.append(
            (
                c.SYNCHRONIZER_STATUS_INVALID,
                "The synchronizer's status answer has fields of the wrong type or not finite "
                f"numbers, left out of the job's status: {', '.join(bad)}",
            )
        )

    if failure is None:
        failure = learners_exhausted(job.spec.total_replicas(), at_limit, done, limit)
    status = summarize(job, obs, groups, new_slots, degraded, not_ready, done, shard_count, failure)
    before = c.get(job.status.conditions, c.FAILED)
    if failure is not None and (before is None or before.status != "True"):
        plan.events.append(Event("Warning", "Failed", failure[1]))
    if status != job.status:
        plan.status = status
    return plan


def _moved(
    job: DecoupledDiLoCoJob,
    obs: Observed,
    gstat: GroupStatus,
    old: GroupStatus | None,
    tgt: Target,
    view: ClusterView,
) -> tuple[GroupStatus, bool]:
    """Record where the group's cluster is (its API server URL, no credentials) and, when
    that place changed since the last status (its kubeconfig Secret edited to point at
    another cluster, another Secret, another namespace), where its objects were left
    (`former`), so the old place is cleaned (its Target is observed from the next pass on:
    `_prune`, `tokens.prune`, certs.py delete what the group left there) and so is every
    recorded place at the job's deletion. A former place is forgotten once nothing of the
    group is left there, or when the group is back there. Returns the group's status and
    whether it moved in this pass."""
    here = (view.server, tgt.namespace) if view.problem is None and view.server else None
    before = (
        (old.server, old.namespace or job.namespace) if old is not None and old.server else None
    )
    former = list(old.former) if old is not None else []
    moved = here is not None and before is not None and here != before
    if moved and old is not None and old.server:
        former.append(
            FormerPlace(
                server=old.server,
                namespace=old.namespace or job.namespace,
                kubeconfig_secret=old.kubeconfig_secret.name if old.kubeconfig_secret else None,
            )
        )
    kept: list[FormerPlace] = []
    for f in former:
        if (f.server, f.namespace) == (here or before) or any(
            (k.server, k.namespace) == (f.server, f.namespace) for k in kept
        ):
            continue
        if not moved and _left_clean(job, obs, gstat.name, f):
            continue
        kept.append(f)
    server = here[0] if here is not None else (old.server if old is not None else None)
    return gstat.model_copy(update={"server": server, "former": kept[-8:]}), moved


def _left_clean(job: DecoupledDiLoCoJob, obs: Observed, group: str, f: FormerPlace) -> bool:
    """Whether the group's pods and credentials are gone from a place it left."""
    view = obs.clusters.get(Target(None, f.namespace, server=f.server))
    if view is None or view.problem is not None:
        return False
    creds = builders.learner_tokens_secret_name(job, group)
    return not any(p.group == group for p in view.pods) and creds not in view.secrets


def _former_problems(obs: Observed, gstat: GroupStatus) -> list[tuple[str, str]]:
    """Places the group left that cannot be cleaned now (Degraded, naming them)."""
    out: list[tuple[str, str]] = []
    for f in gstat.former:
        view = obs.clusters.get(Target(None, f.namespace, server=f.server))
        if view is not None and view.problem is not None:
            out.append(
                (
                    view.problem[0],
                    f"Could not clean up after learner group {gstat.name} in namespace "
                    f"{f.namespace} of the cluster at {f.server}, where it ran before its "
                    f"cluster changed: {view.problem[1]}",
                )
            )
    return out


def _unheard(
    group: str,
    ids: list[str],
    pods: dict[tuple[str, int], PodView],
    sync: Mapping[str, Any] | None,
    now: datetime,
) -> str | None:
    """Which of a group's learners the synchronizer stopped hearing, when it hears none of
    them: each Ready pod's learner was heard after the pod became Ready (or was promoted from
    a hot spare), and the synchronizer now says it is not alive (silent past its liveness
    window). None while any is heard, when none has spoken since it became Ready (starting,
    nothing to conclude), or without a status answer. A pod that was just replaced is never
    counted: its learner was last heard before the pod became Ready."""
    if sync is None:
        return None
    records = {r.get("learner_id"): r for r in sync.get("learners") or [] if isinstance(r, dict)}
    silent: list[str] = []
    for index, sid in enumerate(ids):
        pod = pods.get((group, index))
        if pod is None or not pod.ready or pod.terminating or pod.phase != "Running":
            continue
        rec = records.get(sid)
        if rec is None:
            continue
        if rec.get("alive") is True:
            return None
        last = rec.get("last_seen_s")
        stamps = [t for t in (pod.ready_since, pod.promoted_at) if t]
        if not isinstance(last, int | float) or last < 0 or not stamps:
            continue
        try:  # "...Z" as the API sends it, "...+00:00" as the client's models serialize it
            since = max(datetime.fromisoformat(t).astimezone(UTC) for t in stamps)
        except ValueError:
            continue
        if now.astimezone(UTC) - timedelta(seconds=last) > since:
            silent.append(f"{sid} last heard {last:.0f} s ago")
    if not silent:
        return None
    return ", ".join(silent[:5]) + (f" and {len(silent) - 5} more" if len(silent) > 5 else "")


def _limit_message(at_limit: list[Slot], limit: int) -> str:
    """One sentence for every slot at the replacement limit, however many (the status must
    stay small): the first few by name, with their last failures, and a count."""
    shown = ", ".join(f"{s.id} ({s.reason})" for s in at_limit[:5])
    more = f" and {len(at_limit) - 5} more" if len(at_limit) > 5 else ""
    if len(at_limit) == 1:
        return (
            f"Learner slot {at_limit[0].id} was replaced {at_limit[0].replacements} times, the "
            f"failurePolicy limit; its last pod ended with {at_limit[0].reason}"
        )
    return (
        f"{len(at_limit)} learner slots were replaced {limit} times, the failurePolicy limit, "
        f"and stay empty: {shown}{more}"
    )


def _failure_text(pod: PodView) -> str:
    """Why a pod ended, for an event: its reason, exit code and last log lines (bounded)."""
    text = pod.reason or ("Deleted" if pod.terminating else "Failed")
    if pod.exit_code is not None:
        text += f" (exit code {pod.exit_code})"
    if pod.message:
        tail = pod.message.strip()
        tail = tail if len(tail) <= MAX_EVENT_TAIL else "..." + tail[-MAX_EVENT_TAIL:]
        text += f"; last output:\n{tail}"
    return text


def _slot(
    job: DecoupledDiLoCoJob,
    group: LearnerGroup,
    index: int,
    tgt: Target,
    rec: Slot,
    pod: PodView | None,
    now: datetime,
    plan: Plan,
    shard_count: int,
    take_spare: Callable[[], PodView | None] | None = None,
    budget_done: bool = False,
    halted: bool = False,
) -> tuple[Slot, int]:
    """One slot's next step; returns its new record and 1 if a replacement was counted.
    A due replacement goes to a Ready hot spare when `take_spare` gives one (spares.py).
    Once the job's token budget is merged (`budget_done`) a slot is done whatever its pod
    does: its learner exits 0 (or has), and a pod that ends or goes is not replaced. Once
    the job has Failed (`halted`) no pod is made and a live one is deleted, not a failure;
    the slot's books stay as they were (a slot at its limit stays so)."""
    counted = 0
    if pod is not None and pod.attempt > rec.replacements:
        counted = 1  # a pod we created after a failure: the replacement happened
        rec = rec.update(replacements=pod.attempt, failed=False)
        plan.events.append(
            Event(
                "Normal",
                "LearnerReplaced",
                (
                    f"Replaced learner pod {pod.name} in slot {rec.id} after {rec.reason} "
                    f"(replacement {rec.replacements} of {job.spec.failure_policy.max_replacements_per_slot})"
                ),
            )
        )
    if job.spec.suspend:  # not a failure: Kueue (or a person) took the resources back
        if pod is not None and not pod.terminating:
            plan.actions.append(Action("delete", tgt, "Pod", pod.name, uid=pod.uid))
        return rec.update(seen=False, failed=False), counted
    if budget_done:
        return rec.update(seen=False, failed=False), counted
    if halted:
        if pod is not None and not pod.terminating and pod.phase in ("Pending", "Running"):
            plan.actions.append(Action("delete", tgt, "Pod", pod.name, uid=pod.uid))
        return rec.update(seen=False), counted

    def failed(reason: str, text: str) -> Slot:
        name = f"Learner pod {pod.name}" if pod is not None else "The learner pod"
        plan.events.append(
            Event("Warning", "LearnerFailed", f"{name} of slot {rec.id} ended with {text}")
        )
        return rec.update(seen=False, failed=True, reason=reason, time=iso(now))

    limit = job.spec.failure_policy.max_replacements_per_slot
    if pod is None:
        if not rec.failed and rec.seen:
            rec = failed("Deleted", "Deleted (it vanished)")
        if rec.failed:
            if rec.replacements >= limit:
                return rec, counted
            since = datetime.strptime(rec.time or iso(now), "%Y-%m-%dT%H:%M:%SZ")
            if now.replace(tzinfo=None) < since + backoff(job, rec.replacements):
                return rec, counted
            spare = take_spare() if take_spare is not None else None
            if spare is not None:
                shard = (rec.shard if rec.shard is not None else index, shard_count)
                spares.promote(job, group, tgt, rec, spare, shard, rec.replacements + 1, now, plan)
                return rec, counted
        plan.actions.append(
            Action(
                "create",
                tgt,
                "Pod",
                builders.learner_pod_name(job, group.name, index),
                builders.build_learner_pod(
                    job,
                    group,
                    index,
                    tgt.namespace,
                    owned=tgt.secret is None,
                    shard=(rec.shard if rec.shard is not None else index, shard_count),
                    attempt=rec.replacements + (1 if rec.failed else 0),
                ),
            )
        )
        return rec, counted
    if pod.terminating and not rec.seen and not rec.failed:
        return rec, counted  # never seen alive: e.g. deleted by a suspend; just let it go
    if pod.terminating or pod.phase == "Failed":
        if not rec.failed:
            rec = failed(
                pod.reason or ("Deleted" if pod.terminating else "Failed"), _failure_text(pod)
            )
        if not pod.terminating and rec.replacements < limit:  # its containers have ended
            plan.actions.append(
                Action("delete", tgt, "Pod", pod.name, uid=pod.uid, grace_seconds=0)
            )
        return rec, counted
    if pod.shard is not None and pod.shard != (rec.shard, shard_count) and pod.phase != "Succeeded":
        # the data divided again: restart it on its new part; not a failure (seen=False lets it go)
        plan.actions.append(Action("delete", tgt, "Pod", pod.name, uid=pod.uid))
        return rec.update(seen=False), counted
    return rec.update(seen=True), counted


def _draining(job: DecoupledDiLoCoJob, obs: Observed) -> DecoupledDiLoCoJob:
    """The job whose synchronizer to build: a suspended one (spec.suspend, or preempted by
    Kueue) keeps it running for as long as a learner pod of the job is there, since each
    learner hands its fragments over on SIGTERM and needs the synchronizer to accept them;
    it goes to zero once the last of them is gone."""
    if not job.spec.suspend or not any(
        p.job_uid == job.uid and not p.spare for v in obs.clusters.values() for p in v.pods
    ):
        return job
    return job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": False})})


def _synchronizer(
    job: DecoupledDiLoCoJob, obs: Observed, plan: Plan, tls_revision: str | None = None
) -> None:
    """The Services, then the StatefulSet (builders.py). A Service whose ports differ from
    what the pods serve gets them (only its ports are patched)."""
    h = home(job)
    if obs.clusters.get(h, ClusterView()).problem is not None:
        return
    for there, ports, build in (
        (obs.service, obs.service_ports, sync_workload.build_synchronizer_service),
        (obs.shards_service, obs.shards_service_ports, sync_workload.build_shards_service),
    ):
        want = build(job)
        name = want["metadata"]["name"]
        if not there:
            plan.actions.append(Action("create", h, "Service", name, want))
        elif (patch := sync_workload.service_ports_patch(want, ports)) is not None:
            wanted = ", ".join(f"{p['name']} {p['port']}" for p in patch["spec"]["ports"])
            done = Event("Normal", "ServicePortsUpdated", f"Set Service {name}'s ports: {wanted}")
            plan.actions.append(Action("patch", h, "Service", name, {"patch": patch}, event=done))
    name = builders.synchronizer_name(job)
    have = obs.statefulset
    have_spec = (have or {}).get("spec") or {}
    want = sync_workload.build_synchronizer_statefulset(job, tls_revision)
    if have is None:
        plan.actions.append(Action("create", h, "StatefulSet", name, want))
        return
    annotations = (have.get("metadata") or {}).get("annotations") or {}
    if (
        annotations.get(builders.ANNOTATION_SPEC_HASH)
        != want["metadata"]["annotations"][builders.ANNOTATION_SPEC_HASH]
    ):
        # What a StatefulSet never changes stays as it is (a new storage size reaches no
        # existing claim).
        for key in ("volumeClaimTemplates", "serviceName", "podManagementPolicy", "selector"):
            if key in have_spec:
                want["spec"][key] = have_spec[key]
            else:
                want["spec"].pop(key, None)
        plan.actions.append(Action("replace", h, "StatefulSet", name, want))


def _prune(job: DecoupledDiLoCoJob, obs: Observed, plan: Plan, groups: list[GroupStatus]) -> None:
    """Delete pods of removed slots and groups, and credentials no pod needs any more (a
    removed group's, copies of the job key in remote clusters; tokens.prune), never a pod of
    another job, not even an older one of the same name. A removed group stays in the status
    until its cluster has been cleaned of its pods and credentials."""
    wanted = {(g.name, i) for g in job.spec.learner_groups for i in range(g.replicas)}
    in_spec = {g.name for g in job.spec.learner_groups}
    for old in job.status.groups:
        if old.name in in_spec:
            continue
        tgt = Target(old.kubeconfig_secret, old.namespace or job.namespace)
        view = obs.clusters.get(tgt)
        if (
            view is None
            or view.problem is not None
            or any(p.group == old.name for p in view.pods)
            or builders.learner_tokens_secret_name(job, old.name) in view.secrets
            or any(not _left_clean(job, obs, old.name, f) for f in old.former)
        ):
            groups.append(old.model_copy(update={"desired": 0}))
    for tgt, view in obs.clusters.items():
        if view.problem is not None:
            continue
        for pod in view.pods:
            if pod.job_uid != job.uid:
                continue  # another job's (an older one of this name): never ours to delete
            if pod.spare and tgt == target_of_group(job, pod.group):
                continue  # a hot spare of a group in the spec: spares.refill keeps those
            now = target_of_group(job, pod.group)
            if now is not None and now != tgt and place(obs, tgt) == place(obs, now) is not None:
                continue  # one namespace reached two ways: the group's own target sees it
            if ((pod.group, pod.index) not in wanted or tgt != now) and not pod.terminating:
                plan.actions.append(Action("delete", tgt, "Pod", pod.name, uid=pod.uid))
    plan.actions += tokens.prune(job, obs)
