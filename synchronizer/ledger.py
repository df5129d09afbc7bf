"""The learner ledger: what the synchronizer remembers of each learner slot.

A record survives restarts of its learner (incarnations) and of the synchronizer (it is
saved in the state directory's ledger database, ledgerdb.py, a row per record written when
it changes); goodput here is the learners' own account, compute time over uptime
summed over incarnations (a slot's dead time between incarnations is not seen from here;
`ddiloco local` and the bench count it from the process timeline). It also keeps each
slot's data position, the highest its learners reported (learner/corpus.py), where a
replacement's data stream resumes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ddiloco.wire.protocol import MAX_COUNT, LearnerStatus

MAX_TOTAL = (1 << 63) - 1
"""The largest accumulated count a record or the totals hold (a sum over incarnations or
merges of bounded counts): what a loaded value is clamped to, so status never overflows."""
MAX_TOTAL_SECONDS = 1e15
"""The largest accumulated duration (or float total) kept, likewise."""


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
    tokens_per_step: int = 0
    """The tokens per inner step the slot's current incarnation declared at join (0: none
    declared, the synchronizer's `max_tokens_per_step` bounds it); its updates claim at
    most this many per step (admission.check_tokens)."""
    slot_steps: int = 0
    """The highest LR-schedule step the slot reported (`Heartbeat.slot_step`), answered at
    join: a replacement resumes its inner LR schedule there (no second warm-up)."""
    last_seen: float = field(default=-1e18, repr=False)
    steps: list[int] = field(default_factory=list, repr=False)


VOLATILE = frozenset({"last_seen", "steps"})
"""Fields of a record that are not saved: liveness and the latest per-fragment counters."""
COUNTS = frozenset(
    {"incarnation", "step", "tokens_total", "data_position", "tokens_per_step", "slot_steps"}
)
"""Fields that hold one client-sent count (at most `MAX_COUNT`)."""


def _count(value: object, limit: int) -> int:
    """`value` as an int in [0, limit] (0 when it is not a finite number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    if isinstance(value, float) and not math.isfinite(value):
        return limit if value > 0 else 0
    return int(min(max(value, 0), limit))


def _seconds(value: object, limit: float = MAX_TOTAL_SECONDS) -> float:
    """`value` as a finite float in [0, limit] (0 when it is not a finite number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    if isinstance(value, int) and abs(value) > limit:
        return limit if value > 0 else 0.0
    x = float(value)
    if not math.isfinite(x):
        return limit if x > 0 else 0.0
    return min(max(x, 0.0), limit)


def clamp_total(value: object) -> int | float:
    """A saved total as a number status can render: an int in [0, MAX_TOTAL], or a finite
    float in [0, MAX_TOTAL_SECONDS]."""
    return _seconds(value) if isinstance(value, float) else _count(value, MAX_TOTAL)


def record_from_row(row: dict[str, Any]) -> LearnerRecord:
    """A saved record, each field clamped into its range: a ledger edited by hand or damaged
    on disk cannot make status or metrics fail (its format version is checked before this,
    storage/statedir.py). It is alive again only once it speaks."""
    r = LearnerRecord(str(row.get("learner_id", "")))
    for f in fields(LearnerRecord):
        if f.name in VOLATILE or f.name == "learner_id" or f.name not in row:
            continue
        value = row[f.name]
        if f.name == "loss":
            finite = isinstance(value, (int, float)) and math.isfinite(value)
            r.loss = float(value) if finite and not isinstance(value, bool) else None
        elif f.type in ("float", float):
            setattr(r, f.name, _seconds(value))
        else:
            setattr(r, f.name, _count(value, MAX_COUNT if f.name in COUNTS else MAX_TOTAL))
    return r


def record_row(r: LearnerRecord) -> dict[str, Any]:
    """What is saved of a record: every field but the volatile ones."""
    d = asdict(r)
    for name in VOLATILE:
        d.pop(name)
    return d


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
            slot_steps=r.slot_steps,
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


def load_records(rows: Iterable[dict[str, Any]]) -> dict[str, LearnerRecord]:
    """Learner records from the saved rows (`record_from_row`), by learner id."""
    out = {}
    for row in rows:
        r = record_from_row(row)
        if r.learner_id:
            out[r.learner_id] = r
    return out


def load_totals(saved: dict[str, Any]) -> tuple[dict[str, int | float], dict[str, int]]:
    """The saved totals, clamped (`clamp_total`), and the refusal counts among them."""
    refusals = saved.get("refusals")
    counts = {
        str(k): _count(v, MAX_TOTAL)
        for k, v in (refusals.items() if isinstance(refusals, dict) else ())
    }
    totals = {str(k): clamp_total(v) for k, v in saved.items() if k != "refusals"}
    return totals, counts


def droppable(r: LearnerRecord) -> bool:
    """A record that holds nothing to keep: no data position for a replacement to resume
    at, no work reported, contributed or merged. Dropping one loses only its incarnation
    count, which the synchronizer keeps as a job-wide floor instead (learners.py)."""
    return not (
        r.data_position
        or r.slot_steps
        or r.contributions
        or r.fragment_tokens_merged
        or r.period_tokens
        or r.tokens_total
        or r.past_tokens_total
        or r.compute_seconds
        or r.past_compute_seconds
        or r.uptime_seconds
        or r.past_uptime_seconds
    )
