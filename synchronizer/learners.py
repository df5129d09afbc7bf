"""The learner calls of `Synchronizer`: join, heartbeat, poll, and the ledger behind them.

A mixin, as merging.py is: its methods read and write the synchronizer's state (`learners`,
`rounds`, `layout`, `store`, ...), set up in service.py. What a learner is told here is
durable before the answer where handing it out twice would be wrong: an incarnation, a data
position (learner/corpus.py).

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

from ddiloco.synchronizer import ledger
from ddiloco.synchronizer.ledger import MAX_TOTAL, MAX_TOTAL_SECONDS, LearnerRecord
from ddiloco.wire.errors import PayloadError, Refusal, SyncError
from ddiloco.wire.protocol import (
    MAX_COUNT,
    MAX_DATA_POSITION,
    Heartbeat,
    HeartbeatResponse,
    JoinRequest,
    JoinResponse,
    ModelSpec,
)

log = logging.getLogger(__name__)

__all__ = ["Learners"]

PER_FRAGMENT = ("steps", "tokens", "base_versions", "known_versions", "known_requested")
"""A heartbeat's lists indexed by fragment: none may be longer than the layout."""


class Learners:
    """The learner calls of `Synchronizer` (a mixin: see the module docstring)."""

    def _save_ledger(self) -> None:
        """Write every record changed since the last save, the dropped records' deletions
        and the totals, durably; under `ledger_lock`, so saves land in the order their
        contents were taken (a record marked before a save began is on disk when it ends)."""
        with self.ledger_lock:
            with self.lock:
                ids, drop = self.dirty, self.dropped
                self.dirty, self.dropped = set(), set()
                rows = {i: ledger.record_row(self.learners[i]) for i in ids if i in self.learners}
                totals = {**self.totals, "refusals": dict(self.refusals)}
            try:
                self.store.save_ledger(rows, totals, sorted(drop - set(rows)))
            except BaseException:
                with self.lock:  # not written: the next save writes them
                    self.dirty |= ids
                    self.dropped |= drop
                raise

    def _learner(self, learner_id: str) -> LearnerRecord:
        rec = self.learners.get(learner_id)
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
        """The records status and metrics show: every one not retired (the caller holds
        the lock)."""
        return {k: r for k, r in self.learners.items() if not self.is_retired(r, now)}

    def _make_room(self, learner_id: str) -> None:
        """Before a record for a new id: refuse (409) at `max_learners` records, unless a
        retired record that holds nothing (`ledger.droppable`, in no open round) can go;
        the caller holds the lock."""
        cap = self.settings.max_learners
        if len(self.learners) < cap:
            return
        now = self.clock()
        waiting = {k for r in self.rounds.rounds for k in r.contributions}
        waiting |= {k for m in self.merging for k in m}
        candidates = [
            r
            for k, r in self.learners.items()
            if self.is_retired(r, now) and ledger.droppable(r) and k not in waiting
        ]
        if candidates:  # the one unheard the longest
            r = min(candidates, key=lambda r: r.last_seen)
            del self.learners[r.learner_id]
            self.rounds.forget(r.learner_id)
            self.dirty.discard(r.learner_id)
            self.dropped.add(r.learner_id)
            floor = max(int(self.totals["dropped_incarnation"]), r.incarnation)
            self.totals["dropped_incarnation"] = floor
            log.info("Dropped retired learner %s's empty record for %s", r.learner_id, learner_id)
            return
        raise SyncError(
            Refusal.CONFLICT,
            f"this synchronizer keeps at most {cap} learner records (max_learners) and "
            f"holds {len(self.learners)}, none of them retired and empty: learner "
            f"{learner_id!r} is new and cannot join. Reuse a slot's learner id, or raise "
            "DDILOCO_MAX_LEARNERS",
        )

    def join(self, req: JoinRequest) -> JoinResponse:
        limit = self.settings.max_tokens_per_step
        if req.tokens_per_step is not None and req.tokens_per_step > limit:
            raise PayloadError(
                f"tokens_per_step {req.tokens_per_step} exceeds this synchronizer's "
                f"max_tokens_per_step {limit} (DDILOCO_MAX_TOKENS_PER_STEP)"
            )
        with self.lock:
            digest = self.layout.digest() if self.layout else None
            if digest and req.layout_digest and req.layout_digest != digest:
                raise SyncError(
                    Refusal.CONFLICT,
                    f"layout digest {req.layout_digest} differs from the "
                    f"job's {digest}: same model, P and fragment rule on every learner"
                    f"{self.origin_note()}",
                )
            rec = self.learners.get(req.learner_id)
            if rec is None:
                self._make_room(req.learner_id)
                floor = int(self.totals["dropped_incarnation"])
                rec = self.learners[req.learner_id] = LearnerRecord(req.learner_id, floor)
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
            self.rounds.heard(req.learner_id)
            incarnation = rec.incarnation
            # the slot resumes where it was counted; the joiner reserves what it will draw
            # before its first heartbeat can report it (learner/corpus.py)
            resume = rec.data_position
            rec.data_position = min(MAX_DATA_POSITION, resume + req.data_reserve)
            slot_steps = rec.slot_steps  # where the slot's LR schedule resumes
            finished = self.finished()
            merged = self.tokens_merged()
            self.dirty.add(req.learner_id)
        # durable before the answer: an incarnation (and a data position) is never handed
        # out twice
        self._save_ledger()
        log.info(
            "Learner joined learner=%s incarnation=%d host=%s",
            req.learner_id,
            incarnation,
            req.host,
        )
        return JoinResponse(
            initialized=self.layout is not None,
            layout_digest=digest,
            versions=self.versions(),
            incarnation=incarnation,
            data_position=resume,
            update_encodings=list(self.settings.update_encodings),
            shard=self.settings.shard,
            shards=self.settings.shards,
            owned=list(self.owned),
            upload_port=self.upload_port,
            broadcast_encoding=self.settings.broadcast_encoding,
            slot_steps=slot_steps,
            finished=finished,
            total_tokens=self.budget.total,
            tokens_merged=merged,
        )

    def _check_lists(self, hb: Heartbeat) -> None:
        """Refuse (422, naming the field) a per-fragment list longer than the layout."""
        if self.layout is None:
            return
        n = len(self.layout.fragments)
        for name in PER_FRAGMENT:
            got = len(getattr(hb, name))
            if got > n:
                raise PayloadError(
                    f"heartbeat field {name} has {got} entries; the job has {n} fragments"
                )

    def heartbeat(self, hb: Heartbeat) -> HeartbeatResponse:
        self._check_lists(hb)
        with self.lock:
            rec = self._learner(hb.learner_id)
            rec.last_seen = self.clock()
            rec.step, rec.tokens_total, rec.step_seconds = hb.step, hb.tokens_total, hb.step_seconds
            rec.compute_seconds, rec.uptime_seconds = hb.compute_seconds, hb.uptime_seconds
            # the counters matter once there are rounds to request (after init)
            rec.loss, rec.steps = hb.loss, (hb.steps if self.layout is not None else [])
            self.rounds.heard(hb.learner_id, hb.step_seconds)
            advanced = hb.data_position > rec.data_position
            rec.data_position = max(rec.data_position, hb.data_position)
            # saved with the next ledger write (a data position's, at least every reservation)
            rec.slot_steps = max(rec.slot_steps, hb.slot_step)
            self.dirty.add(hb.learner_id)
        if advanced:  # a new reservation is durable before it is answered (learner/corpus.py)
            self._save_ledger()
        return self.poll(hb.learner_id)

    def model_spec(self) -> ModelSpec:
        """What the job trains, as its init upload said (kind `unknown` if it said nothing)."""
        if self.layout is None:
            raise SyncError(
                Refusal.NOT_INITIALIZED, "no global model yet: the first learner uploads it"
            )
        return self.model or ModelSpec()

    def poll(self, learner_id: str) -> HeartbeatResponse:
        """What a learner should know now: versions, and rounds it could still join."""
        with self.lock:
            steps = self.learners[learner_id].steps
            requested = [
                p
                for p in self.rounds.collecting()
                if learner_id not in self.rounds.rounds[p].contributions
                and p < len(steps)
                and steps[p] > 0
            ]
            return HeartbeatResponse(
                versions=self.versions(),
                requested=requested,
                finished=self.finished(),
                tokens_merged=self.tokens_merged(),
            )

    @staticmethod
    def news(hb: Heartbeat, resp: HeartbeatResponse) -> bool:
        return resp.versions != hb.known_versions or set(resp.requested) != set(hb.known_requested)
