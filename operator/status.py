"""The status a reconcile pass reports: counts, conditions and the derived phase.

    failure = failing(job, obs)          # before a pass acts: a Failed job makes no pod
    failure = failure or learners_exhausted(desired, at_limit, done, limit)   # slots seen
    status = summarize(job, obs, groups, slots, degraded, not_ready, done, shard_count, failure)

Pure: the flow of cert-manager's readiness controller (gather, evaluate into conditions);
reconcile.py gathers, this module evaluates, and the runtime writes the result only when it
differs from the status the job has. conditions.py says when each condition is True.

Readiness is what was *seen to work*: the synchronizer is ready only once its StatefulSet has
every shard's pod available, its Services exist, and every shard's status endpoint answered
the operator's last request (an available pod that never answers is not a synchronizer anyone
can use). The phase summarises what is going on, not whether every box is ticked: Running
while the synchronizer is available and at least one learner trains, even with a slot empty
(Ready then says False, LearnersNotReady, and names the slot).

Failed (conditions.py has the rules): `failing` says, before a pass acts, whether the job has
Failed (recorded for this generation, or its synchronizer crash-loops on exit code 2), and
`learners_exhausted`, after the slots are seen, whether no slot can train any more. Both read
only what the apiserver holds (the last status, pods), never the operator's memory.

Per-component counts (status.components) come from the same observation: the synchronizer's
pods, each group's slot pods and slot books, the evaluator's Deployment. The name is ours, not
Trainer's `jobsStatus`: those entries count child Jobs, ours count pods (a learner slot is a
pod), and the same name would promise the same unit; the fields are Trainer's.
status.groups stays beside it: it holds the slots' books, spares and cluster places; only
its `ready` repeats a component's count (readyLearners sums it).

Size: every message is bounded (the first few slots by name, then a count) and per-slot
detail is in slots.py's compact form, so the status stays far below etcd's object limit at
the CRD's largest spec (tests/unit/test_operator_status.py measures it).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from ddiloco.operator import builders
from ddiloco.operator import conditions as c
from ddiloco.operator import slots as books
from ddiloco.operator.api import (
    ComponentStatus,
    Condition,
    DecoupledDiLoCoJob,
    EvaluationStatus,
    GroupStatus,
    JobStatus,
    SynchronizerStatus,
)
from ddiloco.operator.plan import ClusterView, Observed, iso, target_of
from ddiloco.operator.slots import Slot
from ddiloco.operator.syncstatus import checked, derived

MAX_MESSAGE = 1024  # characters of a condition message
MAX_REMAINING_S = 2**31 - 1  # estimatedRemainingSeconds at most (Kubeflow Trainer's int32)

# Fields of the synchronizer's GET /v1/status copied into the job status when present.
SYNC_FIELDS = ("global_version", "merges", "tokens_merged", "goodput")

SYNC_REFUSED_EXIT = 2  # what the synchronizer exits with on a start it refuses (cli/errors.py)
SYNC_REFUSED_RESTARTS = 2  # restarts that make such exits a crash loop, not a passing fault
MAX_QUOTED = 300  # characters of a container's last line quoted in the Failed message


def summarize(
    job: DecoupledDiLoCoJob,
    obs: Observed,
    groups: list[GroupStatus],
    slots: list[Slot],
    degraded: list[tuple[str, str]],
    not_ready: list[str],
    done: int,
    shard_count: int | None = None,
    failure: tuple[str, str] | None = None,
) -> JobStatus:
    """The status of a pass; `failure`: (reason, message) of the job's Failed condition
    (`failing`, `learners_exhausted`), None while it has not Failed."""
    spec, now, gen = job.spec, iso(obs.now), job.generation
    desired = spec.total_replicas()
    ready = sum(g.ready for g in groups if g.name in {x.name for x in spec.learner_groups})
    shards = spec.synchronizer.shards
    sts_status = (obs.statefulset or {}).get("status") or {}
    up = int(sts_status.get("availableReplicas") or 0)
    available = obs.statefulset is not None and up >= shards
    answered = obs.sync_status is not None
    sync_ready = available and obs.service and obs.shards_service and answered
    completed = desired > 0 and done == desired
    dep = builders.synchronizer_name(job)
    pods = "its pod" if shards == 1 else f"all {shards} shard pods"

    if spec.suspend:
        sync_c = c.make(c.SYNCHRONIZER_READY, False, c.SUSPENDED, "The job is suspended")
        learn_c = c.make(c.LEARNERS_READY, False, c.SUSPENDED, "The job is suspended")
    else:
        if sync_ready:
            sync_c = c.make(
                c.SYNCHRONIZER_READY,
                True,
                c.SYNCHRONIZER_AVAILABLE,
                f"StatefulSet {dep} has {pods} available and "
                + ("its status endpoint answers" if shards == 1 else "every shard answers"),
            )
        elif not available:
            sync_c = c.make(
                c.SYNCHRONIZER_READY,
                False,
                c.SYNCHRONIZER_PROGRESSING,
                f"Waiting for StatefulSet {dep} to have {pods} available ({up} of {shards})",
            )
        elif not (obs.service and obs.shards_service):
            missing = [
                what
                for what, there in (
                    (f"Service {dep}", obs.service),
                    (f"Service {builders.shards_service_name(job)}", obs.shards_service),
                )
                if not there
            ]
            sync_c = c.make(
                c.SYNCHRONIZER_READY,
                False,
                c.SYNCHRONIZER_PROGRESSING,
                f"Waiting for {' and '.join(missing)} to exist",
            )
        else:
            sync_c = c.make(
                c.SYNCHRONIZER_READY,
                False,
                c.SYNCHRONIZER_NOT_ANSWERING,
                f"StatefulSet {dep} has {pods} available, but "
                + (
                    f"its status endpoint ({builders.synchronizer_service_url(job)}/v1/status)"
                    if shards == 1
                    else "not every shard's status endpoint"
                )
                + " answered the operator's last request",
            )
        if failure is not None and failure[0] == c.SYNCHRONIZER_STATE_UNUSABLE:
            sync_c = c.make(c.SYNCHRONIZER_READY, False, failure[0], failure[1])
        if completed:
            learn_c = c.make(
                c.LEARNERS_READY, True, c.LEARNERS_COMPLETED, f"All {desired} learner pods finished"
            )
        elif failure is not None:
            learn_c = c.make(
                c.LEARNERS_READY,
                False,
                failure[0],
                f"The job Failed ({failure[0]}): no learner pod is made any more",
            )
        elif desired == 0:
            learn_c = c.make(c.LEARNERS_READY, True, c.NO_LEARNERS, "No learner slots are desired")
        elif not not_ready:
            learn_c = c.make(
                c.LEARNERS_READY,
                True,
                c.ALL_LEARNERS_READY,
                f"All {desired} learner pods are Ready",
            )
        else:
            waiting = ", ".join(not_ready[:5]) + (" ..." if len(not_ready) > 5 else "")
            learn_c = c.make(
                c.LEARNERS_READY,
                False,
                c.LEARNERS_NOT_READY,
                f"{ready} of {desired} learner pods are Ready; waiting for {waiting}",
            )
    if degraded:
        degr_c = c.make(
            c.DEGRADED, True, degraded[0][0], _bounded("; ".join(m for _, m in degraded))
        )
    else:
        degr_c = c.make(
            c.DEGRADED,
            False,
            c.AS_EXPECTED,
            "Every learner group is reachable and within its failure policy",
        )

    budget_done = budget_reached(job, obs.sync_status)
    if failure is not None:  # terminal for this generation, suspended or not
        ready_c, phase = c.make(c.READY, False, failure[0], failure[1]), "Failed"
    elif spec.suspend:
        ready_c, phase = c.make(c.READY, False, c.SUSPENDED, "The job is suspended"), "Suspended"
    elif budget_done:
        ready_c = c.make(
            c.READY,
            False,
            c.TOKEN_BUDGET_REACHED,
            f"The synchronizer merged training.totalTokens ({spec.training.total_tokens} "
            "tokens): the job is done",
        )
        phase = "Succeeded"
    elif completed:
        ready_c, phase = c.make(c.READY, False, c.COMPLETED, "All learners finished"), "Succeeded"
    elif degraded:
        ready_c, phase = c.make(c.READY, False, c.DEGRADED_REASON, degr_c.message), "Degraded"
    elif not sync_ready:
        ready_c = c.make(c.READY, False, c.SYNCHRONIZER_NOT_READY, sync_c.message)
        phase = "Running" if available and ready > 0 else "Pending"
    elif learn_c.status != "True":
        ready_c = c.make(c.READY, False, c.LEARNERS_NOT_READY, learn_c.message)
        phase = "Running" if ready > 0 else "Pending"  # training goes on with a slot empty
    else:
        ready_c, phase = (
            c.make(c.READY, True, c.JOB_READY, "The synchronizer and every learner pod are Ready"),
            "Running",
        )

    old = job.status
    detail, unhealthy = books.detail(slots, spec.failure_policy.max_replacements_per_slot)
    numbers: dict[str, Any] = {}
    sync = obs.sync_status or {}
    for key in SYNC_FIELDS:
        if sync.get(key) is not None:
            numbers[key] = sync[key]
    numbers.update(derived(obs.sync_status))  # merged_work_ratio, live_learners
    numbers.update(_progress(job, obs.sync_status, budget_done))
    if (evaluation := _evaluation(sync.get("evaluation"))) is not None:
        numbers["evaluation"] = evaluation  # else the last one stands
    return old.model_copy(
        update={
            "phase": phase,
            "observed_generation": gen,
            "conditions": c.merge(
                old.conditions,
                [ready_c, sync_c, learn_c, degr_c, *_lifecycle(spec.suspend, phase, ready_c, old)],
                now,
                gen,
            ),
            "desired_learners": desired,
            "ready_learners": ready,
            "groups": groups,
            "components": components(job, obs, slots),
            "slots": detail,
            "unhealthy_slots": unhealthy,
            "data_parts": shard_count if shard_count is not None else old.data_parts,
            "synchronizer": SynchronizerStatus(
                endpoint=",".join(builders.shard_urls(job)),
                ready=sync_ready,
                reachable=obs.sync_status is not None,
                shards=shards,
                available_shards=up if obs.statefulset is not None else None,
            ),
            **numbers,
        }
    )


def _lifecycle(suspended: bool, phase: str, ready_c: Condition, old: JobStatus) -> list[Condition]:
    """Suspended and Complete, as a batch/v1 Job and a Kubeflow TrainJob say them: Suspended
    True while suspended and False (JobResumed) after, absent if never; Complete True once
    done, absent before."""
    out: list[Condition] = []
    if suspended:
        out.append(c.make(c.SUSPENDED_TYPE, True, c.JOB_SUSPENDED, "The job is suspended"))
    elif c.get(old.conditions, c.SUSPENDED_TYPE) is not None:
        out.append(c.make(c.SUSPENDED_TYPE, False, c.JOB_RESUMED, "The job is running again"))
    if phase == "Succeeded":
        out.append(c.make(c.COMPLETE, True, ready_c.reason, ready_c.message))
    if phase == "Failed":
        out.append(c.make(c.FAILED, True, ready_c.reason, ready_c.message))
    return out


def recorded_failure(job: DecoupledDiLoCoJob) -> tuple[str, str] | None:
    """(reason, message) of the Failed condition the job's status holds for this very
    generation of the spec: terminal until the spec changes."""
    failed = c.get(job.status.conditions, c.FAILED)
    if failed is None or failed.status != "True" or failed.observed_generation != job.generation:
        return None
    return failed.reason, failed.message


def failing(job: DecoupledDiLoCoJob, obs: Observed) -> tuple[str, str] | None:
    """Whether the job has Failed, as far as a pass can tell before it acts: recorded for
    this generation, or (its budget not merged) a synchronizer pod crash-looping on the
    exit code of a start it refuses (`synchronizer_refused`). LearnersExhausted is decided
    after the slots are seen (`learners_exhausted`)."""
    if (recorded := recorded_failure(job)) is not None:
        return recorded
    if job.spec.suspend or budget_reached(job, checked(obs.sync_status)[0]):
        return None
    return synchronizer_refused(obs.synchronizer_pods)


def learners_exhausted(
    desired: int, at_limit: list[Slot], done: int, limit: int
) -> tuple[str, str] | None:
    """LearnersExhausted when every one of the `desired` slots has either finished (`done`)
    or used up its replacements (`at_limit`: failed, at `limit`), at least one of them."""
    if desired <= 0 or not at_limit or len(at_limit) + done < desired:
        return None
    shown = ", ".join(f"{s.id} ({s.reason})" for s in at_limit[:5])
    more = f" and {len(at_limit) - 5} more" if len(at_limit) > 5 else ""
    finished = f"; {done} finished" if done else ""
    return (
        c.LEARNERS_EXHAUSTED,
        _bounded(
            f"No learner is left to train: {len(at_limit)} of {desired} learner slots failed "
            f"after {limit} replacements, failurePolicy.maxReplacementsPerSlot{finished}: "
            f"{shown}{more}. Read their pods' logs, fix the cause, then raise "
            "maxReplacementsPerSlot to go on"
        ),
    )


def synchronizer_refused(pods: tuple[Mapping[str, Any], ...]) -> tuple[str, str] | None:
    """SynchronizerStateUnusable for the first synchronizer pod whose container is not Ready,
    last ended with SYNC_REFUSED_EXIT, and is in CrashLoopBackOff or restarted at least
    SYNC_REFUSED_RESTARTS times; its message quotes the last line of that termination's
    message (the synchronizer's one-line error)."""
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        for cs in status.get("containerStatuses") or []:
            if cs.get("name") != "synchronizer" or cs.get("ready"):
                continue
            state, last = cs.get("state") or {}, cs.get("lastState") or {}
            ended = state.get("terminated") or last.get("terminated") or {}
            if ended.get("exitCode") != SYNC_REFUSED_EXIT:
                continue
            restarts = int(cs.get("restartCount") or 0)
            looping = (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff"
            if restarts < SYNC_REFUSED_RESTARTS and not looping:
                continue
            lines = [x.strip() for x in str(ended.get("message") or "").splitlines() if x.strip()]
            said = lines[-1] if lines else "no message; see its logs"
            said = said if len(said) <= MAX_QUOTED else said[: MAX_QUOTED - 4] + " ..."
            name = meta.get("name", "?")
            return (
                c.SYNCHRONIZER_STATE_UNUSABLE,
                f"Synchronizer pod {name} keeps exiting with code {SYNC_REFUSED_EXIT} "
                f"(restarted {restarts} times), a start it refuses and a restart cannot fix "
                f"(its state directory, or its settings): {said}. It is scaled to zero with "
                "its state claim kept; fix the cause (`kubectl logs --previous`), then change "
                "the spec to start it again",
            )
    return None


def components(job: DecoupledDiLoCoJob, obs: Observed, slots: list[Slot]) -> list[ComponentStatus]:
    """status.components: the synchronizer, each learner group of the spec, the evaluator
    when spec.evaluation is set. A group whose cluster cannot be seen keeps its last counts."""
    spec, old = job.spec, {x.name: x for x in job.status.components}
    out = [_synchronizer_counts(job, obs)]
    for group in spec.learner_groups:
        name = f"learners-{group.name}"
        view = obs.clusters.get(target_of(job, group), ClusterView(problem=("", "")))
        if view.problem is not None:
            out.append(old.get(name) or ComponentStatus(name=name))
            continue
        pods = [
            p
            for p in view.pods
            if p.job_uid == job.uid
            and not p.spare
            and p.group == group.name
            and 0 <= p.index < group.replicas
            and not p.terminating
        ]
        live = [p for p in pods if p.phase in ("Pending", "Running")]
        out.append(
            ComponentStatus(
                name=name,
                active=len(live),
                ready=sum(p.ready and p.phase == "Running" for p in live),
                succeeded=sum(p.phase == "Succeeded" for p in pods),
                failed=sum(
                    s.failed
                    for s in slots
                    if s.group == group.name
                    and s.index < group.replicas
                    and not any(p.index == s.index for p in live)
                ),
                suspended=group.replicas if spec.suspend else 0,
            )
        )
    if spec.evaluation is not None:
        dep = (obs.evaluator or {}).get("status") or {}
        out.append(
            ComponentStatus(
                name="evaluator",
                active=int(dep.get("replicas") or 0),
                ready=int(dep.get("readyReplicas") or 0),
                suspended=1 if spec.suspend else 0,
            )
        )
    return out


def _synchronizer_counts(job: DecoupledDiLoCoJob, obs: Observed) -> ComponentStatus:
    active = ready = succeeded = failed = 0
    for pod in obs.synchronizer_pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        phase = status.get("phase") or "Pending"
        if meta.get("deletionTimestamp"):
            continue
        if phase == "Succeeded":
            succeeded += 1
            continue
        looping = any(
            ((cs.get("state") or {}).get("waiting") or {}).get("reason") == "CrashLoopBackOff"
            for cs in status.get("containerStatuses") or []
        )
        if phase == "Failed" or looping:
            failed += 1
            continue
        active += 1
        conds = {x.get("type"): x.get("status") for x in status.get("conditions") or []}
        ready += conds.get("Ready") == "True"
    shards = job.spec.synchronizer.shards
    return ComponentStatus(
        name="synchronizer",
        active=active,
        ready=ready,
        succeeded=succeeded,
        failed=failed,
        suspended=shards if job.spec.suspend else 0,
    )


def budget_reached(job: DecoupledDiLoCoJob, sync: Mapping[str, Any] | None) -> bool:
    """Whether the job's token budget (training.totalTokens) is merged: the synchronizer
    says `finished` for this very budget (an answer from before the budget changed says
    another), or the last status said so for this generation of the spec (the synchronizer
    need not answer any more once the job is done)."""
    total = job.spec.training.total_tokens
    if total <= 0 or recorded_failure(job) is not None:  # Failed first: Complete never
        return False
    if sync is not None and sync.get("finished") is True and sync.get("total_tokens") == total:
        return True
    ready = c.get(job.status.conditions, c.READY)
    return (
        ready is not None
        and ready.reason == c.TOKEN_BUDGET_REACHED
        and ready.observed_generation == job.generation
    )


def _progress(
    job: DecoupledDiLoCoJob, sync: Mapping[str, Any] | None, budget_done: bool
) -> dict[str, Any]:
    """progressPercentage and estimatedRemainingSeconds (Kubeflow Trainer's names) from the
    synchronizer's `progress` and `estimated_remaining_seconds` for this budget; none without
    a budget; 100 and 0 once it is merged; otherwise the last ones while it does not answer."""
    total = job.spec.training.total_tokens
    if total <= 0:
        return {"progress_percentage": None, "estimated_remaining_seconds": None}
    if budget_done:
        return {"progress_percentage": 100, "estimated_remaining_seconds": 0}
    if sync is None or sync.get("total_tokens") != total:
        return {}
    out: dict[str, Any] = {}
    progress = sync.get("progress")
    if isinstance(progress, int | float):
        out["progress_percentage"] = max(0, min(100, int(progress * 100)))
    eta = sync.get("estimated_remaining_seconds")
    out["estimated_remaining_seconds"] = (
        max(0, min(MAX_REMAINING_S, round(eta))) if isinstance(eta, int | float) else None
    )
    return out


def _evaluation(found: Any) -> EvaluationStatus | None:
    """The synchronizer's latest evaluation (`protocol.EvaluationStatus`, checked finite by
    syncstatus.py) as the job status has it: loss and perplexity rounded to 4 significant
    digits (the status changes only when the measurement does), the arrival time as an RFC
    3339 date. None when there is none or it cannot be shown."""
    if found is None or found.global_version < 0:
        return None
    try:
        at = datetime.fromtimestamp(found.time, UTC)
    except (OverflowError, OSError, ValueError):
        return None
    return EvaluationStatus(
        loss=float(f"{found.loss:.4g}"),
        perplexity=float(f"{found.perplexity:.4g}"),
        global_version=found.global_version,
        time=iso(at),
    )


def _bounded(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 4] + " ..."
