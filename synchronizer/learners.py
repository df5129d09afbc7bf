"""The learner calls of `Synchronizer`: join, heartbeat, poll, and the ledger behind them.

A mixin, as merging.py is: its methods read and write the synchronizer's state (`learners`,
`rounds`, `layout`, `store`, ...), set up in service.py. What a learner is told here is
durable before the answer where handing it out twice would be wrong: an incarnation, a data
position (learner/corpus.py).
"""

from __future__ import annotations

import logging

from ddiloco.synchronizer import ledger
from ddiloco.synchronizer.errors import Refusal, SyncError
from ddiloco.synchronizer.ledger import LearnerRecord
from ddiloco.synchronizer.protocol import (
    MAX_DATA_POSITION,
    Heartbeat,
    HeartbeatResponse,
    JoinRequest,
    JoinResponse,
    ModelSpec,
)

log = logging.getLogger("ddiloco.synchronizer.service")
"""The learner calls' lines log as the synchronizer's, as before the split."""

__all__ = ["Learners"]


class Learners:
    """The learner calls of `Synchronizer` (a mixin: see the module docstring)."""

    def _save_ledger(self) -> None:
        with self.ledger_lock:
            with self.lock:
                totals = {**self.totals, "refusals": dict(self.refusals)}
                snap = ledger.snapshot(self.learners, totals)
            self.store.save_ledger(snap)

    def _learner(self, learner_id: str) -> LearnerRecord:
        rec = self.learners.get(learner_id)
        if rec is None:
            raise SyncError(
                Refusal.UNKNOWN_LEARNER,
                f"learner {learner_id!r} has not joined; POST /v1/join first",
            )
        return rec

    def join(self, req: JoinRequest) -> JoinResponse:
        with self.lock:
            digest = self.layout.digest() if self.layout else None
            if digest and req.layout_digest and req.layout_digest != digest:
                raise SyncError(
                    Refusal.CONFLICT,
                    f"layout digest {req.layout_digest} differs from the "
                    f"job's {digest}: same model, P and fragment rule on every learner",
                )
            rec = self.learners.setdefault(req.learner_id, LearnerRecord(req.learner_id))
            if rec.incarnation:
                rec.past_compute_seconds += rec.compute_seconds
                rec.past_uptime_seconds += rec.uptime_seconds
                rec.compute_seconds = rec.uptime_seconds = 0.0
                rec.past_tokens_total += rec.tokens_total
                rec.tokens_total = 0
            rec.incarnation = max(rec.incarnation + 1, req.incarnation_floor)
            rec.last_seen = self.clock()
            self.rounds.heard(req.learner_id)
            incarnation = rec.incarnation
            # the slot resumes where it was counted; the joiner reserves what it will draw
            # before its first heartbeat can report it (learner/corpus.py)
            resume = rec.data_position
            rec.data_position = min(MAX_DATA_POSITION, resume + req.data_reserve)
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
        )

    def heartbeat(self, hb: Heartbeat) -> HeartbeatResponse:
        with self.lock:
            rec = self._learner(hb.learner_id)
            rec.last_seen = self.clock()
            rec.step, rec.tokens_total, rec.step_seconds = hb.step, hb.tokens_total, hb.step_seconds
            rec.compute_seconds, rec.uptime_seconds = hb.compute_seconds, hb.uptime_seconds
            rec.loss, rec.steps = hb.loss, hb.steps
            self.rounds.heard(hb.learner_id, hb.step_seconds)
            advanced = hb.data_position > rec.data_position
            rec.data_position = max(rec.data_position, hb.data_position)
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
            return HeartbeatResponse(versions=self.versions(), requested=requested)

    @staticmethod
    def news(hb: Heartbeat, resp: HeartbeatResponse) -> bool:
        return resp.versions != hb.known_versions or set(resp.requested) != set(hb.known_requested)
