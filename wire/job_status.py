"""The job's view from its synchronizer shards' answers: `merge_statuses`.

    job = merge_statuses([client.status() for client in shard_clients])

A pure function of `protocol.Status` payloads, so every reader of a sharded job's status
(the learner's shard clients, `ddiloco status`, the operator) makes the same view without
torch. A shard's own `Status` lists only the fragments it owns (`FragmentStatus.shard` says
whose), its `global_version`, `merges`, contributions and bytes count only those, and its
`tokens_merged` is the average over its own fragments (every fragment sees every token, so
that is already an estimate of the job's). The merged view's definitions are the one-shard
ones over the whole layout (synchronizer/ledger.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ddiloco.wire.protocol import FragmentStatus, LearnerStatus, Status

__all__ = ["merge_learners", "merge_statuses"]


def _freshest(rows: list[LearnerStatus]) -> LearnerStatus:
    """The row last heard from (last_seen_s -1 means never)."""
    heard = [r for r in rows if r.last_seen_s >= 0]
    return min(heard, key=lambda r: r.last_seen_s) if heard else rows[0]


def merge_learners(rows: list[LearnerStatus]) -> LearnerStatus:
    """One learner slot's row from every shard's: alive if alive on any; step, loss, times
    from the freshest; incarnation, data position and tokens computed the highest any shard
    holds (each is a lower bound of the truth); contributions summed (each shard counts the
    merges of its own fragments)."""
    best = _freshest(rows)
    return best.model_copy(
        update={
            "alive": any(r.alive for r in rows),
            "incarnation": max(r.incarnation for r in rows),
            "contributions": sum(r.contributions for r in rows),
            "data_position": max(r.data_position for r in rows),
            "tokens_computed": max(r.tokens_computed for r in rows),
            "slot_steps": max(r.slot_steps for r in rows),
            "compute_seconds": max(r.compute_seconds for r in rows),
            "uptime_seconds": max(r.uptime_seconds for r in rows),
        }
    )


def _xi(statuses: Sequence[Status], key: str, how: Any) -> float | None:
    values = [s.xi.get(key) for s in statuses]
    known = [v for v in values if v is not None]
    return how(known) if known else None


def merge_statuses(statuses: Sequence[Status]) -> Status:
    """The job's Status from its shards' (one status is returned as it is).

    Fragments come from their owners (a fragment two answers list is taken from the one
    whose `shard` matches, else the higher version); versions, merges, contributions,
    refusals and bytes add up; `tokens_merged` is the sum over all fragments over P (as one
    synchronizer averages); learners merge by id (`merge_learners`); goodput is compute over
    uptime of the merged rows, and the merged-work ratio `tokens_merged` over the slots'
    tokens computed (ledger.py's definitions); mean staleness is weighted by contributions;
    xi: step the slowest (max), quorum and sync the mean over shards. The token budget
    (budget.py): the job is finished as soon as any shard is (each shard's count estimates
    the job's, and learners stop on the first shard's `finished`), its progress is then 1,
    else the merged fragments' tokens over the budget; the time left is the shortest any
    shard estimates. The evaluation is the latest any shard holds (evaluators post to shard 0)."""
    if not statuses:
        raise ValueError("merge_statuses needs at least one shard's status")
    if len(statuses) == 1:
        return statuses[0]
    by_index: dict[int, FragmentStatus] = {}
    for s in statuses:
        for f in s.fragments:
            old = by_index.get(f.index)
            if old is None or (old.shard != s.shard and f.version > old.version):
                by_index[f.index] = f.model_copy(update={"shard": s.shard})
    fragments = [by_index[i] for i in sorted(by_index)]
    rows: dict[str, list[LearnerStatus]] = {}
    for s in statuses:
        for r in s.learners:
            rows.setdefault(r.learner_id, []).append(r)
    learners = [merge_learners(rows[k]) for k in sorted(rows)]
    tokens_merged = sum(f.tokens_merged for f in fragments) // max(1, len(fragments))
    merges = sum(s.merges for s in statuses)
    contributions = sum(s.contributions_merged for s in statuses)
    refusals: dict[str, int] = {}
    for s in statuses:
        for k, v in s.refusals.items():
            refusals[k] = refusals.get(k, 0) + v
    compute = sum(r.compute_seconds for r in learners)
    uptime = sum(r.uptime_seconds for r in learners)
    computed = sum(r.tokens_computed for r in learners)
    staleness_w = sum(s.mean_staleness * s.contributions_merged for s in statuses)
    total_tokens = max(s.total_tokens for s in statuses)
    finished = any(s.finished for s in statuses)
    estimates = [
        s.estimated_remaining_seconds for s in statuses if s.estimated_remaining_seconds is not None
    ]
    scale_w = sum(s.mean_merge_scale * s.merges for s in statuses)
    return Status(
        initialized=all(s.initialized for s in statuses),
        global_version=sum(f.version for f in fragments),
        merges=merges,
        tokens_merged=tokens_merged,
        contributions_merged=contributions,
        contributions_rejected=sum(s.contributions_rejected for s in statuses),
        refusals=refusals,
        merges_refused=sum(s.merges_refused for s in statuses),
        mean_contributors=contributions / merges if merges else 0.0,
        mean_staleness=staleness_w / contributions if contributions else 0.0,
        mean_merge_scale=scale_w / merges if merges else 1.0,
        bytes_up=sum(s.bytes_up for s in statuses),
        bytes_down=sum(s.bytes_down for s in statuses),
        goodput=compute / uptime if uptime > 0 else None,
        merged_work_ratio=min(1.0, tokens_merged / computed) if computed > 0 else None,
        fragments=fragments,
        learners=learners,
        xi={
            "step": _xi(statuses, "step", max),
            "quorum": _xi(statuses, "quorum", statistics.fmean),
            "sync": _xi(statuses, "sync", statistics.fmean),
        },
        shard=0,
        shards=max(s.shards for s in statuses),
        total_tokens=total_tokens,
        progress=(1.0 if finished else min(1.0, tokens_merged / total_tokens))
        if total_tokens
        else None,
        estimated_remaining_seconds=(0.0 if finished else min(estimates))
        if total_tokens and (finished or estimates)
        else None,
        finished=finished,
        evaluation=max(
            (s.evaluation for s in statuses if s.evaluation is not None),
            key=lambda e: e.time,
            default=None,
        ),
    )
