"""The synchronizer's domain logic: learners, fragments, rounds, merges, persistence.

`Synchronizer` is what the HTTP routes call; it knows nothing about HTTP. Blocking work
(decoding payloads, merging, writing state) happens in the caller's thread: the FastAPI
layer calls those methods through `asyncio.to_thread`, never on the event loop.

Failure handling (algorithm.md §5, §7): an absent learner simply does not contribute; an
update that is malformed, non-finite, from an unknown learner or based on a version more
than `max_staleness` merges old raises a `SyncError` whose message says why and is never
merged; a late one within that bound waits for the fragment's next round; re-sending an
update already accepted or merged is a no-op. State is persisted after every merge, so a
restarted synchronizer resumes at the same fragment versions.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ddiloco.synchronizer import codec, ledger
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.ledger import LearnerRecord
from ddiloco.synchronizer.merge import (
    OuterNesterov,
    cap_counters,
    contribution_weight,
    merge_fragment,
)
from ddiloco.synchronizer.protocol import (
    FragmentStatus,
    Heartbeat,
    HeartbeatResponse,
    InitResponse,
    JoinRequest,
    JoinResponse,
    Status,
    UpdateMeta,
    UpdateResponse,
)
from ddiloco.synchronizer.rounds import GracePolicy, Rounds
from ddiloco.synchronizer.state import FragmentState, StateStore

log = logging.getLogger(__name__)


class SyncError(Exception):
    """A refused request. `kind` maps to an HTTP status at the route edge."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # unknown_learner | not_initialized | stale | conflict | invalid


@dataclass
class Pending:
    """One learner's contribution to an open round. A learner that hands the fragment over
    again before the round merges adds to it: updates carry progress since the previous
    hand-over, so deltas and counters sum."""

    meta: UpdateMeta
    delta: dict[str, torch.Tensor]
    ids: list[str]

    def absorb(self, meta: UpdateMeta, delta: dict[str, torch.Tensor]) -> None:
        for k, v in delta.items():
            self.delta[k] = self.delta[k].float() + v.float()
        self.meta = self.meta.model_copy(
            update={
                "steps": self.meta.steps + meta.steps,
                "tokens": self.meta.tokens + meta.tokens,
                "base_version": min(self.meta.base_version, meta.base_version),
                "learner_step": meta.learner_step,
            }
        )
        self.ids.append(meta.update_id())


