"""Learner slot bookkeeping: one record per slot in memory, a few compact fields per group in
the status, and the data part each slot trains.

    books = slots.decode(job.status.groups)          # {(group, index): Slot}
    count, reshard = slots.allocate_shards(job, books)
    group_status = slots.encode(group_status, [books[(g, i)] for i in range(replicas)])

Why compact: the status is one object in etcd (about 1.5 MiB with everything else). An object
per slot (`{"id": ..., "podUid": ...}`, and a managedFields entry for each) made 1.8 MB at the
CRD's largest spec (16 groups x 512 replicas) and was refused. Per group the status holds lists
and index ranges instead (`shards`, `slotReplacements`, `liveSlots`, `failedSlots`), a few KiB
at 512 slots; `status.slots` lists at most 32 unhealthy slots for people to read.

What a slot's record needs to be crash-safe without a pod uid: each pod carries the slot's
attempt number (label ddiloco.dev/attempt: 0 for the first pod, n for the n-th replacement).
A failure is recorded for the attempt `replacements`; a pod with a higher attempt is the
replacement, and counting it sets `replacements` to its attempt.

Data parts (DDILOCO_LEARNER_INDEX of DDILOCO_NUM_LEARNERS for the learner; learner/data.py
cuts the corpus into that many contiguous parts). The count is fixed in `status.dataParts`
when the job starts: `spec.training.dataParts`, else the total replicas then. Each slot gets
the lowest shard no other slot of the spec holds, once; its replacements keep it; scaling a
slot away frees it for the next new slot. So two live learners never train the same shard,
whatever the order of scaling. When that cannot hold (a scale-up past the count with
dataParts unset, or a changed dataParts) the job divides the data again: the count becomes the new value,
every slot gets shard = its position (groups in spec order), and every learner pod whose label
says otherwise is deleted and recreated on its new shard (not counted as a failure).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ddiloco.operator import builders
from ddiloco.operator.api import (
    MAX_SLOT_DETAIL,
    DecoupledDiLoCoJob,
    FailedSlots,
    GroupStatus,
    SlotStatus,
)

MAX_REASON = 64  # a failure reason as kept in the status
MAX_FAILURE_ENTRIES = 16  # failedSlots entries per group


@dataclass(frozen=True)
class Slot:
    """One learner slot's books, as reconcile works with them."""

    group: str
    index: int
    seen: bool = False  # its current pod was seen (so its vanishing is a failure)
    failed: bool = False  # pod `replacements` failed; its replacement is pending or refused
    replacements: int = 0
    reason: str | None = None  # of the last failure
    time: str | None = None  # of the last failure
    shard: int | None = None

    @property
    def id(self) -> str:
        return builders.learner_id(self.group, self.index)

    def update(self, **changes: object) -> Slot:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- index ranges


def index_ranges(indexes: Iterable[int]) -> str:
    """Sorted ranges, as a Job's completedIndexes: [0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(set(indexes)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(_run(run))
        run = [i]
    if run:
        out.append(_run(run))
    return ",".join(out)


def _run(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def parse_ranges(text: str) -> set[int]:
    """The inverse of index_ranges; parts that do not parse are ignored."""
    out: set[int] = set()
    for part in (text or "").split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            a = int(lo)
            b = int(hi) if hi else a
        except ValueError:
            continue
        out.update(range(a, min(b, a + 100_000) + 1))
    return out


# --------------------------------------------------------------------------- status <-> books


def decode(groups: Iterable[GroupStatus]) -> dict[tuple[str, int], Slot]:
    """Every slot the status has books for, by (group, index)."""
    books: dict[tuple[str, int], Slot] = {}
    for g in groups:
        live = parse_ranges(g.live_slots)
        failed: dict[int, FailedSlots] = {}
        for f in g.failed_slots:
            failed.update(dict.fromkeys(parse_ranges(f.slots), f))
        count = max(
            [len(g.parts), len(g.slot_replacements), *(i + 1 for i in live | failed.keys())]
        )
        for i in range(count):
            f = failed.get(i)
            books[(g.name, i)] = Slot(
                group=g.name,
                index=i,
                seen=i in live,
                failed=f is not None,
                replacements=g.slot_replacements[i] if i < len(g.slot_replacements) else 0,
                reason=f.reason if f else None,
                time=f.time if f else None,
                shard=g.parts[i] if i < len(g.parts) and g.parts[i] >= 0 else None,
            )
    return books


def encode(group: GroupStatus, slots: Sequence[Slot]) -> GroupStatus:
    """The group's status with the books of `slots` (its slots 0..n-1, in order)."""
    failed: dict[tuple[str, str], list[int]] = {}
    for s in slots:
        if s.failed:
            key = ((s.reason or "Failed")[:MAX_REASON], s.time or "")
            failed.setdefault(key, []).append(s.index)
    repl = [s.replacements for s in slots]
    return group.model_copy(
        update={
            "parts": [-1 if s.shard is None else s.shard for s in slots],
            "slot_replacements": repl if any(repl) else [],
            "live_slots": index_ranges(s.index for s in slots if s.seen),
            "failed_slots": [
                FailedSlots(slots=index_ranges(idx), reason=reason, time=time)
                for (reason, time), idx in sorted(_fold(failed).items(), key=lambda kv: kv[1][0])
            ],
        }
    )


