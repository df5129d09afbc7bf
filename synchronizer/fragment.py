"""One fragment of the global model and everything kept for it: `Fragment`.

The synchronizer (service.py) holds one `Fragment` per fragment of the layout; a route or
the upload port asks it through the service. A fragment owns:

- its state (`state`: Theta, outer momentum, version, high-water marks, recent norms, counts;
  storage/state.py) and the version it serves with its payloads (`served`,
  served_versions.py);
- its lock (`lock`, locks.py), held by an update's admission and by a merge only while it
  takes the round and while it installs the merged version; and `merge_lock`, one merge of
  it at a time;
- its open round's running sum (`sum`, stream.py) and the contributions a merge has taken
  and not yet installed (`merging`: their high-water marks still count). The round itself is
  `round`, kept by `Rounds` (rounds.py), which times every fragment's rounds together;
- its pending log (`log`, storage/segments.py), its merge journal (`journal`), and its
  file's bookkeeping: the version the file holds (`file_version`), the state being written
  to it (`writing`), a state superseded meanwhile whose buffers wait for that write
  (`retired`), the log segments of journaled merges the file does not hold yet
  (`unsnapped`), and whether the next merge writes the file before serving (`resync`).

What is done to one fragment is done here:

    frag.serve(held)                          # a download: its payload
    frag.exact()                              # Theta in float32 (an export's read)
    frag.admit(meta, delta, ...)              # an update into its round, under its lock
    frag.fill(ticket, ...); frag.make_durable(ticket)   # its record, then its fsync
    frag.merge(live_tokens)                   # take the round, compute, make durable, install
    frag.write_file()                         # the background writer (snapshots.py)
    frag.replay(noted)                        # a restart: journaled merges, pending updates

What every fragment uses and none owns (the store, the merge policy, the payload buffers,
`Rounds` and the lock that guards it, the merge gate, the metrics, the clock) is `Shared`,
made by the service.

A merge is durable before its version is served: a journal record of its inputs (the file
written later, in the background), or its file; the log's segments go once the file holds
it. A merge whose result is not finite changes nothing: its contributions wait in the round.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from typing import Any

import torch

from ddiloco.synchronizer import admission, served_versions
from ddiloco.synchronizer.buffers import POOL
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.contribution import Contribution
from ddiloco.synchronizer.locks import FragmentLock, MergeGate
from ddiloco.synchronizer.merge import MergeOutcome, MergePolicy
from ddiloco.synchronizer.metrics import SyncMetrics
from ddiloco.synchronizer.replay import digest, next_state, policy_fields, replay
from ddiloco.synchronizer.rounds import Round, Rounds
from ddiloco.synchronizer.served_buffers import Served
from ddiloco.synchronizer.served_versions import Broadcast
from ddiloco.synchronizer.storage.journal import MergeJournal, MergeRecord
from ddiloco.synchronizer.storage.pending import PendingLog
from ddiloco.synchronizer.storage.segments import FragmentLog, Ticket
from ddiloco.synchronizer.storage.snapshots import Snapshots
from ddiloco.synchronizer.storage.state import FragmentState, Order, StateStore
from ddiloco.synchronizer.storage.statedir import read_back
from ddiloco.synchronizer.stream import RoundSum
from ddiloco.synchronizer.update_passes import Term
from ddiloco.wire import codec
from ddiloco.wire.protocol import FragmentSpec, UpdateMeta

log = logging.getLogger(__name__)

__all__ = ["DURABLES", "Busy", "Fragment", "Merged", "Shared", "give_back", "thread_sched"]

DURABLES = ThreadPoolExecutor(32, thread_name_prefix="ddiloco-durable")
"""Where a merge's durable part (its fsyncs) runs while the merge's thread encodes the
payload it will serve (`Fragment._computed`); threads are made as merges overlap."""
INPUTS = ThreadPoolExecutor(32, thread_name_prefix="ddiloco-inputs")
"""Where a journaled merge fsyncs the segments that hold its inputs while its durable part
computes and writes the record (`Fragment._persist`): a pool of its own, as its callers run
in `DURABLES` (a task waiting for one queued behind it in the same pool could wait for
good)."""

SCHED_ONLY = ("ran", "queued", "inputs", "record")
"""Parts of a merge its log line gives and no histogram observes: of the compute's time, on
a core and runnable but waiting for one (`thread_sched`); the rest of it waited for
something else (the GIL, a page). Of a journaled merge's durable part, from its start: when
its inputs' fsync returned, and when its record's did (they run side by side)."""


def thread_sched() -> tuple[float, float] | None:
    """This thread's seconds on a core and runnable without one, so far (Linux's
    /proc/thread-self/schedstat; None where the kernel does not say)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            ran, queued = f.read().split()[:2]
        return int(ran) / 1e9, int(queued) / 1e9
    except (OSError, ValueError):
        return None


