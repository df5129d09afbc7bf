"""Status conditions of a DecoupledDiLoCoJob: their types, reasons, and how they merge.

    from ddiloco.operator import conditions as c
    merged = c.merge(old_conditions, [c.make(c.READY, True, c.JOB_READY, "...")], now, generation)

Like cert-manager's Certificate conditions, each type says when it is True:

    Ready               the synchronizer is ready, every desired learner pod is Ready and
                        nothing is Degraded. The summary that `kubectl wait --for=condition=Ready`
                        uses (the phase is coarser: Running while any learner trains).
    SynchronizerReady   the synchronizer StatefulSet has every shard's pod available, its
                        Services exist, and every shard's status endpoint answered the
                        operator's last request (SynchronizerNotAnswering when one did not).
    LearnersReady       every desired learner slot has a Ready pod (True with zero slots too).
    Degraded            the operator cannot do what the spec asks: a slot has used up its
                        replacements, or a learner group's cluster cannot be reached (its
                        kubeconfig Secret is missing or broken, or the apiserver does not answer),
                        or the synchronizer no longer hears a learner group whose pods run and
                        were heard since they became Ready (LearnerGroupUnheard: the network
                        between that group's region and the synchronizer is cut; the learners
                        go on training). The message names the slot, the Secret or the group.
    Suspended           no pod of the job may run: spec.suspend is true, or Kueue has not
                        admitted the job (operator/kueue.py: Queued, or Kueue's eviction
                        reason such as Preempted). False (JobResumed, or Admitted under Kueue)
                        once it runs again; absent on a job that was never suspended. As a
                        batch/v1 Job's and a Kubeflow TrainJob's.
    Complete            the job is done: the token budget is merged or every learner finished
                        (absent before). As a batch/v1 Job's and a Kubeflow TrainJob's.
    Failed              the job cannot go on by itself (absent before); phase Failed. Decided
                        from what the apiserver holds, never from the operator's memory, by
                        the rules below. Complete and Failed exclude each other: the first
                        to be recorded stands for the spec's generation.

When a job Fails (reasons; each message names the pods and quotes why they ended):

    LearnersExhausted         no learner slot can train any more and at least one is at its
                              replacement limit: every slot of the spec's groups has either
                              finished (its pod Succeeded) or failed `maxReplacementsPerSlot`
                              times (its last pod kept, for its logs), so no learner is left
                              running and none will be made. A single slot at the limit while
                              others train is Degraded only (ReplacementLimitReached): the rest
                              train on. Slots of a group whose cluster cannot be seen are never
                              counted as exhausted.
    SynchronizerStateUnusable a synchronizer pod's container keeps exiting with code 2, which
                              the synchronizer uses for what a restart cannot fix (a state
                              directory of a format it does not know, another shard's state,
                              settings it refuses: cli/errors.py, synchronizer/server.py):
                              its last termination has exit code 2, it is not Ready, and it
                              is in CrashLoopBackOff or restarted at least twice. The message
                              quotes the last line of its termination message (the container
                              keeps its logs' tail there: FallbackToLogsOnError).

A Failed condition is terminal for the generation it was recorded at: the rules are evaluated
again only once the spec changes (metadata.generation moves), e.g. after raising
`maxReplacementsPerSlot` or fixing the synchronizer's state or image. It lives in the job's
status, so an operator restart neither loses nor repeats it; an event `Failed` (Warning)
says when it turns True.

What a Failed job keeps, like a batch/v1 Job past its backoffLimit: no pod is made any more
(no replacement, no new slot, no hot spare: the standing ones are deleted) and learner pods
still running are deleted (under Kueue its Workload is marked Finished and its quota goes to
other jobs, so it must not keep pods). Failed learner pods stay for their logs. The
synchronizer stays when it holds a usable model (LearnersExhausted: `ddiloco export`, the
evaluator and `ddiloco status` still reach it, as after Complete); when it is the cause
(SynchronizerStateUnusable) it is scaled to zero with its evaluator, as for a suspend, so
that its state claim is kept and free to mount for inspection or repair instead of a pod
crash-looping on it.

Reasons are CamelCase and stable; tests and dashboards match on them. `lastTransitionTime`
moves only when a condition's status flips, as the Kubernetes API conventions ask.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal

from ddiloco.operator.api import Condition

READY: Final = "Ready"
SYNCHRONIZER_READY: Final = "SynchronizerReady"
LEARNERS_READY: Final = "LearnersReady"
DEGRADED: Final = "Degraded"
SUSPENDED_TYPE: Final = "Suspended"
COMPLETE: Final = "Complete"
FAILED: Final = "Failed"
TYPES: Final = (READY, SYNCHRONIZER_READY, LEARNERS_READY, DEGRADED)  # always present
OPTIONAL: Final = (SUSPENDED_TYPE, COMPLETE, FAILED)  # present when they apply
OWNED: Final = (*TYPES, *OPTIONAL)

# Ready
JOB_READY: Final = "JobReady"
SYNCHRONIZER_NOT_READY: Final = "SynchronizerNotReady"
LEARNERS_NOT_READY: Final = "LearnersNotReady"
DEGRADED_REASON: Final = "Degraded"
SUSPENDED: Final = "Suspended"
COMPLETED: Final = "Completed"
TOKEN_BUDGET_REACHED: Final = "TokenBudgetReached"  # training.totalTokens merged
INVALID_SPEC: Final = "InvalidSpec"
# SynchronizerReady
SYNCHRONIZER_AVAILABLE: Final = "SynchronizerAvailable"
SYNCHRONIZER_PROGRESSING: Final = "SynchronizerProgressing"
SYNCHRONIZER_NOT_ANSWERING: Final = "SynchronizerNotAnswering"
# LearnersReady
ALL_LEARNERS_READY: Final = "AllLearnersReady"
NO_LEARNERS: Final = "NoLearnersDesired"
LEARNERS_COMPLETED: Final = "LearnersCompleted"
# Suspended (Kueue's reasons come from operator/kueue.py)
JOB_SUSPENDED: Final = "JobSuspended"
JOB_RESUMED: Final = "JobResumed"
# Complete: COMPLETED or TOKEN_BUDGET_REACHED
# Failed (also Ready's and the LearnersReady/SynchronizerReady reasons while Failed)
LEARNERS_EXHAUSTED: Final = "LearnersExhausted"
SYNCHRONIZER_STATE_UNUSABLE: Final = "SynchronizerStateUnusable"
# Degraded
AS_EXPECTED: Final = "AsExpected"
REPLACEMENT_LIMIT_REACHED: Final = "ReplacementLimitReached"
KUBECONFIG_SECRET_MISSING: Final = "KubeconfigSecretMissing"
KUBECONFIG_SECRET_INVALID: Final = "KubeconfigSecretInvalid"
CLUSTER_UNREACHABLE: Final = "ClusterUnreachable"
LEARNER_GROUP_UNHEARD: Final = "LearnerGroupUnheard"  # its Ready learners went silent
NAME_CONFLICT: Final = "NameConflict"  # an object the job needs exists and is not the job's
SYNCHRONIZER_STATUS_INVALID: Final = "SynchronizerStatusInvalid"  # fields of its answer dropped
FAILED_CREATE: Final = "FailedCreate"  # the apiserver refused a child (quota, admission, ...)

Status = Literal["True", "False", "Unknown"]


def make(type_: str, status: bool | None, reason: str, message: str) -> Condition:
    """A condition without times; `merge` stamps them."""
    value: Status = "Unknown" if status is None else ("True" if status else "False")
    return Condition(type=type_, status=value, reason=reason, message=message)


def merge(
    old: Iterable[Condition], new: Iterable[Condition], now: str, generation: int
) -> list[Condition]:
    """New conditions in OWNED order; keep the old transition time where the status is unchanged.

    Types the operator does not own (another controller's) are kept as they were, after ours.
    """
    previous = {c.type: c for c in old}
    merged: list[Condition] = []
    fresh = {c.type: c for c in new}
    for type_ in [*OWNED, *(t for t in fresh if t not in OWNED)]:
        if type_ not in fresh:
            continue
        cond, before = fresh[type_], previous.get(type_)
        since = before.last_transition_time if before and before.status == cond.status else now
        merged.append(
            cond.model_copy(
                update={"last_transition_time": since, "observed_generation": generation}
            )
        )
    merged += [c for t, c in previous.items() if t not in fresh and t not in OWNED]
    return merged


def get(conditions: Iterable[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)
