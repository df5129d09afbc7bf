"""The synchronizer's domain logic: learners, fragments, rounds, merges, persistence.

`Synchronizer` is what the HTTP routes call; it knows nothing about HTTP. Its methods
block (decoding, merging, fsync) and take locks, so the routes call every one of them from a
worker thread, never on the event loop.

Who owns what: `admission` decides accept / duplicate / refuse; `Rounds` owns the quorum,
the grace window and all of its inputs (liveness, step times); `MergePolicy` turns a round
into the next version; `StateStore` keeps fragments, pending updates and the ledger on disk.
Three mixins hold the rest of its methods: the update path (`submit`, from a body to a
durable record in its round) in updates.py, the learner calls (`join`, `heartbeat`, `poll`)
in learners.py, the merge path (`merge`) in merging.py, and making a merge durable, the
background file writes and a restart's replay in durable.py.

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

from ddiloco.synchronizer import broadcast, checkpoints, ledger, shards
from ddiloco.synchronizer.broadcast import Broadcast
from ddiloco.synchronizer.budget import Budget
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.contribution import Contribution
from ddiloco.synchronizer.evaluations import Evaluations
from ddiloco.synchronizer.learners import Learners
from ddiloco.synchronizer.ledger import LearnerRecord
from ddiloco.synchronizer.locks import FragmentLock, MergeGate
from ddiloco.synchronizer.merge import MergePolicy
from ddiloco.synchronizer.merging import Merging
from ddiloco.synchronizer.metrics import SyncMetrics
from ddiloco.synchronizer.prefault import prime
from ddiloco.synchronizer.rounds import GracePolicy, Rounds
from ddiloco.synchronizer.served_buffers import Served
from ddiloco.synchronizer.storage.journal import MergeJournal
from ddiloco.synchronizer.storage.pending import PendingLog
from ddiloco.synchronizer.storage.snapshots import Snapshots
from ddiloco.synchronizer.storage.state import FragmentState, StateStore
from ddiloco.synchronizer.stream import RoundSum
from ddiloco.synchronizer.updates import Updates
from ddiloco.wire import codec
from ddiloco.wire.errors import PayloadError, Refusal, SyncError
from ddiloco.wire.protocol import (
    MODEL_KEY,
    FragmentStatus,
    InitResponse,
    Layout,
    ModelSpec,
    Status,
)

log = logging.getLogger(__name__)


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


class Synchronizer(Updates, Learners, Merging):
    """State: layout, per-fragment Theta/momentum/version, open rounds, learner ledger."""

    def __init__(self, settings: SyncSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = s = settings
        self.accepted = frozenset(s.update_encodings)
        """The update encodings accepted (encodings.py); any other is refused, 415."""
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
        self.served: list[Broadcast] = []
        """Per fragment, the version served and its payloads (broadcast.py; served_buffers.py's
        buffers): `served[p][0]` is its version."""
        self.payloads = self._payloads(0)
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
        self.started = clock()
        """When this process started: a learner not heard since counts as heard then, for
        its retirement (`retire_after_s`)."""
        saved = self.store.load_ledger()
        self.learners: dict[str, LearnerRecord] = ledger.load_records(saved["learners"])
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
        totals, refusals = ledger.load_totals(saved["totals"])
        self.totals.update(totals)
        self.refusals: Counter[str] = Counter(refusals)
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

    def _adopt(self, fragments: list[FragmentState]) -> None:
        self.fragments = fragments
        self.frag_locks = [FragmentLock() for _ in fragments]
        self.merge_locks = [threading.Lock() for _ in fragments]
        self.merging = [{} for _ in fragments]
        self.payloads = self._payloads(len(fragments))
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
        if self.settings.prime_buffers:  # before a round can close (prefault.py)
            self.primings = prime(
                fragments, self.owned, self.payloads, self.journals, self.accepted
            )

    def _round_sum(self, p: int) -> RoundSum:
        """A new round of fragment p's direction, summed as its contributions arrive."""
        assert self.layout is not None
        return RoundSum(self.policy, self.policy.rule_for(self.layout.fragments[p]))

    def _payloads(self, n: int) -> Served:
        """Buffers for n fragments' served payloads (two kinds a version for a delta
        encoding: the delta and the whole)."""
        encoding = self.settings.broadcast_encoding
        kinds = 2 if encoding in broadcast.DELTAS else 1
        return Served(broadcast.whole_dtype(encoding), n, self.settings.merge_ways(), kinds)

    def _encode(self, p: int, fs: FragmentState, prev: Broadcast | None = None) -> Broadcast:
        """Fragment p's served payloads of `fs` (broadcast.py): a delta encoding's delta from
        `prev`, the version served before; without it, its served copy restarts from Theta."""
        return broadcast.encode(
            self.payloads, self.settings.broadcast_encoding, p, fs.version, fs.params, prev
        )

    def versions(self) -> list[int]:
        """Published versions: durable on disk and served (a merge in progress is not)."""
        return [served.version for served in self.served]

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

    def fragment(self, p: int, held: str | None = None) -> tuple[int, memoryview]:
        """Fragment p's served version and the payload for a learner holding `held` (the
        token of its last download, broadcast.py): the delta from it when the encoding has
        one and `held` names the version before, else the whole fragment."""
        if self.layout is None:
            raise SyncError(
                Refusal.NOT_INITIALIZED, "no global model yet: the first learner uploads it"
            )
        if not 0 <= p < len(self.fragments):
            raise SyncError(
                Refusal.INVALID, f"fragment {p} does not exist (0..{len(self.fragments) - 1})"
            )
        self.check_owner(p)
        served = self.served[p]
        body, label = served.body(held)
        with self.lock:
            self.totals["bytes_down"] += len(body)
        self.metrics.bytes_served.labels(label).inc(len(body))
        return served.version, body

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

    # ---- status ------------------------------------------------------------------
    def _mean_merge_scale(self) -> float:
        """Over the merges this process and its restored ledger counted (a ledger from before
        the setting existed has no sum: its merges read 1)."""
        counted = self.totals["merges_scaled"]
        return self.totals["merge_scale_sum"] / counted if counted else 1.0

    def tokens_merged(self) -> int:
        """Tokens behind merged contributions, averaged over this shard's fragments (every
        fragment sees every token); from the fragments' durable counts."""
        owned = self.owned
        return sum(self.fragments[p].tokens_merged for p in owned) // max(1, len(owned))

    def finished(self) -> bool:
        """The job's token budget is merged (budget.py); the caller holds the lock."""
        tokens = self.tokens_merged()
        self.budget.observe(tokens, self.clock())
        return self.budget.finished(tokens)

    def status(self) -> Status:
        with self.lock:
            now, live = self.clock(), self.rounds.live()
            merges = sum(fs.merges for fs in self.fragments)
            contributions = sum(fs.contributions for fs in self.fragments)
            merged = self.totals["merged_contributors"]
            owned = self.owned  # a shard's status is over its fragments (shards.py)
            tokens_merged = self.tokens_merged()
            self.budget.observe(tokens_merged, now)
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
                learners=ledger.learner_statuses(self.listed(now), live, now, len(owned)),
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
        for j in self.journals:
            j.close()
        self.store.close()