def give_back(outcome: MergeOutcome | None) -> None:
    """A merge's result that will not be installed: its tensors back to the pool."""
    if outcome is not None:
        POOL.give([*outcome.params.values(), *outcome.momentum.values()])


@dataclasses.dataclass(eq=False)
class Shared:
    """What every fragment of one synchronizer uses and none owns (the service's, made when
    it adopts a layout)."""

    settings: SyncSettings
    policy: MergePolicy
    store: StateStore
    payloads: Served
    """The served payloads' buffers, by fragment (served_buffers.py)."""
    rounds: Rounds[Contribution]
    lock: AbstractContextManager[Any]
    """The service's lock: guards `rounds` (and the learners, the totals)."""
    computing: MergeGate
    """Merges computing now: the upload port's body reads wait for them (locks.py)."""
    metrics: SyncMetrics
    clock: Callable[[], float]
    lost: Callable[[int, OSError], None]
    """Fragment p's log or file could not be kept: stops the process (the service's)."""
    snapshots: Snapshots
    """The background writer of the fragments' files, and each file's lock (snapshots.py)."""


@dataclasses.dataclass(eq=False)
class Merged:
    """What a merge of one fragment did, for the service's books (its ledger, its totals,
    the metrics). `outcome` None: the round was empty of weight, its contributions counted
    merged and the version unchanged."""

    round: Round[Contribution]
    taken: dict[str, Contribution]
    outcome: MergeOutcome | None
    version: int
    """The version served now."""
    started: float
    """When the merge began computing (the clock's)."""
    published: float
    """When it was installed (served) and its inputs let go of."""
    finished: float
    phases: dict[str, float]


class Busy(Exception):
    """A read that runs one at a time per fragment is under way already: ask again soon."""