def _fold(failed: dict[tuple[str, str], list[int]]) -> dict[tuple[str, str], list[int]]:
    """At most MAX_FAILURE_ENTRIES (reason, time) entries: past that, one entry per reason at
    its latest time (a replacement may wait up to that much longer, never less), and past
    that the rarest reasons as one "Various" (each slot's own reason is in its event)."""
    if len(failed) <= MAX_FAILURE_ENTRIES:
        return failed
    by_reason: dict[str, tuple[str, list[int]]] = {}
    for (reason, time), idx in failed.items():
        last, have = by_reason.get(reason, ("", []))
        by_reason[reason] = (max(last, time), have + idx)
    ranked = sorted(by_reason.items(), key=lambda kv: -len(kv[1][1]))
    keep, rest = ranked[: MAX_FAILURE_ENTRIES - 1], ranked[MAX_FAILURE_ENTRIES - 1 :]
    out = {(reason, time): idx for reason, (time, idx) in keep}
    if len(rest) == 1:
        reason, (time, idx) = rest[0]
        out[(reason, time)] = idx
    elif rest:
        time = max(t for _, (t, _) in rest)
        out[("Various", time)] = sorted(i for _, (_, idx) in rest for i in idx)
    return out


def detail(slots: Iterable[Slot], limit: int) -> tuple[list[SlotStatus], int]:
    """Up to MAX_SLOT_DETAIL unhealthy slots for status.slots (those at the replacement limit
    first, then the latest failures), and how many there are in all."""
    bad = [s for s in slots if s.failed]
    at_limit = [s for s in bad if s.replacements >= limit]
    waiting = sorted(
        (s for s in bad if s.replacements < limit), key=lambda s: s.time or "", reverse=True
    )
    chosen = (at_limit + waiting)[:MAX_SLOT_DETAIL]
    return [
        SlotStatus(
            id=s.id,
            replacements=s.replacements,
            last_failure_reason=(s.reason or "Failed")[:MAX_REASON],
            last_failure_time=s.time,
            limit_reached=s.replacements >= limit,
        )
        for s in chosen
    ], len(bad)


# --------------------------------------------------------------------------- data parts


def allocate_shards(
    job: DecoupledDiLoCoJob, books: dict[tuple[str, int], Slot]
) -> tuple[int, bool]:
    """Give every slot of the spec a data part (in `books`, in place); returns the shard
    count and whether this pass divides the data again (see the module docstring)."""
    spec = job.spec
    wanted = [(g.name, i) for g in spec.learner_groups for i in range(g.replicas)]
    total, asked = len(wanted), spec.training.data_parts
    count = job.status.data_parts or asked or max(1, total)
    reshard = False
    if asked is not None and asked != count:
        count, reshard = asked, True
    elif total > count:
        count, reshard = total, True
    if reshard:
        for n, key in enumerate(wanted):
            books[key] = (books.get(key) or Slot(*key)).update(shard=n)
        return count, True
    taken: set[int] = set()
    for key in wanted:  # keep each slot's shard unless it is out of range or held already
        rec = books.get(key)
        if rec is None:
            continue
        if rec.shard is not None and rec.shard < count and rec.shard not in taken:
            taken.add(rec.shard)
        else:
            books[key] = rec.update(shard=None)
    free = (n for n in range(count) if n not in taken)
    for key in wanted:
        rec = books.get(key) or Slot(*key)
        if rec.shard is None:
            books[key] = rec.update(shard=next(free))
    return count, False
