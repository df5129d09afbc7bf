"""The learners the synchronizer knows: their records and the job's totals, and the ledger
that keeps both on disk (`Learners`, owned by the service).

    learners.join(req, now, waiting)    # a record for the slot, its next incarnation
    learners.beat(hb, now, initialized) # a heartbeat's report in its record
    learners.save()                     # every changed record and the totals, durably

What a learner is told is durable before the answer where handing it out twice would be
wrong: an incarnation, a data position (learner/corpus.py); the service saves before it
answers.

What a learner can make the synchronizer keep is bounded, whatever it sends and however
often: at most `max_learners` records (a new id beyond that is refused unless a retired
record that holds nothing makes room), per-fragment lists no longer than the layout, and
numbers in range (protocol.py). A record changed is marked `dirty`; a save writes the
changed records alone (ledgerdb.py), not the whole ledger. A dropped record's incarnation
count lives on as the job-wide `dropped_incarnation`: a new record starts above every
incarnation a dropped one had, so no (learner id, incarnation) is ever issued twice.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

from ddiloco.synchronizer import ledger
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.contribution import Contribution
from ddiloco.synchronizer.ledger import MAX_TOTAL, MAX_TOTAL_SECONDS, LearnerRecord
from ddiloco.synchronizer.merge import MergeOutcome, cap_counters
from ddiloco.synchronizer.storage.state import StateStore
from ddiloco.wire.errors import PayloadError, Refusal, SyncError
from ddiloco.wire.protocol import (
    MAX_COUNT,
    MAX_DATA_POSITION,
    Heartbeat,
    JoinRequest,
    UpdateMeta,
)

log = logging.getLogger(__name__)

__all__ = ["Learners"]

PER_FRAGMENT = ("steps", "tokens", "base_versions", "known_versions", "known_requested")
"""A heartbeat's lists indexed by fragment: none may be longer than the layout."""


