"""The status a reconcile pass reports: counts, conditions and the derived phase.

    status = summarize(job, obs, groups, slots, degraded, not_ready, done, shard_count)

Pure: the flow of cert-manager's readiness controller (gather, evaluate into conditions);
reconcile.py gathers, this module evaluates, and the runtime writes the result only when it
differs from the status the job has. conditions.py says when each condition is True.

Readiness is what was *seen to work*: the synchronizer is ready only once its StatefulSet has
every shard's pod available, its Services exist, and every shard's status endpoint answered
the operator's last request (an available pod that never answers is not a synchronizer anyone
can use). The phase summarises what is going on, not whether every box is ticked: Running
while the synchronizer is available and at least one learner trains, even with a slot empty
(Ready then says False, LearnersNotReady, and names the slot).

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
    Condition,
    DecoupledDiLoCoJob,
    EvaluationStatus,
    GroupStatus,
    JobStatus,
    SynchronizerStatus,
)
from ddiloco.operator.plan import Observed, iso
from ddiloco.operator.slots import Slot
from ddiloco.operator.syncstatus import derived

MAX_MESSAGE = 1024  # characters of a condition message
MAX_REMAINING_S = 2**31 - 1  # estimatedRemainingSeconds at most (Kubeflow Trainer's int32)

# Fields of the synchronizer's GET /v1/status copied into the job status when present.
SYNC_FIELDS = ("global_version", "merges", "tokens_merged", "goodput")


def summarize(
    job: DecoupledDiLoCoJob,
    obs: Observed,
    groups: list[GroupStatus],
    slots: list[Slot],
    degraded: list[tuple[str, str]],
    not_ready: list[str],
    done: int,
    shard_count: int | None = None,
) -> JobStatus:
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
        if completed:
            learn_c = c.make(
                c.LEARNERS_READY, True, c.LEARNERS_COMPLETED, f"All {desired} learner pods finished"
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
    if spec.suspend:
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
    return out


def budget_reached(job: DecoupledDiLoCoJob, sync: Mapping[str, Any] | None) -> bool:
    """Whether the job's token budget (training.totalTokens) is merged: the synchronizer
    says `finished` for this very budget (an answer from before the budget changed says
    another), or the last status said so for this generation of the spec (the synchronizer
    need not answer any more once the job is done)."""
    total = job.spec.training.total_tokens
    if total <= 0:
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
