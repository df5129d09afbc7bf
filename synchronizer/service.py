"""The synchronizer's domain logic: learners, fragments, rounds, merges, persistence.

`Synchronizer` is what the HTTP routes call; it knows nothing about HTTP. Its methods
block (decoding, merging, fsync) and take locks, so the routes call every one of them from a
worker thread, never on the event loop.

Who owns what: `admission` decides accept / duplicate / refuse; `Rounds` owns the quorum,
the grace window and all of its inputs (liveness, step times); `MergePolicy` turns a round
into the next version; `StateStore` keeps fragments, pending updates and the ledger on disk.
The merge path (`merge`, making a merge durable, the background file writes) is the mixin
`Merging` in merging.py.

The contract: an update answered `accepted` is in the fragment's pending log on disk before
the answer, and is merged exactly once, whatever crashes: a restarted synchronizer replays
the log into the open rounds, skipping what the fragment file says it already merged, and
the per-learner order high-water marks make any re-send a `duplicate`. A merge is durable
before its version is served: a merge journal record of its inputs (journal.py; the file
written after, in the background) or its fragment file; the log's segments go once the
file holds it. A merge whose result is not finite is refused: the fragment stays as it
was and its contributions wait.
Anything refused (malformed, non-finite, implausible norm, too stale, unknown learner)
raises a `SyncError` whose message says why, and changes nothing.

Shards (`SyncSettings.shard`/`shards`, synchronizer/shards.py): a shard owns the fragments
`protocol.shard_map` gives it and keeps, merges, persists and serves only those; an update
or GET of another shard's fragment is refused (421, naming the owner). Lists indexed by
fragment (`versions`, `fragments`, rounds) stay over the whole layout: a fragment owned
elsewhere holds an empty placeholder at version 0 and no round ever opens on it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable

import torch

from ddiloco.synchronizer import admission, codec, ledger, passes, shards, wire
from ddiloco.synchronizer.buffers import POOL
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.contribution import Contribution
from ddiloco.synchronizer.errors import PayloadError, Refusal, SyncError
from ddiloco.synchronizer.journal import (
    MergeJournal,
    Snapshots,
    replay,
)
from ddiloco.synchronizer.ledger import LearnerRecord
from ddiloco.synchronizer.locks import FragmentLock, MergeGate
from ddiloco.synchronizer.merge import (
    MergePolicy,
    cap_counters,
)
from ddiloco.synchronizer.merging import Merging
from ddiloco.synchronizer.metrics import BROADCAST_ENCODINGS, SyncMetrics, encoding_of
from ddiloco.synchronizer.passes import Term
from ddiloco.synchronizer.prime import prime
from ddiloco.synchronizer.protocol import (
    MAX_DATA_POSITION,
    MODEL_KEY,
    FragmentStatus,
    Heartbeat,
    HeartbeatResponse,
    InitResponse,
    JoinRequest,
    JoinResponse,
    Layout,
    ModelSpec,
    Status,
    UpdateMeta,
    UpdateResponse,
)
from ddiloco.synchronizer.quant import Quantized
from ddiloco.synchronizer.rounds import GracePolicy, Rounds
from ddiloco.synchronizer.served import Served
from ddiloco.synchronizer.state import (
    FragmentLog,
    FragmentState,
    Order,
    PendingLog,
    StateStore,
    Ticket,
)
from ddiloco.synchronizer.stream import RoundSum

log = logging.getLogger(__name__)


HEADER_SLACK = 1 << 20
"""Bytes a safetensors header with metadata may add to a fragment's tensors."""

__all__ = ["SyncError", "Synchronizer"]


def model_from_metadata(meta: dict[str, str]) -> ModelSpec | None:
    """The init upload's model spec (`MODEL_KEY`), None if it carries none."""
    raw = meta.get(MODEL_KEY)
    if raw is None:
        return None
    try:
        return ModelSpec.model_validate_json(raw)
    except ValueError as e:
        raise PayloadError(f"init payload has an invalid model spec: {str(e)[:500]}") from None


