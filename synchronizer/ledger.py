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
    loss: float | None = None
    data_position: int = 0
    """The highest data position the slot reported or reserved at join (windows of its data
    stream, learner/corpus.py); a replacement resumes there."""
    last_seen: float = field(default=-1e18, repr=False)
    steps: list[int] = field(default_factory=list, repr=False)


def learner_statuses(
    learners: dict[str, LearnerRecord], live: set[str], now: float
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
            last_seen_s=max(0.0, now - r.last_seen) if r.last_seen > -1e17 else -1.0,
        )
        for r in sorted(learners.values(), key=lambda r: r.learner_id)
    ]


def goodput(learners: dict[str, LearnerRecord]) -> float | None:
    compute = sum(r.past_compute_seconds + r.compute_seconds for r in learners.values())
    uptime = sum(r.past_uptime_seconds + r.uptime_seconds for r in learners.values())
    return compute / uptime if uptime > 0 else None


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
