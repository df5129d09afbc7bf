"""The synchronizer's domain logic: learners, fragments, rounds, merges, persistence.

`Synchronizer` is what the HTTP routes call; it knows nothing about HTTP. Its methods
block (decoding, merging, fsync) and take locks, so the routes call every one of them from a
worker thread, never on the event loop.

Who owns what: each `Fragment` (fragment.py) its state, its round's sum, its pending log,
journal and file, its served copy and its locks: what is done to one fragment (admit an
update, merge its round, make the merge durable, serve it) is its method. `Learners`
(learners.py) owns the learner records, the job's totals and their ledger. `admission`
decides accept / duplicate / refuse; `Rounds` owns the quorum, the grace window and all of
its inputs (liveness, step times); `MergePolicy` turns a round into the next version;
`StateStore` keeps fragments, pending updates and the ledger on disk. The service holds
these and what is global (layout, model spec, budget, evaluations, checkpoints, metrics),
and its methods are what a route asks: `submit` (an update: checked, decoded, then its
fragment's), `merge`, `join`, `heartbeat`, `poll`, `fragment` (a download), `exact_fragment`
(an export's float32 read), `status`.

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
import statistics
import threading
import time
from collections.abc import Callable

import torch

from ddiloco.synchronizer import admission, checkpoints, ledger, shards, update_passes
from ddiloco.synchronizer.budget import Budget
from ddiloco.synchronizer.buffers import POOL
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.contribution import Contribution
from ddiloco.synchronizer.evaluations import Evaluations
from ddiloco.synchronizer.fragment import SCHED_ONLY, Fragment, Shared
from ddiloco.synchronizer.learners import Learners
from ddiloco.synchronizer.locks import MergeGate
from ddiloco.synchronizer.merge import MergePolicy, NonFiniteMerge
from ddiloco.synchronizer.metrics import SyncMetrics, encoding_of
from ddiloco.synchronizer.prefault import prime
from ddiloco.synchronizer.rounds import GracePolicy, Rounds
from ddiloco.synchronizer.served_buffers import Served
from ddiloco.synchronizer.served_versions import LABELS
from ddiloco.synchronizer.storage.pending import PendingLog
from ddiloco.synchronizer.storage.snapshots import Snapshots
from ddiloco.synchronizer.storage.state import FragmentState, StateStore
from ddiloco.wire import broadcast, codec, encodings
from ddiloco.wire.auth import JOB, Principal
from ddiloco.wire.errors import PayloadError, Refusal, SyncError
from ddiloco.wire.protocol import (
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
    UpdateResponse,
)
from ddiloco.wire.quant import Quantized

log = logging.getLogger(__name__)


__all__ = ["HEADER_SLACK", "SyncError", "Synchronizer"]

HEADER_SLACK = 1 << 20
"""Bytes a safetensors header with metadata may add to a fragment's tensors."""


def model_from_metadata(meta: dict[str, str]) -> ModelSpec | None:
    """The init upload's model spec (`MODEL_KEY`), None if it carries none."""
    raw = meta.get(MODEL_KEY)
    if raw is None:
        return None
    try:
        return ModelSpec.model_validate_json(raw)
    except ValueError as e:
        raise PayloadError(f"init payload has an invalid model spec: {str(e)[:500]}") from None


