"""The status a reconcile pass reports: counts, conditions and the derived phase.

    status = summarize(job, obs, groups, slots, degraded, not_ready, done)

Pure: the flow of cert-manager's readiness controller (gather, evaluate into conditions);
reconcile.py gathers, this module evaluates, and the runtime writes the result only when it
differs from the status the job has. conditions.py says when each condition is True.
"""

from __future__ import annotations

from typing import Any

from ddiloco.operator import builders
from ddiloco.operator import conditions as c
from ddiloco.operator.api import (
    DecoupledDiLoCoJob,
    GroupStatus,
    JobStatus,
    SlotStatus,
    SynchronizerStatus,
)
from ddiloco.operator.plan import Observed, iso

# Fields of the synchronizer's GET /v1/status copied into the job status when present.
SYNC_FIELDS = ("global_version", "merges", "tokens_merged", "goodput")


def summarize(
    job: DecoupledDiLoCoJob,
    obs: Observed,
    groups: list[GroupStatus],
    slots: list[SlotStatus],
    degraded: list[tuple[str, str]],
    not_ready: list[str],
    done: int,
) -> JobStatus:
    spec, now, gen = job.spec, iso(obs.now), job.generation
    desired = spec.total_replicas()
    ready = sum(g.ready for g in groups if g.name in {x.name for x in spec.learner_groups})
    dep_status = (obs.deployment or {}).get("status") or {}
    sync_ready = obs.deployment is not None and int(dep_status.get("availableReplicas") or 0) > 0
    completed = desired > 0 and done == desired
    dep = builders.synchronizer_name(job)

    if spec.suspend:
        sync_c = c.make(c.SYNCHRONIZER_READY, False, c.SUSPENDED, "The job is suspended")
        learn_c = c.make(c.LEARNERS_READY, False, c.SUSPENDED, "The job is suspended")
    else:
        sync_c = (
            c.make(
                c.SYNCHRONIZER_READY,
                True,
                c.SYNCHRONIZER_AVAILABLE,
                f"Deployment {dep} has an available pod",
            )
            if sync_ready
            else c.make(
                c.SYNCHRONIZER_READY,
                False,
                c.SYNCHRONIZER_PROGRESSING,
                f"Waiting for Deployment {dep} to have an available pod",
            )
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
        degr_c = c.make(c.DEGRADED, True, degraded[0][0], "; ".join(m for _, m in degraded))
    else:
        degr_c = c.make(
            c.DEGRADED,
            False,
            c.AS_EXPECTED,
            "Every learner group is reachable and within its failure policy",
        )

    if spec.suspend:
        ready_c, phase = c.make(c.READY, False, c.SUSPENDED, "The job is suspended"), "Suspended"
    elif completed:
        ready_c, phase = c.make(c.READY, False, c.COMPLETED, "All learners finished"), "Succeeded"
    elif degraded:
        ready_c, phase = c.make(c.READY, False, c.DEGRADED_REASON, degr_c.message), "Degraded"
    elif not sync_ready:
        ready_c, phase = c.make(c.READY, False, c.SYNCHRONIZER_NOT_READY, sync_c.message), "Pending"
    elif learn_c.status != "True":
        ready_c, phase = c.make(c.READY, False, c.LEARNERS_NOT_READY, learn_c.message), "Pending"
    else:
        ready_c, phase = (
            c.make(c.READY, True, c.JOB_READY, "The synchronizer and every learner pod are Ready"),
            "Running",
        )

    old = job.status
    numbers: dict[str, Any] = {}
    sync = obs.sync_status or {}
    for key in SYNC_FIELDS:
        if sync.get(key) is not None:
            numbers[key] = sync[key]
    return old.model_copy(
        update={
            "phase": phase,
            "observed_generation": gen,
            "conditions": c.merge(old.conditions, [ready_c, sync_c, learn_c, degr_c], now, gen),
            "desired_learners": desired,
            "ready_learners": ready,
            "groups": groups,
            "slots": slots,
            "synchronizer": SynchronizerStatus(
                endpoint=builders.synchronizer_service_url(job),
                ready=sync_ready,
                reachable=obs.sync_status is not None,
            ),
            **numbers,
        }
    )