class Learners(Mapping[str, LearnerRecord]):
    """The learner records by id (a read-only mapping), the job's totals and refusal counts,
    and their saving. Every method but `save` runs with the service's `lock` held (it takes
    it: an RLock)."""

    def __init__(
        self,
        settings: SyncSettings,
        store: StateStore,
        lock: AbstractContextManager[Any],
        clock: Callable[[], float],
        counter_cap_steps: float | None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.lock = lock
        self.clock = clock
        self.counter_cap_steps = counter_cap_steps
        self.started = clock()
        """When this process started: a learner not heard since counts as heard then, for
        its retirement (`retire_after_s`)."""
        self.save_lock = threading.Lock()
        """Orders ledger writes: the snapshot is taken and written under it."""
        saved = store.load_ledger()
        self.records: dict[str, LearnerRecord] = ledger.load_records(saved["learners"])
        self.dirty: set[str] = set()
        """Learner ids whose records changed since the ledger last saved them."""
        self.dropped: set[str] = set()
        """Learner ids whose records were dropped and whose rows the next save deletes."""
        self.totals: dict = {
            "bytes_up": 0,
            "bytes_down": 0,
            "merged_contributors": 0,
            "merge_scale_sum": 0.0,
            "merges_scaled": 0,
            "staleness_sum": 0,
            "merges_refused": 0,
            "dropped_incarnation": 0,
        }
        """The job's counts, saved with the records."""
        totals, refusals = ledger.load_totals(saved["totals"])
        self.totals.update(totals)
        self.refusals: Counter[str] = Counter(refusals)
        """Refused requests, by kind."""

    # ---- the mapping ----------------------------------------------------------------
    def __getitem__(self, learner_id: str) -> LearnerRecord:
        return self.records[learner_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    # ---- the ledger -----------------------------------------------------------------
    def save(self) -> None:
        """Write every record changed since the last save, the dropped records' deletions
        and the totals, durably; under `save_lock`, so saves land in the order their
        contents were taken (a record marked before a save began is on disk when it ends)."""
        with self.save_lock:
            with self.lock:
                ids, drop = self.dirty, self.dropped
                self.dirty, self.dropped = set(), set()
                rows = {i: ledger.record_row(self.records[i]) for i in ids if i in self.records}
                totals = {**self.totals, "refusals": dict(self.refusals)}
            try:
                self.store.save_ledger(rows, totals, sorted(drop - set(rows)))
            except BaseException:
                with self.lock:  # not written: the next save writes them
                    self.dirty |= ids
                    self.dropped |= drop
                raise

    def known(self, learner_id: str) -> LearnerRecord:
        """The record of a learner that joined; refused (unknown learner) otherwise."""
        rec = self.records.get(learner_id)
        if rec is None:
            raise SyncError(
                Refusal.UNKNOWN_LEARNER,
                f"learner {learner_id!r} has not joined; POST /v1/join first",
            )
        return rec

    def is_retired(self, rec: LearnerRecord, now: float) -> bool:
        """Unheard for `retire_after_s` (at least `liveness_s`), counting from this
        process's start for a record not heard since: left out of status and metrics."""
        s = self.settings
        heard = max(rec.last_seen, self.started)
        return now - heard > max(s.retire_after_s, s.liveness_s)

    def listed(self, now: float) -> dict[str, LearnerRecord]:
        """The records status and metrics show: every one not retired."""
        with self.lock:
            return {k: r for k, r in self.records.items() if not self.is_retired(r, now)}

    def _make_room(self, learner_id: str, waiting: set[str]) -> str | None:
        """Before a record for a new id: refuse (409) at `max_learners` records, unless a
        retired record that holds nothing (`ledger.droppable`, not `waiting` in a round or a
        merge) can go; returns the id dropped, if any."""
        cap = self.settings.max_learners
        if len(self.records) < cap:
            return None
        now = self.clock()
        candidates = [
            r
            for k, r in self.records.items()
            if self.is_retired(r, now) and ledger.droppable(r) and k not in waiting
        ]
        if candidates:  # the one unheard the longest
            r = min(candidates, key=lambda r: r.last_seen)
            del self.records[r.learner_id]
            self.dirty.discard(r.learner_id)
            self.dropped.add(r.learner_id)
            floor = max(int(self.totals["dropped_incarnation"]), r.incarnation)
            self.totals["dropped_incarnation"] = floor
            log.info("Dropped retired learner %s's empty record for %s", r.learner_id, learner_id)
            return r.learner_id
        raise SyncError(
            Refusal.CONFLICT,
            f"this synchronizer keeps at most {cap} learner records (max_learners) and "
            f"holds {len(self.records)}, none of them retired and empty: learner "
            f"{learner_id!r} is new and cannot join. Reuse a slot's learner id, or raise "
            "DDILOCO_MAX_LEARNERS",
        )

    # ---- what learners say ----------------------------------------------------------
    def check_join(self, req: JoinRequest) -> None:
        """Refuse (422) a join that declares more tokens per step than allowed."""
        limit = self.settings.max_tokens_per_step
        if req.tokens_per_step is not None and req.tokens_per_step > limit:
            raise PayloadError(
                f"tokens_per_step {req.tokens_per_step} exceeds this synchronizer's "
                f"max_tokens_per_step {limit} (DDILOCO_MAX_TOKENS_PER_STEP)"
            )

    def join(
        self,
        req: JoinRequest,
        waiting: Callable[[], set[str]],
        forget: Callable[[str], None],
    ) -> tuple[LearnerRecord, int]:
        """The slot's record (new if need be: `waiting()`, the ids in a round or a merge,
        are never dropped to make room; `forget` is told a dropped one's id) with its next
        incarnation, and its data reservation taken; returns it and the data position it
        resumes at. Saved by the caller before it answers."""
        with self.lock:
            rec = self.records.get(req.learner_id)
            if rec is None:
                if len(self.records) >= self.settings.max_learners:
                    dropped = self._make_room(req.learner_id, waiting())
                    if dropped is not None:
                        forget(dropped)
                floor = int(self.totals["dropped_incarnation"])
                rec = self.records[req.learner_id] = LearnerRecord(req.learner_id, floor)
            if rec.incarnation >= MAX_COUNT:
                raise SyncError(
                    Refusal.CONFLICT,
                    f"learner {req.learner_id!r} has joined {rec.incarnation} times: no "
                    "incarnation is left to issue; give the slot a new learner id",
                )
            if rec.incarnation:
                rec.past_compute_seconds = min(
                    MAX_TOTAL_SECONDS, rec.past_compute_seconds + rec.compute_seconds
                )
                rec.past_uptime_seconds = min(
                    MAX_TOTAL_SECONDS, rec.past_uptime_seconds + rec.uptime_seconds
                )
                rec.compute_seconds = rec.uptime_seconds = 0.0
                rec.past_tokens_total = min(MAX_TOTAL, rec.past_tokens_total + rec.tokens_total)
                rec.tokens_total = 0
            rec.incarnation = max(rec.incarnation + 1, req.incarnation_floor)
            rec.tokens_per_step = req.tokens_per_step or 0
            rec.last_seen = self.clock()
            # the slot resumes where it was counted; the joiner reserves what it will draw
            # before its first heartbeat can report it (learner/corpus.py)
            resume = rec.data_position
            rec.data_position = min(MAX_DATA_POSITION, resume + req.data_reserve)
            self.dirty.add(req.learner_id)
            return rec, resume

    @staticmethod
    def check_lists(hb: Heartbeat, fragments: int | None) -> None:
        """Refuse (422, naming the field) a per-fragment list longer than the layout's
        `fragments` (None: no layout yet, nothing to check against)."""
        if fragments is None:
            return
        for name in PER_FRAGMENT:
            got = len(getattr(hb, name))
            if got > fragments:
                raise PayloadError(
                    f"heartbeat field {name} has {got} entries; the job has {fragments} fragments"
                )

    def beat(self, hb: Heartbeat, initialized: bool) -> bool:
        """A heartbeat's report in the learner's record; returns whether its data position
        advanced (a new reservation: saved before it is answered, learner/corpus.py)."""
        with self.lock:
            rec = self.known(hb.learner_id)
            rec.last_seen = self.clock()
            rec.step, rec.tokens_total, rec.step_seconds = hb.step, hb.tokens_total, hb.step_seconds
            rec.compute_seconds, rec.uptime_seconds = hb.compute_seconds, hb.uptime_seconds
            # the counters matter once there are rounds to request (after init)
            rec.loss, rec.steps = hb.loss, (hb.steps if initialized else [])
            advanced = hb.data_position > rec.data_position
            rec.data_position = max(rec.data_position, hb.data_position)
            # saved with the next ledger write (a data position's, at least every reservation)
            rec.slot_steps = max(rec.slot_steps, hb.slot_step)
            self.dirty.add(hb.learner_id)
            return advanced

    def noted(self, meta: UpdateMeta) -> None:
        """An update of the learner's is in its round: its (capped) tokens are what it hands
        over per period (`merge_scale = live`). The caller holds the lock."""
        if (rec := self.records.get(meta.learner_id)) is not None:
            rec.period_tokens = cap_counters(meta.tokens, meta.steps, self.counter_cap_steps)[0]

    def credit(self, taken: dict[str, Contribution], outcome: MergeOutcome | None) -> None:
        """A merge of `taken` (`outcome` None: nothing weighed) in the records and totals."""
        with self.lock:
            for learner_id in taken:
                if learner_id in self.records:
                    self.records[learner_id].contributions += 1
                    self.dirty.add(learner_id)  # its counts, and its period's tokens
            if outcome is not None:
                items = list(taken.items())
                for i in outcome.included:
                    learner_id, c = items[i]
                    if learner_id in self.records:
                        self.records[learner_id].fragment_tokens_merged += c.tokens
                self.totals["merged_contributors"] += outcome.contributors
                self.totals["staleness_sum"] += outcome.staleness
                self.totals["merge_scale_sum"] += outcome.scale
                self.totals["merges_scaled"] += 1

    def count(self, key: str, n: int | float = 1) -> None:
        """Add `n` to the total `key` (bytes up and down, merges refused)."""
        with self.lock:
            self.totals[key] += n

    def reject(self, kind: Refusal | str = Refusal.INVALID) -> None:
        with self.lock:
            self.refusals[str(kind)] += 1

    def mean_merge_scale(self) -> float:
        """Over the merges counted (1 before any)."""
        counted = self.totals["merges_scaled"]
        return self.totals["merge_scale_sum"] / counted if counted else 1.0