class Synchronizer:
    """The job's global model and its learners: what the routes and the upload port ask.

    Holds the layout and model spec, one `Fragment` per fragment of the layout (its state,
    round sum, log, journal, file and served copy: fragment.py), the learners and the job's
    totals (`Learners`, learners.py), the rounds' timing (`Rounds`), and what is global: the
    token budget, evaluations, checkpoints and metrics."""

    def __init__(self, settings: SyncSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = s = settings
        self.accepted = frozenset(s.update_encodings)
        """The update encodings accepted (encodings.py); any other is refused, 415."""
        self.clock = clock
        self.store = StateStore(s.state_dir)
        self.lock = threading.RLock()
        """Guards the learners, the totals and the rounds; never held across disk writes."""
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
        self.fragments: list[Fragment] = []
        """One per fragment of the layout, owned here or not (fragment.py)."""
        self.payloads = self._payloads(0)
        """The served payloads' buffers (served_buffers.py)."""
        self.cpu = threading.BoundedSemaphore(settings.tuning.upload_slots())
        """Uploads in their passes over the bytes at once (`TuningSettings.cpu_slots`; by
        default all cores but one): a merge, which takes no slot, is not one runnable
        thread among every connection's."""
        self.snapshots: Snapshots | None = None
        """The background writer of the fragments' files (snapshots.py)."""
        self.computing = MergeGate(enabled=s.tuning.merge_first)
        """Merges computing now: the upload port's body reads wait for them (locks.py)."""
        self.primings: dict[str, int] = {}
        """What the last priming made, by pool."""
        self.upload_port: int | None = None
        """The bound port of the upload listener (upload_port.py), told to learners at join."""
        self.on_change: Callable[[], None] = lambda: None
        """Called (from any thread) when versions or open rounds change: wakes long polls."""
        self.on_fatal: Callable[[], None] = lambda: os._exit(70)
        """Called when durability cannot be kept (a failed fsync): ends the process."""
        self.budget = Budget(s.total_tokens)
        """The job's token budget and the recent merged-token rate (budget.py)."""
        self.evaluations = Evaluations(self.store)
        """The latest evaluation of the global model an evaluator posted (evaluations.py)."""
        self.metrics = SyncMetrics(self.status, enabled=s.metrics)
        """Prometheus instruments, observed below as things happen (metrics.py)."""
        self.learners = Learners(s, self.store, self.lock, clock, self.policy.counter_cap_steps)
        """The learner records, the job's totals and their ledger (learners.py)."""
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
        self.origin: str | None = checkpoints.origin(s.state_dir)
        """The `--init-from` the job's global model started from (None: a learner's init)."""
        self.seed: dict[str, torch.Tensor] | None = None
        """An `--init-from` model directory's parameters, until the first init upload gives
        their layout (checkpoints.py)."""
        if self.layout is None and s.init_from:
            checkpoints.start_from(self, s.init_from)
        self.checkpointer: checkpoints.Checkpointer | None = None
        """Writes periodic checkpoints to `checkpoint_dest` (checkpoints.py), when set."""
        if s.checkpoint_dest:
            self.checkpointer = checkpoints.Checkpointer(
                s.checkpoint_dest,
                every_versions=s.checkpoint_every_versions,
                every_seconds=s.checkpoint_every_seconds,
                keep=s.checkpoint_keep,
                version=lambda: sum(self.versions()),
                snapshot=lambda: checkpoints.take_snapshot(self),
                counted=checkpoints.counted_by(self.metrics),
                clock=clock,
            ).start()

    # ---- setup -------------------------------------------------------------------
    def _rounds(self, n: int) -> Rounds[Contribution]:
        s = self.settings
        return Rounds(
            n,
            quorum=s.quorum,
            grace=self.grace,
            ema_alpha=s.ema_alpha,
            liveness_s=s.liveness_s,
            step_ratio=s.grace_step_ratio,
            clock=self.clock,
        )

    def _adopt(self, states: list[FragmentState]) -> None:
        """Make `states` the fragments (the layout's, in order): each a `Fragment` serving its
        state, with new rounds, payload buffers and file writer."""
        assert self.layout is not None
        n = len(states)
        self.payloads = self._payloads(n)
        self.rounds = self._rounds(n)
        if self.snapshots is not None:
            self.snapshots.close()
        self.snapshots = Snapshots(
            lambda p: self.fragments[p].write_file(), n, lambda p: self.fragments[p].behind()
        )
        shared = Shared(
            settings=self.settings,
            policy=self.policy,
            store=self.store,
            payloads=self.payloads,
            rounds=self.rounds,
            lock=self.lock,
            computing=self.computing,
            metrics=self.metrics,
            clock=self.clock,
            lost=lambda p, e: self.on_fatal(),
            snapshots=self.snapshots,
        )
        self.fragments = [
            Fragment(p, spec, fs, shared)
            for p, (spec, fs) in enumerate(zip(self.layout.fragments, states, strict=True))
        ]
        if self.settings.tuning.prime_buffers:  # before a round can close (prefault.py)
            self.primings = prime(
                [f.state for f in self.fragments],
                self.owned,
                self.payloads,
                [f.journal for f in self.fragments],
                self.accepted,
            )

    def _payloads(self, n: int) -> Served:
        """Buffers for n fragments' served payloads (two kinds a version for a delta
        encoding: the delta and the whole)."""
        encoding = self.settings.broadcast_encoding
        kinds = 2 if encoding in broadcast.DELTAS else 1
        return Served(broadcast.whole_dtype(encoding), n, self.settings.tuning.merge_ways(), kinds)

    def _replay(self) -> int:
        """A restart: each owned fragment redoes the journaled merges its file lacks and puts
        its log's pending updates back in its round (fragment.py); returns how many."""
        return sum(self.fragments[p].replay(self.learners.noted) for p in self.owned)

    def versions(self) -> list[int]:
        """Published versions: durable on disk and served (a merge in progress is not)."""
        return [f.version for f in self.fragments]

    def init(self, payload: bytes) -> InitResponse:
        header = codec.read_header(payload)
        layout = codec.layout_from_metadata(header.metadata)
        model = model_from_metadata(header.metadata)
        with self.lock:
            if self.layout is not None:
                if layout.digest() != self.layout.digest():
                    raise SyncError(
                        Refusal.CONFLICT,
                        f"already initialized with a different layout{self.origin_note()}",
                    )
                return InitResponse(
                    created=False, layout_digest=self.layout.digest(), versions=self.versions()
                )
            if self.seed is not None:  # the parameters of --init-from's model directory
                fragments = checkpoints.seeded(self, layout)
                self.seed = None
            else:
                owners = shards.owners(layout, self.settings)
                owned = [p for p, o in enumerate(owners) if o == self.settings.shard]
                fragments = shards.initial_owned(layout, owned, payload, header)
            self.initialize(layout, model, fragments)
            return InitResponse(
                created=True, layout_digest=layout.digest(), versions=self.versions()
            )

    def initialize(
        self, layout: Layout, model: ModelSpec | None, fragments: list[FragmentState]
    ) -> None:
        """Make `fragments` the job's global model (an init upload's, or a checkpoint's,
        checkpoints.py): durable in the state dir, then adopted. The caller holds the lock
        or runs before the app serves."""
        owners = shards.owners(layout, self.settings)
        owned = [p for p, o in enumerate(owners) if o == self.settings.shard]
        for p in owned:
            self.store.save_fragment(p, fragments[p])
        shards.save_state_dir(self.settings)
        if model is not None:
            self.store.save_model(model)
        self.store.save_layout(layout)  # written last: its presence means "initialized"
        self.layout = layout
        self.model = model
        self.owners, self.owned = owners, owned
        self.origin = checkpoints.origin(self.settings.state_dir)
        self._adopt(fragments)
        log.info("Initialized global model fragments=%d digest=%s", len(fragments), layout.digest())

    def origin_note(self) -> str:
        """What a layout refusal adds when the global model came from `--init-from`."""
        if self.origin is None:
            return ""
        return (
            f" (this job's model was initialized from --init-from {self.origin}: the learners"
            " must train that model, with its P and fragment rule)"
        )

    # ---- downloads ---------------------------------------------------------------
    def fragment(self, p: int, held: str | None = None) -> tuple[int, memoryview]:
        """Fragment p's served version and the payload for a learner holding `held` (the
        token of its last download, wire/broadcast.py): the delta from it when the encoding has
        one and `held` names the version before, else the whole fragment."""
        self.check_readable(p)
        served, body, label = self.fragments[p].serve(held)
        self.learners.count("bytes_down", len(body))
        self.metrics.bytes_served.labels(label).inc(len(body))
        return served.version, body

    def exact_fragment(self, p: int) -> tuple[int, memoryview | bytes]:
        """Fragment p's Theta in float32, bit for bit, and its version (`Fragment.exact`):
        what an export writes, whatever the broadcast encoding. `Busy` while another such
        read of p is being encoded."""
        self.check_readable(p)
        version, body = self.fragments[p].exact()
        self.metrics.bytes_served.labels(LABELS["float32"]).inc(len(body))
        return version, body

    def check_readable(self, p: int) -> None:
        """Refuse a read of fragment p before init (409), of one that does not exist (422)
        or of one another shard owns (421)."""
        if self.layout is None:
            raise SyncError(
                Refusal.NOT_INITIALIZED, "no global model yet: the first learner uploads it"
            )
        if not 0 <= p < len(self.fragments):
            raise SyncError(
                Refusal.INVALID, f"fragment {p} does not exist (0..{len(self.fragments) - 1})"
            )
        self.check_owner(p)

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

    # ---- updates -----------------------------------------------------------------
    def body_limit(self, p: int | None) -> int:
        """The largest body the update route of fragment p (None: the init route) can need;
        pure and lock-free. An update before init, or to a fragment that does not exist, is
        refused from its header alone."""
        if p is None:
            return self.settings.max_init_bytes
        if self.layout is None or not 0 <= p < len(self.layout.fragments):
            return HEADER_SLACK
        return self.layout.fragments[p].numel() * 4 + HEADER_SLACK

    def submit(
        self, payload: bytes, path_fragment: int | None = None, speaker: Principal = JOB
    ) -> UpdateResponse:
        """Admit one update sent with `speaker`'s credential (routes.py and the upload port
        pass the request's; the job key by default): decode, check, hold in its fragment's
        round, log, fsync; then `accepted`.

        Checked in this order, each refusal a `SyncError` that changes nothing: a model to
        update (init done), its header (admission.parse_update), the shard that owns its
        fragment, its learner, duplicate (under the lock, no decode), its encoding and
        shapes (encodings.py), a finite norm, then under the fragment's lock its staleness
        and the norm guard against the durable history (`Fragment.admit`)."""
        if self.layout is None:
            raise SyncError(Refusal.NOT_INITIALIZED, "no global model yet: nothing to update")
        header = codec.read_header(payload, codes=True)  # checked once, used twice
        meta = admission.parse_update(header, path_fragment, len(self.fragments))
        if not speaker.speaks_for(meta.learner_id):
            raise SyncError(
                Refusal.FORBIDDEN,
                f"this credential ({speaker}) does not speak for learner {meta.learner_id!r}: "
                "a learner sends only its own updates",
            )
        self.check_owner(meta.fragment)
        rec = self.learners.known(meta.learner_id)
        admission.check_tokens(meta, rec.tokens_per_step, self.settings.max_tokens_per_step)
        if meta.incarnation > rec.incarnation:  # the ledger's count is durable: a restart keeps it
            raise SyncError(
                Refusal.FORBIDDEN,
                f"update says incarnation {meta.incarnation} of learner {meta.learner_id!r}, "
                f"which has joined {rec.incarnation} time(s): incarnations are issued at join",
            )
        p = meta.fragment
        frag = self.fragments[p]
        with self.lock:  # a duplicate stays one (high-water marks only grow): no decode
            if admission.is_duplicate(meta, frag.high_water(meta.learner_id)):
                return UpdateResponse(
                    status="duplicate", fragment=p, round_version=frag.state.version
                )
        # The passes over the bytes run before the fragment's lock, so concurrent updates
        # of one fragment decode side by side: views of the body in the layout's shapes, in
        # an accepted encoding (415 else, encodings.py), its finite norm, the log record's
        # checksum. At most `cpu_slots` uploads measure and checksum at once (`cpu`): a merge
        # is not one runnable thread of sixteen. A quantized update is dequantized once into
        # float32 of `POOL` for its norm and its round-sum term (update_passes.py, stream.py),
        # with no slot: dequantizing is where its ingest spends its cores; it waits between
        # chunks while a merge computes instead (`merge_first`, locks.py). The round keeps
        # only its codes.
        delta = encodings.decode_update(payload, header, frag.spec, self.accepted)  # views
        dense = None
        if any(isinstance(t, Quantized) for t in delta.values()):
            dense = {k: update_passes.dense(t, self.computing.wait) for k, t in delta.items()}
        held = False
        try:
            with self.cpu:
                norms = admission.delta_norms(dense or delta, frag.spec)
                n = admission.total_norm(norms)
                record = PendingLog.record(payload)
            ticket, summing, round_version = frag.admit(
                meta, delta, norms, n, payload, dense, self.learners.noted
            )
            if ticket is None or summing is None:
                return UpdateResponse(status="duplicate", fragment=p, round_version=round_version)
            held = True
        finally:
            if not held and dense is not None:  # refused, or a duplicate
                POOL.give(dense.values())
        frag.fill(ticket, payload, record)  # its bytes, beside the fragment's others
        with self.cpu:
            summing.drain()  # its term in the round's sum (stream.py), unless another adds it
        frag.make_durable(ticket)  # one fsync for every record filled before it
        with self.lock:
            self.rounds.heard(meta.learner_id)
            self.learners.totals["bytes_up"] += len(payload)
        m = self.metrics
        m.updates_accepted.inc()
        m.update_bytes.observe(len(payload))
        m.bytes_received.labels(encoding_of(e.dtype for e in header.tensors.values())).inc(
            len(payload)
        )
        self.on_change()
        return UpdateResponse(status="accepted", fragment=p, round_version=round_version)

    def reject(self, kind: Refusal | str = Refusal.INVALID) -> None:
        """Count a refused request (routes.py, the upload port)."""
        self.learners.reject(kind)

    # ---- learners ----------------------------------------------------------------
    def _waiting(self) -> set[str]:
        """The learner ids in an open round or a merge in flight (the caller holds the
        lock): their records are never dropped."""
        waiting = {k for r in self.rounds.rounds for k in r.contributions}
        return waiting | {k for f in self.fragments for k in f.merging}

    def join(self, req: JoinRequest) -> JoinResponse:
        """A learner (re)joins: its next incarnation and where its data resumes, durable
        before the answer (never handed out twice)."""
        self.learners.check_join(req)
        with self.lock:
            digest = self.layout.digest() if self.layout else None
            if digest and req.layout_digest and req.layout_digest != digest:
                raise SyncError(
                    Refusal.CONFLICT,
                    f"layout digest {req.layout_digest} differs from the "
                    f"job's {digest}: same model, P and fragment rule on every learner"
                    f"{self.origin_note()}",
                )
            rec, resume = self.learners.join(req, self._waiting, self.rounds.forget)
            self.rounds.heard(req.learner_id)
            incarnation = rec.incarnation
            slot_steps = rec.slot_steps  # where the slot's LR schedule resumes
            finished = self.finished()
            merged = self.tokens_merged()
        self.learners.save()
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

    def heartbeat(self, hb: Heartbeat) -> HeartbeatResponse:
        Learners.check_lists(hb, len(self.layout.fragments) if self.layout else None)
        with self.lock:
            advanced = self.learners.beat(hb, self.layout is not None)
            self.rounds.heard(hb.learner_id, hb.step_seconds)
        if advanced:  # a new reservation is durable before it is answered (learner/corpus.py)
            self.learners.save()
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

    # ---- merges ------------------------------------------------------------------
    def due(self) -> list[int]:
        with self.lock:
            return self.rounds.due()

    def _live_period_tokens(self, taken: dict[str, Contribution]) -> float:
        """The tokens the live set (and this merge's contributors) hands over per period,
        for `merge_scale = live`: each one's last update, a live learner not yet heard from
        counted at the mean of the others (the caller holds the lock)."""
        ids = self.rounds.live() | set(taken)
        records = self.learners.records
        known = [
            records[i].period_tokens for i in ids if i in records and records[i].period_tokens > 0
        ]
        if not known:
            return 0.0
        return statistics.fmean(known) * len(ids)

    def merge(self, p: int) -> int | None:
        """Merge the open round of fragment p (`Fragment.merge`), then count it in the
        learners' records and the totals, durably; returns the new version (None if
        nothing changed: an empty round, or a merge refused because its result is not
        finite, whose contributions wait)."""
        t0 = self.clock()
        frag = self.fragments[p]
        with frag.merge_lock:
            try:
                done = frag.merge(self._live_period_tokens)
            except NonFiniteMerge as e:
                self.learners.count("merges_refused")
                log.error("Refused merge of fragment %d: %s; its contributions wait", p, e)
                return None
            if done is None:
                return None
            outcome = done.outcome
            if outcome is not None:  # published: its histograms, each observed once
                timed = {k: v for k, v in done.phases.items() if k not in SCHED_ONLY}
                self.metrics.merged(  # served since its install: `finish` lets go after
                    p,
                    done.round,
                    outcome,
                    done.started,
                    done.finished,
                    len(self.fragments),
                    done.version - 1,
                    timed,
                    served=done.published,
                )
            with self.lock:
                self.learners.credit(done.taken, outcome)
                self.rounds.observe_sync(self.clock() - t0)
        self.learners.save()
        self.on_change()
        if outcome is None:
            return None
        log.info(  # served `finished`: its time and parts, as the merge histograms saw them
            "Merged fragment=%d version=%d rule=%s contributors=%d tokens=%d sum=%s in %.0f ms"
            " (%s)",
            p,
            done.version,
            outcome.rule,
            outcome.contributors,
            outcome.tokens,
            "streamed" if outcome.streamed else "resummed",
            (done.finished - done.started) * 1e3,
            ", ".join(f"{part} {s * 1e3:.0f}" for part, s in done.phases.items()),
        )
        return done.version

    def flush(self, timeout: float = 60.0) -> None:
        """Return once every fragment file holds its served version (tests, export), those
        the writer was not yet asked for (`snapshot_every`) too."""
        if self.snapshots is not None:
            for p in self.owned:
                if self.fragments[p].behind() > 0:
                    self.snapshots.request(p)
            self.snapshots.flush(timeout)

    # ---- status ------------------------------------------------------------------
    def tokens_merged(self) -> int:
        """Tokens behind merged contributions, averaged over this shard's fragments (every
        fragment sees every token); from the fragments' durable counts."""
        owned = self.owned
        return sum(self.fragments[p].state.tokens_merged for p in owned) // max(1, len(owned))

    def finished(self) -> bool:
        """The job's token budget is merged (budget.py); the caller holds the lock."""
        tokens = self.tokens_merged()
        self.budget.observe(tokens, self.clock())
        return self.budget.finished(tokens)

    def status(self) -> Status:
        with self.lock:
            now, live = self.clock(), self.rounds.live()
            states = [f.state for f in self.fragments]
            merges = sum(fs.merges for fs in states)
            contributions = sum(fs.contributions for fs in states)
            totals = self.learners.totals
            merged = totals["merged_contributors"]
            owned = self.owned  # a shard's status is over its fragments (shards.py)
            tokens_merged = self.tokens_merged()
            self.budget.observe(tokens_merged, now)
            frags = [
                FragmentStatus(
                    index=f.index,
                    merge=self.policy.rule_for(f.spec),
                    version=f.version,
                    contributors_pending=self.rounds.pending(f.index),
                    tokens_merged=f.state.tokens_merged,
                    tokens_pending=sum(c.tokens for c in f.round.contributions.values()),
                    shard=self.settings.shard,
                )
                for f in self.fragments
                if f.index in owned
            ]
            records = self.learners.records
            refusals = self.learners.refusals
            return Status(
                initialized=self.layout is not None,
                global_version=sum(self.versions()),
                merges=merges,
                # every fragment sees every token: average over fragments, not a sum
                tokens_merged=tokens_merged,
                contributions_merged=contributions,
                contributions_rejected=sum(refusals.values()),
                refusals=dict(refusals),
                merges_refused=int(totals["merges_refused"]),
                mean_contributors=contributions / merges if merges else 0.0,
                mean_staleness=totals["staleness_sum"] / merged if merged else 0.0,
                mean_merge_scale=self.learners.mean_merge_scale(),
                bytes_up=int(totals["bytes_up"]),
                bytes_down=int(totals["bytes_down"]),
                goodput=ledger.goodput(records),
                merged_work_ratio=ledger.merged_work_ratio(records, tokens_merged, len(owned)),
                fragments=frags,
                learners=ledger.learner_statuses(self.learners.listed(now), live, now, len(owned)),
                xi={
                    "step": self.rounds.xi_step(live),
                    "quorum": self.rounds.xi_quorum.value,
                    "sync": self.rounds.xi_sync.value,
                },
                shard=self.settings.shard,
                shards=self.settings.shards,
                total_tokens=self.budget.total,
                progress=self.budget.progress(tokens_merged),
                estimated_remaining_seconds=self.budget.remaining_seconds(tokens_merged, now),
                finished=self.budget.finished(tokens_merged),
                evaluation=self.evaluations.latest(),
            )

    def close(self) -> None:
        """Write every fragment file that trails its served version, then close the files."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.snapshots is not None:
            self.snapshots.close()
            for p in self.owned:
                self.snapshots.write(p)
        for f in self.fragments:
            f.close()
        self.store.close()