class Synchronizer:
    """State: layout, per-fragment Theta/momentum/version, open rounds, learner ledger."""

    def __init__(self, settings: SyncSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.store = StateStore(settings.state_dir)
        self.lock = threading.RLock()
        self.outer = OuterNesterov(
            lr=settings.outer_lr, momentum=settings.outer_momentum, nesterov=settings.nesterov
        )
        self.layout = self.store.load_layout()
        self.fragments: list[FragmentState] = []
        self.frag_locks: list[threading.Lock] = []
        self.served: list[tuple[int, bytes]] = []
        self.norms: list[deque[float]] = []
        self.learners: dict[str, LearnerRecord] = {}
        self.on_change: Callable[[], None] = lambda: None
        """Called (from any thread) when versions or open rounds change: wakes long polls."""
        self.totals = {
            "bytes_up": 0,
            "bytes_down": 0,
            "rejected": 0,
            "merged_contributors": 0,
            "staleness_sum": 0,
        }
        ledger = self.store.load_ledger()
        for rec in ledger.get("learners", []):
            r = LearnerRecord(
                **{k: v for k, v in rec.items() if k in LearnerRecord.__dataclass_fields__}
            )
            r.last_seen = -1e18  # alive again only once it speaks
            self.learners[r.learner_id] = r
        self.totals.update(ledger.get("totals", {}))
        self.rounds: Rounds[Pending] = Rounds(0, quorum=settings.quorum, clock=clock)
        if self.layout is not None:
            self._adopt(self.store.load_fragments(self.layout))
            log.info("Resumed state from %s: versions %s", settings.state_dir, self.versions())

    # ---- setup -------------------------------------------------------------------
    def _adopt(self, fragments: list[FragmentState]) -> None:
        s = self.settings
        self.fragments = fragments
        self.frag_locks = [threading.Lock() for _ in fragments]
        self.norms = [deque(maxlen=32) for _ in fragments]
        self.served = [self._encode(fs) for fs in fragments]
        grace = GracePolicy(
            enabled=s.grace,
            gamma=s.grace_gamma,
            cap_steps=s.grace_cap_steps,
            default_s=s.grace_default_s,
            tau=s.tau,
        )
        self.rounds = Rounds(
            len(fragments), quorum=s.quorum, grace=grace, ema_alpha=s.ema_alpha, clock=self.clock
        )

    def _encode(self, fs: FragmentState) -> tuple[int, bytes]:
        dtype = codec.WIRE_DTYPES[self.settings.broadcast_dtype]
        return fs.version, codec.encode({k: v.to(dtype) for k, v in fs.params.items()})

    def versions(self) -> list[int]:
        """Published versions: durable on disk and served (a merge in progress is not)."""
        return [version for version, _ in self.served]

    def _save_ledger(self) -> None:
        learners = []
        for r in self.learners.values():
            d = asdict(r)
            d.pop("last_seen")
            d.pop("steps")
            learners.append(d)
        self.store.save_ledger({"learners": learners, "totals": self.totals})

    def _learner(self, learner_id: str) -> LearnerRecord:
        rec = self.learners.get(learner_id)
        if rec is None:
            raise SyncError(
                "unknown_learner", f"learner {learner_id!r} has not joined; POST /v1/join first"
            )
        return rec

    def live(self) -> set[str]:
        horizon = self.clock() - self.settings.liveness_s
        return {k for k, r in self.learners.items() if r.last_seen >= horizon}

    # ---- learner calls -----------------------------------------------------------
    def join(self, req: JoinRequest) -> JoinResponse:
        with self.lock:
            digest = self.layout.digest() if self.layout else None
            if digest and req.layout_digest and req.layout_digest != digest:
                raise SyncError(
                    "conflict",
                    f"layout digest {req.layout_digest} differs from the "
                    f"job's {digest}: same model, P and fragment rule on every learner",
                )
            rec = self.learners.setdefault(req.learner_id, LearnerRecord(req.learner_id))
            if rec.incarnation:
                rec.past_compute_seconds += rec.compute_seconds
                rec.past_uptime_seconds += rec.uptime_seconds
                rec.compute_seconds = rec.uptime_seconds = 0.0
            rec.incarnation += 1
            rec.last_seen = self.clock()
            self.rounds.drop_learner(req.learner_id)
            self._save_ledger()
            log.info(
                "Learner joined learner=%s incarnation=%d host=%s",
                req.learner_id,
                rec.incarnation,
                req.host,
            )
            return JoinResponse(
                initialized=self.layout is not None,
                layout_digest=digest,
                versions=self.versions(),
                incarnation=rec.incarnation,
            )

    def init(self, payload: bytes) -> InitResponse:
        meta = codec.read_metadata(payload)
        layout = codec.layout_from_metadata(meta)
        with self.lock:
            if self.layout is not None:
                if layout.digest() != self.layout.digest():
                    raise SyncError("conflict", "already initialized with a different layout")
                return InitResponse(
                    created=False, layout_digest=self.layout.digest(), versions=self.versions()
                )
            tensors = codec.decode(payload)
            fragments = []
            for spec in layout.fragments:
                part = {t.name: tensors.get(t.name) for t in spec.tensors}
                missing = [k for k, v in part.items() if v is None]
                if missing:
                    raise codec.PayloadError(f"init payload lacks tensors {missing[:5]}")
                params = {k: v.float().clone() for k, v in part.items() if v is not None}
                codec.check_fragment(params, spec)
                fragments.append(
                    FragmentState(
                        params=params, momentum={k: torch.zeros_like(v) for k, v in params.items()}
                    )
                )
            for spec, fs in zip(layout.fragments, fragments, strict=True):
                self.store.save_fragment(spec.index, fs)
            self.store.save_layout(layout)  # written last: its presence means "initialized"
            self.layout = layout
            self._adopt(fragments)
            log.info(
                "Initialized global model fragments=%d digest=%s", len(fragments), layout.digest()
            )
            return InitResponse(
                created=True, layout_digest=layout.digest(), versions=self.versions()
            )

    def fragment(self, p: int) -> tuple[int, bytes]:
        if self.layout is None:
            raise SyncError("not_initialized", "no global model yet: the first learner uploads it")
        if not 0 <= p < len(self.fragments):
            raise SyncError(
                "invalid", f"fragment {p} does not exist (0..{len(self.fragments) - 1})"
            )
        version, body = self.served[p]
        with self.lock:
            self.totals["bytes_down"] += len(body)
        return version, body

    def submit(self, payload: bytes, path_fragment: int | None = None) -> UpdateResponse:
        try:
            meta = UpdateMeta.from_metadata(codec.read_metadata(payload))
        except codec.PayloadError:
            raise
        except ValueError as e:
            raise codec.PayloadError(f"update metadata is invalid: {e}") from None
        if path_fragment is not None and meta.fragment != path_fragment:
            raise codec.PayloadError(
                f"update says fragment {meta.fragment} but was sent to {path_fragment}"
            )
        if self.layout is None:
            raise SyncError("not_initialized", "no global model yet: nothing to update")
        if meta.fragment >= len(self.fragments):
            raise codec.PayloadError(
                f"fragment {meta.fragment} does not exist (0..{len(self.fragments) - 1})"
            )
        self._learner(meta.learner_id)
        p = meta.fragment
        with self.frag_locks[p]:
            fs = self.fragments[p]
            uid = meta.update_id()
            if uid in fs.applied:
                return UpdateResponse(status="duplicate", fragment=p, round_version=fs.version)
            pending = self.rounds.rounds[p].contributions.get(meta.learner_id)
            if pending is not None and uid in pending.ids:
                return UpdateResponse(status="duplicate", fragment=p, round_version=fs.version + 1)
            if meta.base_version > fs.version:
                raise SyncError(
                    "stale",
                    f"update of fragment {p} is based on version {meta.base_version}, which this "
                    f"synchronizer never published (it is at {fs.version}): unknown base",
                )
            limit = self.settings.max_staleness
            if meta.base_version < fs.version - limit:
                raise SyncError(
                    "stale",
                    f"update of fragment {p} is based on version {meta.base_version}, the global "
                    f"fragment is at {fs.version}: more than {limit} rounds already merged "
                    "since (max_staleness); adopt the new version",
                )
            delta = codec.decode(payload)
            codec.check_fragment(delta, self.layout.fragments[p])
            n = codec.norm(delta)
            recent = self.norms[p]
            if len(recent) >= 5 and n > self.settings.max_norm_ratio * max(
                statistics.median(recent), 1e-12
            ):
                raise codec.PayloadError(
                    f"update norm {n:.3g} exceeds {self.settings.max_norm_ratio:g}x "
                    f"the recent median {statistics.median(recent):.3g}"
                )
            recent.append(n)
            with self.lock:
                self.rounds.xi_step = self._xi_step(self.live())  # the grace window opens here
                if pending is not None:
                    pending.absorb(meta, delta)
                else:
                    pending = Pending(meta, delta, [uid])
                # a late update (older base) waits for the next round a current one starts
                fresh = meta.base_version == fs.version
                self.rounds.add(p, meta.learner_id, pending, opens=fresh)
                self.totals["bytes_up"] += len(payload)
            self.on_change()
            return UpdateResponse(status="accepted", fragment=p, round_version=fs.version + 1)

    def reject(self) -> None:
        with self.lock:
            self.totals["rejected"] += 1

    def heartbeat(self, hb: Heartbeat) -> HeartbeatResponse:
        with self.lock:
            rec = self._learner(hb.learner_id)
            rec.last_seen = self.clock()
            rec.step, rec.tokens_total, rec.step_seconds = hb.step, hb.tokens_total, hb.step_seconds
            rec.compute_seconds, rec.uptime_seconds, rec.loss = (
                hb.compute_seconds,
                hb.uptime_seconds,
                hb.loss,
            )
            rec.steps = hb.steps
            return self.poll(hb.learner_id)

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

    # ---- merging -----------------------------------------------------------------
    def _xi_step(self, live: set[str]) -> float | None:
        """Step time of the slowest live learner (algorithm.md §6.2), None before any report."""
        steps = [self.learners[k].step_seconds for k in live if self.learners[k].step_seconds > 0]
        return max(steps) if steps else None

    def due(self) -> list[int]:
        with self.lock:
            live = self.live()
            return self.rounds.due(live, xi_step=self._xi_step(live))

    def merge(self, p: int) -> int | None:
        """Merge the open round of fragment p; returns the new version (None if nothing)."""
        t0 = self.clock()
        assert self.layout is not None
        spec = self.layout.fragments[p]
        with self.frag_locks[p]:
            with self.lock:
                contribs = list(self.rounds.take(p).values())
            s = self.settings
            fs = self.fragments[p]
            deltas, weights, tokens, staleness = [], [], 0, 0
            for c in contribs:
                tok, steps = cap_counters(c.meta.tokens, c.meta.steps, s.counter_cap_steps)
                w = contribution_weight(tok, steps, s.weighting)
                if w <= 0:
                    continue
                # Outer gradient Delta_m = -delta_m: the learner's own progress. For an update
                # based on the current version this is Theta_p - theta_mp exactly; for one based
                # on an older version it is the delayed pseudo-gradient (async Local-SGD), which
                # keeps the rounds merged since instead of pulling Theta back towards its base.
                deltas.append({k: -v.float() for k, v in c.delta.items()})
                weights.append(w)
                tokens += c.meta.tokens
                staleness += fs.version - c.meta.base_version
            if not deltas:
                return None
            delta = merge_fragment(deltas, weights, spec.merge, s.rda_granularity)
            self.outer.step(fs.params, fs.momentum, delta)
            fs.version += 1
            fs.merges += 1
            fs.tokens_merged += tokens
            fs.contributions += len(deltas)
            fs.remember([uid for c in contribs for uid in c.ids])
            self.store.save_fragment(p, fs)
            self.served[p] = self._encode(fs)
            with self.lock:
                for c in contribs:
                    if c.meta.learner_id in self.learners:
                        self.learners[c.meta.learner_id].contributions += 1
                self.totals["merged_contributors"] += len(deltas)
                self.totals["staleness_sum"] += staleness
                self._save_ledger()
                self.rounds.observe_sync(self.clock() - t0)
            self.on_change()
            log.info(
                "Merged fragment=%d version=%d contributors=%d tokens=%d",
                p,
                fs.version,
                len(deltas),
                tokens,
            )
            return fs.version

    # ---- status ------------------------------------------------------------------
    def status(self) -> Status:
        with self.lock:
            now, live = self.clock(), self.live()
            merges = sum(fs.merges for fs in self.fragments)
            learners = ledger.learner_statuses(self.learners, live, now)
            frags = [
                FragmentStatus(
                    index=i,
                    merge=self.layout.fragments[i].merge if self.layout else "rda",
                    version=self.served[i][0],
                    contributors_pending=self.rounds.pending(i),
                )
                for i, fs in enumerate(self.fragments)
            ]
            return Status(
                initialized=self.layout is not None,
                global_version=sum(self.versions()),
                merges=merges,
                # every fragment sees every token: average over fragments, not a sum
                tokens_merged=sum(fs.tokens_merged for fs in self.fragments)
                // max(1, len(self.fragments)),
                contributions_merged=sum(fs.contributions for fs in self.fragments),
                contributions_rejected=int(self.totals["rejected"]),
                mean_contributors=(sum(fs.contributions for fs in self.fragments) / merges)
                if merges
                else 0.0,
                mean_staleness=(self.totals["staleness_sum"] / self.totals["merged_contributors"])
                if self.totals["merged_contributors"]
                else 0.0,
                bytes_up=int(self.totals["bytes_up"]),
                bytes_down=int(self.totals["bytes_down"]),
                goodput=ledger.goodput(self.learners),
                fragments=frags,
                learners=learners,
                xi={
                    "step": self._xi_step(live),
                    "quorum": self.rounds.xi_quorum.value,
                    "sync": self.rounds.xi_sync.value,
                },
            )
