"""The learner ledger: what the synchronizer remembers of each learner slot.

A record survives restarts of its learner (incarnations) and of the synchronizer (it is
saved in ledger.json); goodput here is the learners' own account, compute time over uptime
summed over incarnations (a slot's dead time between incarnations is not seen from here;
`ddiloco local` and the bench count it from the process timeline). It also keeps each
slot's data position, the highest its learners reported (learner/corpus.py), where a
replacement's data stream resumes.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

from ddiloco.synchronizer.protocol import LearnerStatus


@dataclass
class LearnerRecord:
    learner_id: str
    incarnation: int = 0
    contributions: int = 0
    step: int = 0
    tokens_total: int = 0
    step_seconds: float = 0.0
    compute_seconds: float = 0.0
    uptime_seconds: float = 0.0
    past_compute_seconds: float = 0.0
    past_uptime_seconds: float = 0.0
    past_tokens_total: int = 0
    """Tokens the slot's earlier incarnations reported (`tokens_total`: the current one's)."""
    fragment_tokens_merged: int = 0
    """Tokens of the slot's merged contributions, summed over fragments (each fragment sees
    every token, so / P is the slot's merged tokens). Its heartbeats lag its updates: the
    tokens it computed are at least these (`tokens_computed`)."""
    loss: float | None = None
    period_tokens: int = 0
    """The (capped) tokens of the slot's last accepted update: what it hands over per period,
    the live set's share in `merge_scale = live` (kept in ledger.json, so a restarted
    synchronizer scales its first merges as the last ones)."""
    data_position: int = 0
    """The highest data position the slot reported or reserved at join (windows of its data
    stream, learner/corpus.py); a replacement resumes there."""
    last_seen: float = field(default=-1e18, repr=False)
    steps: list[int] = field(default_factory=list, repr=False)


def tokens_computed(r: LearnerRecord, fragments: int) -> float:
    """What the slot computed, all incarnations: what it reported, or more if more of its
    work was already merged (a heartbeat reports tokens a little after the updates carry
    them, so at any moment the merged tokens may run ahead of the reported ones)."""
    return max(r.past_tokens_total + r.tokens_total, r.fragment_tokens_merged / max(1, fragments))


def learner_statuses(
    learners: dict[str, LearnerRecord], live: set[str], now: float, fragments: int = 1
) -> list[LearnerStatus]:
    return [
        LearnerStatus(
            learner_id=r.learner_id,
            alive=r.learner_id in live,
            incarnation=r.incarnation,
            step=r.step,
            tokens_total=r.tokens_total,
            step_seconds=r.step_seconds,
            compute_seconds=r.past_compute_seconds + r.compute_seconds,
            uptime_seconds=r.past_uptime_seconds + r.uptime_seconds,
            contributions=r.contributions,
            loss=r.loss,
            data_position=r.data_position,
            tokens_computed=int(tokens_computed(r, fragments)),
            last_seen_s=max(0.0, now - r.last_seen) if r.last_seen > -1e17 else -1.0,
        )
        for r in sorted(learners.values(), key=lambda r: r.learner_id)
    ]


def goodput(learners: dict[str, LearnerRecord]) -> float | None:
    compute = sum(r.past_compute_seconds + r.compute_seconds for r in learners.values())
    uptime = sum(r.past_uptime_seconds + r.uptime_seconds for r in learners.values())
    return compute / uptime if uptime > 0 else None


def merged_work_ratio(
    learners: dict[str, LearnerRecord], tokens_merged: int, fragments: int = 1
) -> float | None:
    """Tokens merged over tokens computed by every slot (all incarnations, `tokens_computed`),
    None before any. At most 1: every merged token is some slot's, and each slot counts at
    least its merged tokens (only a crash between a merge and the ledger's save after it can
    lose a slot's last merge here, and then its heartbeats catch up)."""
    computed = sum(tokens_computed(r, fragments) for r in learners.values())
    return tokens_merged / computed if computed > 0 else None


def load_records(saved: dict[str, Any]) -> dict[str, LearnerRecord]:
    """Learner records from ledger.json; each is alive again only once it speaks."""
    out = {}
    for rec in saved.get("learners", []):
        r = LearnerRecord(
            **{k: v for k, v in rec.items() if k in LearnerRecord.__dataclass_fields__}
        )
        r.last_seen = -1e18
        out[r.learner_id] = r
    return out


def snapshot(learners: dict[str, LearnerRecord], totals: dict[str, Any]) -> dict[str, Any]:
    """What ledger.json holds: the records without their volatile fields, and the totals."""
    records = []
    for r in learners.values():
        d = asdict(r)
        d.pop("last_seen")
        d.pop("steps")
        records.append(d)
    return {"learners": records, "totals": copy.deepcopy(totals)}