class Fragment:
    """Fragment `index` of the layout: its state, its round's sum, its log, journal and file,
    its served copy and its locks (module docstring). A fragment another shard owns is a
    placeholder: empty state at version 0, and no round ever opens on it."""

    def __init__(
        self,
        index: int,
        spec: FragmentSpec,
        state: FragmentState,
        shared: Shared,
    ) -> None:
        self.index = index
        self.spec = spec
        self.shared = shared
        self.state = state
        """The installed state: what posts are checked against, and merges start from."""
        self.lock = FragmentLock()
        """Held by an update's admission, and by a merge of this fragment only while it takes
        the round and while it installs the merged version: not while it computes nor while
        it persists; then before any waiting post (`first`, locks.py)."""
        self.merge_lock = threading.Lock()
        """One merge of this fragment at a time."""
        self.exporting = threading.Lock()
        """One float32 copy of Theta encoded at a time (`exact`)."""
        self.merging: dict[str, Contribution] = {}
        """The contributions a merge has taken and not yet installed: their high-water
        marks still count (a re-send of one is a duplicate)."""
        self.served = self.encode(state)
        """The version served and its payloads (served_versions.py)."""
        self.journal = MergeJournal(shared.store.root, index)
        """The merges the file does not hold yet (storage/journal.py)."""
        self.file_lock = shared.snapshots.locks[index]
        """Held while the file is written (snapshots.py's, per fragment): an older state's
        write never lands after a newer one's."""
        self.file_version = state.version
        """The version the file holds (`snapshot_lag` behind the served one at most)."""
        self.writing: FragmentState | None = None
        """The state being written to the file: not recycled meanwhile."""
        self.retired: FragmentState | None = None
        """A state superseded while the file was being written from it: the writer gives
        its buffers back once done (fresh 64 MB buffers cost page faults)."""
        self.unsnapped: list[tuple[int, list[PendingLog]]] = []
        """(version, the log segments its merge sealed) of each journaled merge: deleted
        once the file holds that version."""
        self.resync = False
        """A refused merge's round was put back: its sums are not in the log's order, so the
        next merge writes the file before serving (journal.py)."""
        self.sum = self.new_sum()
        """The open round's merge direction, summed as contributions arrive (stream.py)."""
        self._log: FragmentLog | None = None

    # ---- what it is -----------------------------------------------------------------
    @property
    def version(self) -> int:
        """The published version: durable and served (a merge in progress is not)."""
        return self.served.version

    @property
    def log(self) -> FragmentLog:
        """The pending log: every accepted update no file holds yet, in round order (made
        on first use: a fragment another shard owns has none)."""
        plog = self._log
        if plog is None:
            plog = self._log = self.shared.store.pending(self.index)
        return plog

    @property
    def round(self) -> Round[Contribution]:
        """The open round (the caller holds this fragment's lock or the service's)."""
        return self.shared.rounds.rounds[self.index]

    def new_sum(self) -> RoundSum:
        """A new round's direction, summed as its contributions arrive."""
        policy = self.shared.policy
        return RoundSum(policy, policy.rule_for(self.spec))

    def encode(self, fs: FragmentState, prev: Broadcast | None = None) -> Broadcast:
        """The served payloads of `fs` (served_versions.py): a delta encoding's delta from
        `prev`, the version served before; without it, the served copy restarts from
        Theta."""
        s = self.shared
        return served_versions.encode(
            s.payloads, s.settings.broadcast_encoding, self.index, fs.version, fs.params, prev
        )

    def serve(self, held: str | None) -> tuple[Broadcast, memoryview, str]:
        """The served version, and the payload for a learner holding `held` (the token of
        its last download): the delta from it when the encoding has one and `held` names the
        version before, else the whole fragment; with the payload's label."""
        served = self.served
        body, label = served.body(held)
        return served, body, label

    def exact(self) -> tuple[int, memoryview | bytes]:
        """The installed version and its Theta as a float32 safetensors payload, bit for bit
        (an export's read: the broadcast encoding may round Theta, or serve S for it). With a
        float32 broadcast that is the served whole payload itself. Otherwise it is encoded on
        request under this fragment's lock, which a merge takes to install its next version
        (only after that are the superseded buffers recycled): the version and the bytes
        belong together, at the cost of update admissions to this fragment waiting one copy
        of it. One such copy at a time (`Busy` for a second): a fragment-sized allocation
        each."""
        if self.shared.settings.broadcast_encoding == "float32":
            served = self.served
            return served.version, served.whole
        if not self.exporting.acquire(blocking=False):
            raise Busy(f"fragment {self.index}'s float32 copy is being read already")
        try:
            with self.lock:
                fs = self.state
                return fs.version, codec.encode(fs.params)
        finally:
            self.exporting.release()

    def _install_served(self, served: Broadcast) -> None:
        """Serve `served`, retiring the payload buffers of the version it replaces."""
        for view in self.served.views():
            self.shared.payloads.retire(self.index, view)
        self.served = served

    # ---- an update ------------------------------------------------------------------
    def high_water(self, learner_id: str) -> Order | None:
        """The highest order held for this learner, merged, in a merge, or in the round."""
        marks = [self.state.high_water.get(learner_id)]
        for held in (self.round.contributions, self.merging):
            c = held.get(learner_id)
            marks.append(c.order if c is not None else None)
        known = [m for m in marks if m is not None]
        return max(known) if known else None

    def theta_norm(self) -> float:
        """The installed Theta's norm, once per version (every update's guard needs it)."""
        fs = self.state
        if fs.theta_norm is None:
            fs.theta_norm = admission.norm(fs.params)
        return fs.theta_norm

    def admit(
        self,
        meta: UpdateMeta,
        delta: dict[str, Term],
        norms: dict[str, float],
        n: float,
        payload: memoryview | bytes,
        dense: dict[str, torch.Tensor] | None,
        noted: Callable[[UpdateMeta], None],
    ) -> tuple[Ticket | None, RoundSum | None, int]:
        """Judge a decoded update against this fragment (its staleness, duplicate, the norm
        guard against the durable history) and hold it in the round, under the fragment's
        lock, its place in the log reserved in round order. Returns (its ticket, the round's
        sum to drain, the round version it joins); a duplicate's ticket is None, with the
        version served. `noted` runs with the service's lock held once it is in the round."""
        s = self.shared.settings
        plog = self.log
        with self.lock:
            fs = self.state
            verdict = admission.admit(
                meta,
                version=fs.version,
                high_water=self.high_water(meta.learner_id),
                max_staleness=s.max_staleness,
            )
            if verdict == "duplicate":
                return None, None, fs.version
            admission.check_norm(
                n,
                self.spec,
                theta_norm=self.theta_norm(),
                recent=fs.norms,
                max_update_ratio=s.max_update_ratio,
                max_norm_ratio=s.max_norm_ratio,
            )
            ticket = plog.reserve(len(payload))  # its place in the log, in round order
            try:
                fs.norms = [*fs.norms, n][-admission.NORM_HISTORY :]
                self.hold(
                    meta, delta, noted, opens=verdict == "fresh", norms=norms, body=payload,
                    dense=dense,
                )  # fmt: skip
            except BaseException as e:
                self._unheld(plog, ticket, e)
                raise
            # the round after the one a merge in flight took, if any
            return ticket, self.sum, fs.version + (2 if self.merging else 1)

    def hold(
        self,
        meta: UpdateMeta,
        delta: dict[str, Term],
        noted: Callable[[UpdateMeta], None],
        opens: bool | None = None,
        norms: dict[str, float] | None = None,
        body: memoryview | bytes | None = None,
        dense: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Add an accepted update to the open round (the caller holds this fragment's lock
        or is starting up); `body`: the payload `delta` views (None: `delta` is float32 of
        `POOL`, a test's). `dense`: a quantized `delta`'s float32 of `POOL`: its round-sum
        term, or what a second update of the learner's in this round adds to its
        contribution (consumed either way)."""
        if opens is None:
            opens = meta.base_version == self.state.version
        # the round changes only under this fragment's lock (held): a learner's next update
        # is summed into its contribution, and its term in the round's sum replaced (passes
        # over the fragment), outside the service's lock
        pending = self.round.contributions.get(meta.learner_id)
        if pending is not None:
            if dense is not None:  # summed from the float32 made already (same bits)
                self.sum.absorb(pending, meta, dense)
            else:
                self.sum.absorb(pending, meta, delta, body)
        with self.shared.lock:
            if pending is None:
                pending = Contribution.of(meta, delta, norms, body)
                self.sum.offer(pending, dense)
            self.shared.rounds.add(self.index, meta.learner_id, pending, opens=opens)
            noted(meta)

    def _unheld(self, plog: FragmentLog, ticket: Ticket, e: BaseException) -> None:
        """An update whose place in the log was reserved failed to be held (a bug): its place
        will never be written, so no record after it could be made durable (their syncs
        would wait for it forever). They fail instead, and the process stops: a restart
        reads the log up to that place (the records after it were never acknowledged)."""
        err = OSError(errno.EIO, f"an update's place was reserved and never written: {e!r}")
        plog.abandon(ticket, err)
        self._lost(err)

    def fill(self, ticket: Ticket, payload: memoryview | bytes, record: bytes) -> None:
        """Write the update's record in the place reserved for it (pending.py), outside the
        fragment's lock. The update is held in its round already, so a failed write (the
        disk's error: its place was allocated) leaves memory ahead of the log: the process
        stops, as for a failed fsync (`make_durable`)."""
        try:
            self.log.fill(ticket, payload, record)
        except OSError as e:
            self._lost(e)
            raise

    def make_durable(self, ticket: Ticket) -> None:
        """The update behind `ticket` is held in its round; return once it is durable too.
        If the fsync fails, what the disk holds is unknown (a failed fsync may drop the
        dirty pages it could not write), and the update is held in memory where a retry is
        answered `duplicate`: the only answer that keeps "accepted means kept" is to stop
        the process, so a restart replays exactly what the log holds (the clients re-send
        what they were never told was accepted)."""
        try:
            self.log.sync(ticket)
        except OSError as e:
            self._lost(e)
            raise

    def _lost(self, e: OSError) -> None:
        """A failed write or fsync of the pending log: stop the process."""
        log.critical("the pending log of fragment %d failed (%s): stopping", self.index, e)
        self.shared.lost(self.index, e)

    # ---- a merge --------------------------------------------------------------------
    def merge(self, live_tokens: Callable[[dict[str, Contribution]], float]) -> Merged | None:
        """Merge the open round (the caller holds `merge_lock`); None if it was empty.

        The fragment's lock is held twice, briefly: to take the round (and seal the log's
        segments that hold it) and to install the merged version. In between, the merge
        computes and persists while posts are admitted against the version still served,
        into the next round and a new segment; what it took stays visible to duplicate
        checks (`merging`). `live_tokens(taken)` (called with the service's lock held):
        the tokens the live set hands over per period, for `merge_scale = live`.
        A merge whose result is not finite raises `NonFiniteMerge`, and one that fails
        raises its error: either way nothing changed, and the contributions wait."""
        sh = self.shared
        plog = self.log
        with self.lock.first():
            with sh.lock:
                round_ = sh.rounds.take_round(self.index)
                summed, self.sum = self.sum, self.new_sum()
                tokens = live_tokens(round_.contributions)
                taken = round_.contributions
                if not taken:
                    summed.discard()
                    return None
                self.merging = taken
            segments = plog.seal()  # every record of `taken` (and none newer) is in these
            fs = self.state
            resync = self.resync
        started = sh.clock()
        phases: dict[str, float] = {}
        try:
            outcome, new, served, journaled = self._computed(
                fs, taken, tokens, resync, phases, summed, segments
            )
        except Exception:  # e.g. a full disk: nothing changed, the contributions wait
            self._put_back(taken)
            raise
        t_install = sh.clock()
        with self.lock.first():  # installed: served, and what posts are checked against
            new.norms = fs.norms  # the guard's history, with the posts admitted meanwhile
            self.state = new
            self._install_served(served)
            with sh.lock:
                self.merging = {}
            recycle = outcome is not None and self.writing is not fs
            if outcome is not None and not recycle:
                self.retired = fs
            if journaled:  # its segments wait for the file (journal.py)
                self.unsnapped.append((new.version, segments))
                # the file every `snapshot_every` merges (config.py), counted from the one
                # being written if any: the writer writes the latest state
                being = self.writing
                held = max(self.file_version, being.version if being else 0)
                ask = new.version - held >= sh.settings.tuning.snapshot_period()
        published = sh.clock()
        phases["install"] = published - t_install
        if journaled:
            if ask:
                sh.snapshots.request(self.index)
        else:  # the file holds it: the journal's records and the segments let go
            try:
                self.let_go(new.version, segments)
                self.resync = False
            finally:
                self.file_lock.release()
        if recycle:  # the superseded state (unless the file is being written from it)
            POOL.give([*fs.params.values(), *fs.momentum.values()])
        for c in taken.values():
            c.release()
        now = sh.clock()
        phases["finish"] = now - published
        return Merged(round_, taken, outcome, new.version, started, published, now, phases)

    def _computed(
        self,
        fs: FragmentState,
        taken: dict[str, Contribution],
        live_tokens: float,
        resync: bool,
        phases: dict[str, float],
        summed: RoundSum | None,
        segments: Sequence[PendingLog],
    ) -> tuple[MergeOutcome | None, FragmentState, Broadcast, bool]:
        """The next state from `taken`, durable, and its served encoding; `fs` and the
        contributions are only read. Durable as a merge journal record (True last), or
        (False) in the file, written here: then the caller holds `file_lock` on return and
        releases it once it has let go of the journal. `phases` gets the seconds of compute,
        encode and durable: the served payload is encoded (the cores) while the durable part
        waits for the disk (its fsyncs, in a `DURABLES` thread), so `durable` is what the
        disk took beyond the encode; it is served only once both are done.
        `segments`: the pending log's segments that hold `taken`'s records, made durable
        before the journal record that names them (an update is in its round before its
        uploader's fsync returns). Raises `NonFiniteMerge` for a result not finite."""
        sh = self.shared
        t0, sched0 = sh.clock(), thread_sched()
        try:
            with sh.computing:
                outcome = sh.policy.merge(
                    self.spec, fs.params, fs.momentum, fs.version, list(taken.values()),
                    live_tokens, summed,
                )  # fmt: skip
        finally:
            if summed is not None:
                summed.discard()  # claimed by the merge, or let go of here
        new = next_state(fs, taken, outcome)
        t1, sched1 = sh.clock(), thread_sched()
        phases["compute"] = t1 - t0
        if sched0 is not None and sched1 is not None:  # the log line's, not a histogram's
            phases["ran"], phases["queued"] = sched1[0] - sched0[0], sched1[1] - sched0[1]
        journaled = (
            outcome is not None
            and not resync
            and new.version - self.file_version <= sh.settings.tuning.snapshot_lag
        )
        persisting = DURABLES.submit(
            self._persist, fs, new, taken, live_tokens, journaled, segments,
            outcome is not None and outcome.streamed,
        )  # fmt: skip
        try:
            # beside the fsyncs: the cores while the disk works; a delta encoding's delta from
            # the version served now (one merge at a time: it stays served meanwhile)
            served = self.encode(new, self.served)
        except BaseException:
            self._abandon(persisting, journaled, outcome)
            raise
        t2 = sh.clock()
        try:
            durable_at, parts = persisting.result()
        except Exception:
            for view in served.views():  # never served
                sh.payloads.retire(self.index, view)
            give_back(outcome)
            raise
        phases["encode"], phases["durable"] = t2 - t1, max(0.0, durable_at - t2)
        phases.update({k: at - t1 for k, at in parts.items()})
        return outcome, new, served, journaled

    def _put_back(self, taken: dict[str, Contribution]) -> None:
        """A merge that changed nothing: its contributions wait in the round again, beside
        (or added to) what came while it ran; its log segments stay for the next merge."""
        with self.lock, self.shared.lock:
            self.sum.spoil()  # the round's order is no longer its terms' order
            self.shared.rounds.restore(self.index, taken, Contribution.add)
            self.merging = {}
            self.resync = True

    # ---- durable --------------------------------------------------------------------
    def _persist(
        self,
        fs: FragmentState,
        new: FragmentState,
        taken: dict[str, Contribution],
        live_tokens: float,
        journaled: bool,
        segments: Sequence[PendingLog],
        streamed: bool = False,
    ) -> tuple[float, dict[str, float]]:
        """`new` durable: as a journal record of its inputs, or in the file (then holding
        `file_lock`, see `_computed`); returns when it was done (the clock's), and for a
        journaled merge when its inputs and its record were (`SCHED_ONLY`).

        The record is written as soon as its digest is computed, beside the inputs' fsync:
        both wait for the disk's cache flush, and one after the other they waited for two.
        A crash between the two can leave the record durable and some of its inputs not:
        that merge was never served (it is served once both are durable), and replay drops
        the last record of a fragment whose inputs are short of its count (`inputs`,
        journal.py), so the updates that are there wait in the open round again."""
        sh = self.shared
        parts: dict[str, float] = {}
        if journaled:
            inputs = INPUTS.submit(self._inputs_durable, segments)  # the disk, beside
            try:
                record = MergeRecord(  # its digest (the cores)
                    version=fs.version,
                    ids=list(taken),
                    high_water={i: c.order for i, c in taken.items()},
                    live_tokens=float(live_tokens),
                    policy=policy_fields(sh.policy),
                    digest=digest(new),
                    stream=streamed,
                    inputs=sum(len(c.ids) for c in taken.values()),
                )
                self.journal.append(record)
                parts["record"] = sh.clock()
            finally:
                wait([inputs])  # whatever the record did: its thread is done with them
            parts["inputs"] = inputs.result()
        else:
            self.file_lock.acquire()  # no older state's write lands after it
            try:
                with sh.metrics.file_write.labels("merge").time():
                    sh.store.save_fragment(self.index, new)
            except BaseException:
                self.file_lock.release()
                raise
        return sh.clock(), parts

    def _abandon(
        self,
        persisting: Future[tuple[float, dict[str, float]]],
        journaled: bool,
        outcome: MergeOutcome | None,
    ) -> None:
        """A merge whose encode failed (its caller puts the round back): wait for its
        durable part, whatever it did, and let go of the file lock it holds if it wrote the
        file. A durable state that is never served is harmless: its version is taken again
        by the next merge, and the file and journal say which updates it merged."""
        try:
            persisting.result()
        except Exception:  # nothing of it held: its own error is the caller's to log
            pass
        else:
            if not journaled:
                self.file_lock.release()
        give_back(outcome)

    def _inputs_durable(self, segments: Sequence[PendingLog]) -> float:
        """The records a journaled merge names, durable before it is served: replay rebuilds
        the merge from them, and an update joins its round before its uploader's fsync
        returns. Mostly at once (those fsyncs ran beside the compute), and beside the
        record's digest and write (`_persist`, in `INPUTS`); returns when (the clock's). A
        failed one stops the process, as the uploader's would (`make_durable`)."""
        try:
            for seg in segments:
                seg.sync_all()
        except OSError as e:
            self._lost(e)
            raise
        return self.shared.clock()

    def write_file(self) -> None:
        """Write the served state to the file if the file is behind, then let go of what the
        file now holds (the background writer, snapshots.py, holds `file_lock`)."""
        with self.lock:
            cur = self.state
            if cur.version <= self.file_version:
                return
            self.writing = cur
        try:
            with self.shared.metrics.file_write.labels("background").time():
                self.shared.store.save_fragment(self.index, cur)
        finally:
            with self.lock:
                self.writing = None
                retired, self.retired = self.retired, None
            if retired is not None:
                POOL.give([*retired.params.values(), *retired.momentum.values()])
        self.let_go(cur.version, [])

    def let_go(self, version: int, segments: list[PendingLog]) -> None:
        """The file holds `version`: the journal's records up to it, and the log segments of
        the merges up to it, go (the caller holds `file_lock`)."""
        self.file_version = version
        self.journal.compact(version)
        with self.lock:
            done = [seg for v, segs in self.unsnapped if v <= version for seg in segs]
            self.unsnapped = [(v, segs) for v, segs in self.unsnapped if v > version]
        unique = {id(seg): seg for seg in [*done, *segments]}
        self.log.drop(list(unique.values()))

    def behind(self) -> int:
        """How many merges the file trails the installed state."""
        return self.state.version - self.file_version

    def replay(self, noted: Callable[[UpdateMeta], None]) -> int:
        """A restart: redo the journaled merges the file lacks (then write it), and put every
        accepted, not yet merged update of the log back in the round; returns how many."""
        back = read_back(self.shared.store, self.index, state=self.state, journal=self.journal)
        done = replay(back.state, self.spec, back.updates, back.merges)
        if done.merges:
            fs = self.state = done.state
            self._install_served(self.encode(fs))  # a delta encoding's copy: from Theta
            self.shared.store.save_fragment(self.index, fs)
            self.file_version = fs.version
            self.journal.compact(fs.version)
            log.info(
                "Redid %d journaled merges of fragment %d: version %d",
                done.merges,
                self.index,
                fs.version,
            )
        if done.dropped is not None:  # its version is the next merge's: no record of it
            self.journal.clear()
        for meta, delta, norms, body in done.rest:
            self.hold(meta, delta, noted, norms=norms, body=body)
        return len(done.rest)

    def close(self) -> None:
        self.journal.close()