class Synchronizer(Merging):
    """State: layout, per-fragment Theta/momentum/version, open rounds, learner ledger."""

    def __init__(self, settings: SyncSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = s = settings
        self.accepted = frozenset(s.update_encodings)
        """The update encodings accepted (wire.py); any other is refused, 415."""
        self.clock = clock
        self.store = StateStore(s.state_dir)
        self.lock = threading.RLock()
        """Guards learners, totals and rounds; never held across disk writes."""
        self.ledger_lock = threading.Lock()
        """Orders ledger writes: the snapshot is taken and written under it."""
        self.policy = MergePolicy.from_settings(s)
        self.grace = GracePolicy(
            enabled=s.grace,
            gamma=s.grace_gamma,
            cap_steps=s.grace_cap_steps,
            default_s=s.grace_default_s,
            tau=s.tau,
        )
        self.layout: Layout | None = self.store.load_layout()
        shards.check_state_dir(s)  # a state dir is one shard's, of one S: never another's
        self.owners: list[int] = shards.owners(self.layout, s)
        """The owner shard of each fragment ([] before init), computed once per layout."""
        self.owned: list[int] = [p for p, o in enumerate(self.owners) if o == s.shard]
        """The fragments this shard owns ([] before init; all of them with one shard)."""
        self.model: ModelSpec | None = self.store.load_model()
        """What the job trains, from the init upload (None: it said nothing, or no init)."""
        self.fragments: list[FragmentState] = []
        self.frag_locks: list[FragmentLock] = []
        """One per fragment, held by an update's admission, and by a merge of that fragment
        only while it takes the round and while it installs the merged version: not while it
        computes nor while it persists (posts of the fragment went on waiting ~1 s for that);
        then before any waiting post (`first`, locks.py)."""
        self.merge_locks: list[threading.Lock] = []
        """One per fragment: one merge of it at a time."""
        self.merging: list[dict[str, Contribution]] = []
        """Per fragment, the contributions a merge has taken and not yet installed: their
        high-water marks still count (a re-send of one is a duplicate)."""
        self.served: list[tuple[int, memoryview]] = []
        """Per fragment, the version served and its payload (served.py's buffers)."""
        self.payloads = Served(s.broadcast_dtype)
        self.journals: list[MergeJournal] = []
        """Per fragment, the merges its file does not hold yet (journal.py)."""
        self.file_versions: list[int] = []
        """Per fragment, the version its file holds (`snapshot_lag` behind at most)."""
        self.writing: list[FragmentState | None] = []
        """Per fragment, the state being written to its file: not recycled meanwhile."""
        self.retired: list[FragmentState | None] = []
        """Per fragment, a state superseded while its file was being written from it: the
        writer gives its buffers back once done (fresh 64 MB buffers cost page faults)."""
        self.unsnapped: list[list[tuple[int, list[PendingLog]]]] = []
        """Per fragment, (version, the log segments its merge sealed) of each journaled
        merge: deleted once the file holds that version."""
        self.resync: list[bool] = []
        """Per fragment, a refused merge's round was put back: its sums are not in the
        log's order, so the next merge writes its file before serving (journal.py)."""
        self.sums: list[RoundSum] = []
        """Per fragment, its open round's merge direction summed as contributions arrive."""
        self.cpu = threading.BoundedSemaphore(
            settings.cpu_slots or max(1, len(os.sched_getaffinity(0)) - 1)
        )
        """Uploads in their passes over the bytes at once (`SyncSettings.cpu_slots`; by
        default all cores but one): a merge, which takes no slot, is not one runnable
        thread among every connection's."""
        self.snapshots: Snapshots | None = None
        self.computing = MergeGate(enabled=s.merge_first)
        """Merges computing now: the upload port's body reads wait for them (locks.py)."""
        self.primings: dict[str, int] = {}
        """What the last priming made, by pool."""
        self.upload_port: int | None = None
        """The bound port of the upload listener (bulk.py), told to learners at join."""
        self.on_change: Callable[[], None] = lambda: None
        self.on_fatal: Callable[[], None] = lambda: os._exit(70)
        """Called when durability cannot be kept (a failed fsync): ends the process."""
        """Called (from any thread) when versions or open rounds change: wakes long polls."""
        self.metrics = SyncMetrics(self.status, enabled=s.metrics)
        """Prometheus instruments, observed below as things happen (metrics.py)."""
        saved = self.store.load_ledger()
        self.learners: dict[str, LearnerRecord] = ledger.load_records(saved)
        self.totals: dict = {
            "bytes_up": 0,
            "bytes_down": 0,
            "merged_contributors": 0,
            "merge_scale_sum": 0.0,
            "merges_scaled": 0,
            "staleness_sum": 0,
            "merges_refused": 0,
        }
        self.totals.update({k: v for k, v in saved.get("totals", {}).items() if k != "rejected"})
        self.refusals: Counter[str] = Counter(saved.get("totals", {}).get("refusals", {}))
        self.rounds: Rounds[Contribution] = self._rounds(0)
        if self.layout is not None:
            self._adopt(shards.load_owned(self.store, self.layout, self.owned))
            replayed = self._replay()
            log.info(
                "Resumed state from %s: versions %s, %d pending updates replayed",
                s.state_dir,
                self.versions(),
                replayed,
            )

    # ---- setup -------------------------------------------------------------------
    def _rounds(self, n: int) -> Rounds[Contribution]:
        s = self.settings
        return Rounds(
            n,
            quorum=s.quorum,
            grace=self.grace,
            ema_alpha=s.ema_alpha,
            liveness_s=s.liveness_s,
            clock=self.clock,
        )

    def _adopt(self, fragments: list[FragmentState]) -> None:
        self.fragments = fragments
        self.frag_locks = [FragmentLock() for _ in fragments]
        self.merge_locks = [threading.Lock() for _ in fragments]
        self.merging = [{} for _ in fragments]
        self.payloads = Served(self.settings.broadcast_dtype, len(fragments))
        self.served = [self._encode(p, fs) for p, fs in enumerate(fragments)]
        self.rounds = self._rounds(len(fragments))
        n = len(fragments)
        self.journals = [MergeJournal(self.store.root, p) for p in range(n)]
        self.file_versions = [fs.version for fs in fragments]
        self.writing = [None] * n
        self.retired = [None] * n
        self.unsnapped = [[] for _ in range(n)]
        self.resync = [False] * n
        self.sums = [self._round_sum(p) for p in range(n)]
        if self.snapshots is not None:
            self.snapshots.close()
        self.snapshots = Snapshots(
            self._write_file, n, lambda p: self.fragments[p].version - self.file_versions[p]
        )
        if self.settings.prime_buffers:  # before a round can close (prime.py)
            self.primings = prime(
                fragments, self.owned, self.payloads, self.journals, self.accepted
            )

    def _round_sum(self, p: int) -> RoundSum:
        """A new round of fragment p's direction, summed as its contributions arrive."""
        assert self.layout is not None
        return RoundSum(self.policy, self.policy.rule_for(self.layout.fragments[p]))

    def _replay(self) -> int:
        """Redo the journaled merges a fragment file lacks (then write it), and put every
        accepted, not yet merged update from the pending logs back in its round."""
        assert self.layout is not None
        count = 0
        for p in self.owned:
            spec = self.layout.fragments[p]
            journaled = self.journals[p].records()
            done = replay(self.fragments[p], spec, self.store.pending(p).read(), journaled)
            if done.merges:
                fs = self.fragments[p] = done.state
                self.payloads.retire(p, self.served[p][1])
                self.served[p] = self._encode(p, fs)
                self.store.save_fragment(p, fs)
                self.file_versions[p] = fs.version
                self.journals[p].compact(fs.version)
                log.info(
                    "Redid %d journaled merges of fragment %d: version %d",
                    done.merges,
                    p,
                    fs.version,
                )
            for meta, delta, norms, body in done.rest:
                self._hold(p, meta, delta, norms=norms, body=body)
                count += 1
        return count

    def _encode(self, p: int, fs: FragmentState) -> tuple[int, memoryview]:
        return fs.version, self.payloads.encode(p, fs.params)

    def versions(self) -> list[int]:
        """Published versions: durable on disk and served (a merge in progress is not)."""
        return [version for version, _ in self.served]

    def body_limit(self, p: int | None) -> int:
        """The largest body the update route of fragment p (None: the init route) can need;
        pure and lock-free. An update before init, or to a fragment that does not exist, is
        refused from its header alone."""
        if p is None:
            return self.settings.max_init_bytes
        if self.layout is None or not 0 <= p < len(self.layout.fragments):
            return HEADER_SLACK
        return self.layout.fragments[p].numel() * 4 + HEADER_SLACK

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

    # ---- learner calls -----------------------------------------------------------
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
            rec.incarnation += 1
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

    def init(self, payload: bytes) -> InitResponse:
        header = codec.read_header(payload)
        layout = codec.layout_from_metadata(header.metadata)
        model = model_from_metadata(header.metadata)
        with self.lock:
            if self.layout is not None:
                if layout.digest() != self.layout.digest():
                    raise SyncError(Refusal.CONFLICT, "already initialized with a different layout")
                return InitResponse(
                    created=False, layout_digest=self.layout.digest(), versions=self.versions()
                )
            owners = shards.owners(layout, self.settings)
            owned = [p for p, o in enumerate(owners) if o == self.settings.shard]
            fragments = shards.initial_owned(layout, owned, payload, header)
            for p in owned:
                self.store.save_fragment(p, fragments[p])
            shards.save_state_dir(self.settings)
            if model is not None:
                self.store.save_model(model)
            self.store.save_layout(layout)  # written last: its presence means "initialized"
            self.layout = layout
            self.model = model
            self.owners, self.owned = owners, owned
            self._adopt(fragments)
            log.info(
                "Initialized global model fragments=%d digest=%s", len(fragments), layout.digest()
            )
            return InitResponse(
                created=True, layout_digest=layout.digest(), versions=self.versions()
            )

    def fragment(self, p: int) -> tuple[int, memoryview]:
        if self.layout is None:
            raise SyncError(
                Refusal.NOT_INITIALIZED, "no global model yet: the first learner uploads it"
            )
        if not 0 <= p < len(self.fragments):
            raise SyncError(
                Refusal.INVALID, f"fragment {p} does not exist (0..{len(self.fragments) - 1})"
            )
        self.check_owner(p)
        version, body = self.served[p]
        with self.lock:
            self.totals["bytes_down"] += len(body)
        encoding = BROADCAST_ENCODINGS[self.settings.broadcast_dtype]
        self.metrics.bytes_served.labels(encoding).inc(len(body))
        return version, body

    def check_owner(self, p: int) -> None:
        """Refuse (421, naming the owner) a fragment another shard owns; pure and lock-free,
        so the update route calls it before reading the body."""
        owner = self.owners[p] if 0 <= p < len(self.owners) else self.settings.shard
        if owner != self.settings.shard:
            raise SyncError(
                Refusal.WRONG_SHARD,
                f"fragment {p} is owned by shard {owner} of {self.settings.shards}, not by "
                f"this shard {self.settings.shard}: send it to shard {owner} (the learner's "
                "DDILOCO_SYNC_URL lists the shards in order)",
            )

    def _high_water(self, p: int, learner_id: str) -> Order | None:
        """The highest order held for this learner and fragment, merged or pending."""
        marks = [self.fragments[p].high_water.get(learner_id)]
        for held in (self.rounds.rounds[p].contributions, self.merging[p]):
            c = held.get(learner_id)
            marks.append(c.order if c is not None else None)
        known = [m for m in marks if m is not None]
        return max(known) if known else None

    def submit(self, payload: bytes, path_fragment: int | None = None) -> UpdateResponse:
        if self.layout is None:
            raise SyncError(Refusal.NOT_INITIALIZED, "no global model yet: nothing to update")
        header = codec.read_header(payload, codes=True)  # checked once, used twice
        meta = admission.parse_update(header, path_fragment, len(self.fragments))
        self.check_owner(meta.fragment)
        self._learner(meta.learner_id)
        p, s = meta.fragment, self.settings
        spec = self.layout.fragments[p]
        with self.lock:  # a duplicate stays one (high-water marks only grow): no decode
            if admission.is_duplicate(meta, self._high_water(p, meta.learner_id)):
                return UpdateResponse(
                    status="duplicate", fragment=p, round_version=self.fragments[p].version
                )
        # The passes over the bytes run before the fragment's lock, so concurrent updates
        # of one fragment decode side by side: views of the body in the layout's shapes, in
        # an accepted encoding (415 else, wire.py), its finite norm, the log record's
        # checksum. At most `cpu_slots` uploads measure and checksum at once (`cpu`): a merge
        # is not one runnable thread of sixteen. A quantized update is dequantized once into
        # float32 of `POOL` for its norm and its round-sum term (passes.py, stream.py), with
        # no slot: dequantizing is where its ingest spends its cores (one slot for it cut
        # int4's capacity from 0.34 to 0.20 GB/s here); it waits between chunks while a merge
        # computes instead (`merge_first`, locks.py). The round keeps only its codes.
        delta = wire.decode_update(payload, header, spec, self.accepted)  # views of payload
        dense = None
        if any(isinstance(t, Quantized) for t in delta.values()):
            dense = {k: passes.dense(t, self.computing.wait) for k, t in delta.items()}
        held = False
        try:
            with self.cpu:
                norms = admission.delta_norms(dense or delta, spec)
                n = codec.total_norm(norms)
                record = PendingLog.record(payload)
            plog = self.store.pending(p)
            with self.frag_locks[p]:
                fs = self.fragments[p]
                verdict = admission.admit(
                    meta,
                    version=fs.version,
                    high_water=self._high_water(p, meta.learner_id),
                    max_staleness=s.max_staleness,
                )
                if verdict == "duplicate":
                    return UpdateResponse(status="duplicate", fragment=p, round_version=fs.version)
                admission.check_norm(
                    n,
                    spec,
                    theta_norm=self._theta_norm(fs),
                    recent=fs.norms,
                    max_update_ratio=s.max_update_ratio,
                    max_norm_ratio=s.max_norm_ratio,
                )
                ticket = plog.write(payload, record)
                fs.norms = [*fs.norms, n][-admission.NORM_HISTORY :]
                self._hold(
                    p, meta, delta, opens=verdict == "fresh", norms=norms, body=payload, dense=dense
                )
                held = True
                summing = self.sums[p]
                # the round after the one a merge in flight took, if any
                round_version = fs.version + (2 if self.merging[p] else 1)
        finally:
            if not held and dense is not None:  # refused, or a duplicate
                POOL.give(dense.values())
        with self.cpu:
            summing.drain()  # its term in the round's sum (stream.py), unless another adds it
        self._make_durable(p, plog, ticket)  # one fsync for every record written before it
        with self.lock:
            self.rounds.heard(meta.learner_id)
            self.totals["bytes_up"] += len(payload)
        m = self.metrics
        m.updates_accepted.inc()
        m.update_bytes.observe(len(payload))
        m.bytes_received.labels(encoding_of(e.dtype for e in header.tensors.values())).inc(
            len(payload)
        )
        self.on_change()
        return UpdateResponse(status="accepted", fragment=p, round_version=round_version)

    def _make_durable(self, p: int, plog: FragmentLog, ticket: Ticket) -> None:
        """The update behind `ticket` is held in its round; return once it is durable too.
        If the fsync fails, what the disk holds is unknown (a failed fsync may drop the
        dirty pages it could not write), and the update is held in memory where a retry is
        answered `duplicate`: the only answer that keeps "accepted means kept" is to stop
        the process, so a restart replays exactly what the log holds (the clients re-send
        what they were never told was accepted)."""
        try:
            plog.sync(ticket)
        except OSError as e:
            log.critical("fsync of the pending log of fragment %d failed (%s): stopping", p, e)
            self.on_fatal()
            raise

    @staticmethod
    def _theta_norm(fs: FragmentState) -> float:
        """The global fragment's norm, once per version (every update's guard needs it; it
        was a full pass over the fragment per update)."""
        if fs.theta_norm is None:
            fs.theta_norm = codec.norm(fs.params)
        return fs.theta_norm

    def _hold(
        self,
        p: int,
        meta: UpdateMeta,
        delta: dict[str, Term],
        opens: bool | None = None,
        norms: dict[str, float] | None = None,
        body: memoryview | bytes | None = None,
        dense: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Add an accepted update to p's open round (the caller holds p or is starting up);
        `body`: the payload `delta` views (None: `delta` is float32 of `POOL`, a test's).
        `dense`: a quantized `delta`'s float32 of `POOL`: its round-sum term, or what a second
        update of the learner's in this round adds to its contribution (consumed either way)."""
        if opens is None:
            opens = meta.base_version == self.fragments[p].version
        with self.lock:
            pending = self.rounds.rounds[p].contributions.get(meta.learner_id)
            if pending is None:
                pending = Contribution.of(meta, delta, norms, body)
                self.sums[p].offer(pending, dense)
            else:
                self.sums[p].spoil()  # the term queued for it is no longer its own
                if dense is not None:  # summed from the float32 made already (same bits)
                    pending.absorb(meta, dense)
                else:
                    pending.absorb(meta, delta, body)
            self.rounds.add(p, meta.learner_id, pending, opens=opens)
            if (rec := self.learners.get(meta.learner_id)) is not None:
                rec.period_tokens = cap_counters(
                    meta.tokens, meta.steps, self.policy.counter_cap_steps
                )[0]

    def reject(self, kind: Refusal | str = Refusal.INVALID) -> None:
        with self.lock:
            self.refusals[str(kind)] += 1

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

    # ---- status ------------------------------------------------------------------
    def _mean_merge_scale(self) -> float:
        """Over the merges this process and its restored ledger counted (a ledger from before
        the setting existed has no sum: its merges read 1)."""
        counted = self.totals["merges_scaled"]
        return self.totals["merge_scale_sum"] / counted if counted else 1.0

    def status(self) -> Status:
        with self.lock:
            now, live = self.clock(), self.rounds.live()
            merges = sum(fs.merges for fs in self.fragments)
            contributions = sum(fs.contributions for fs in self.fragments)
            merged = self.totals["merged_contributors"]
            owned = self.owned  # a shard's status is over its fragments (shards.py)
            tokens_merged = sum(self.fragments[p].tokens_merged for p in owned) // max(
                1, len(owned)
            )
            frags = [
                FragmentStatus(
                    index=i,
                    merge=self.policy.rule_for(spec),
                    version=self.served[i][0],
                    contributors_pending=self.rounds.pending(i),
                    tokens_merged=fs.tokens_merged,
                    tokens_pending=sum(
                        c.tokens for c in self.rounds.rounds[i].contributions.values()
                    ),
                    shard=self.settings.shard,
                )
                for i, (spec, fs) in enumerate(
                    zip(self.layout.fragments if self.layout else [], self.fragments, strict=True)
                )
                if i in owned
            ]
            return Status(
                initialized=self.layout is not None,
                global_version=sum(self.versions()),
                merges=merges,
                # every fragment sees every token: average over fragments, not a sum
                tokens_merged=tokens_merged,
                contributions_merged=contributions,
                contributions_rejected=sum(self.refusals.values()),
                refusals=dict(self.refusals),
                merges_refused=int(self.totals["merges_refused"]),
                mean_contributors=contributions / merges if merges else 0.0,
                mean_staleness=self.totals["staleness_sum"] / merged if merged else 0.0,
                mean_merge_scale=self._mean_merge_scale(),
                bytes_up=int(self.totals["bytes_up"]),
                bytes_down=int(self.totals["bytes_down"]),
                goodput=ledger.goodput(self.learners),
                merged_work_ratio=ledger.merged_work_ratio(
                    self.learners, tokens_merged, len(owned)
                ),
                fragments=frags,
                learners=ledger.learner_statuses(self.learners, live, now, len(owned)),
                xi={
                    "step": self.rounds.xi_step(live),
                    "quorum": self.rounds.xi_quorum.value,
                    "sync": self.rounds.xi_sync.value,
                },
                shard=self.settings.shard,
                shards=self.settings.shards,
            )

    def close(self) -> None:
        """Write every fragment file that trails its served version, then close the files."""
        if self.snapshots is not None:
            self.snapshots.close()
            for p in self.owned:
                self.snapshots.write(p)
        for j in self.journals:
            j.close()
        self.store.close()
