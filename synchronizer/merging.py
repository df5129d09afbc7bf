"""Merging a fragment's round: the `Synchronizer`'s merge path, out of service.py.

`Merging` is a mixin of `Synchronizer` (service.py), split out by seam, not by owner: its
methods read and write the synchronizer's state (`fragments`, `rounds`, `frag_locks`,
`journals`, `snapshots`, ...), documented there. What happens in a merge:

    sync.merge(p)      # take p's round (under the fragment's lock, first: locks.py), compute
                       # the next version (`MergePolicy`, the round's streamed sum), make it
                       # durable (a journal record, or the fragment file: journal.py), encode
                       # its served copy, install it (the lock again), let go of its inputs

The background writer (`Snapshots`) calls `_write_file`; a refused merge puts its round back
(`_put_back`).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from ddiloco.synchronizer.buffers import POOL
from ddiloco.synchronizer.contribution import Contribution
from ddiloco.synchronizer.journal import MergeRecord, digest, next_state, policy_fields
from ddiloco.synchronizer.merge import MergeOutcome, NonFiniteMerge
from ddiloco.synchronizer.pending import PendingLog
from ddiloco.synchronizer.protocol import FragmentSpec
from ddiloco.synchronizer.state import FragmentState
from ddiloco.synchronizer.stream import RoundSum

log = logging.getLogger("ddiloco.synchronizer.service")
"""The merge's lines log as the synchronizer's, as before the split."""

__all__ = ["Merging"]

DURABLES = ThreadPoolExecutor(32, thread_name_prefix="ddiloco-durable")
"""Where a merge's durable part (its fsyncs) runs while the merge's thread encodes the
payload it will serve (`Merging._merged`); threads are made as merges overlap."""
INPUTS = ThreadPoolExecutor(32, thread_name_prefix="ddiloco-inputs")
"""Where a journaled merge fsyncs the segments that hold its inputs while its durable part
computes the record's digest (`Merging._persist`): a pool of its own, as its callers run
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


class Merging:
    """The merge path of `Synchronizer` (a mixin: see the module docstring)."""

    def due(self) -> list[int]:
        with self.lock:
            return self.rounds.due()

    def _live_period_tokens(self, taken: dict[str, Contribution]) -> float:
        """The tokens the live set (and this merge's contributors) hands over per period,
        for `merge_scale = live`: each one's last update, a live learner not yet heard from
        counted at the mean of the others (the caller holds the lock)."""
        ids = self.rounds.live() | set(taken)
        known = [
            self.learners[i].period_tokens
            for i in ids
            if i in self.learners and self.learners[i].period_tokens > 0
        ]
        if not known:
            return 0.0
        return statistics.fmean(known) * len(ids)

    def merge(self, p: int) -> int | None:
        """Merge the open round of fragment p; returns the new version (None if nothing).

        The fragment's lock is held twice, briefly: to take the round (and seal the pending
        log's segments that hold it) and to install the merged version. In between, the
        merge computes and persists while posts of p are admitted against the version still
        served, into the next round and a new segment; what it took stays visible to
        duplicate checks (`merging`). One merge of p at a time (`merge_locks`)."""
        t0 = self.clock()
        assert self.layout is not None
        spec = self.layout.fragments[p]
        plog = self.store.pending(p)
        with self.merge_locks[p]:
            with self.frag_locks[p].first():
                with self.lock:
                    round_ = self.rounds.take_round(p)
                    summed, self.sums[p] = self.sums[p], self._round_sum(p)
                    live_tokens = self._live_period_tokens(round_.contributions)
                    taken = round_.contributions
                    if not taken:
                        summed.discard()
                        return None
                    self.merging[p] = taken
                segments = plog.seal()  # every record of `taken` (and none newer) is in these
                fs = self.fragments[p]
                resync = self.resync[p]
            t_merge = self.clock()
            phases: dict[str, float] = {}
            try:
                outcome, new, served, journaled = self._merged(
                    p, spec, fs, taken, live_tokens, resync, phases, summed, segments
                )
            except NonFiniteMerge as e:
                self._put_back(p, taken)
                with self.lock:
                    self.totals["merges_refused"] += 1
                log.error("Refused merge of fragment %d: %s; its contributions wait", p, e)
                return None
            except Exception:  # e.g. a full disk: nothing changed, the contributions wait
                self._put_back(p, taken)
                raise
            t_install = self.clock()
            with self.frag_locks[
                p
            ].first():  # installed: served, and what posts are checked against
                new.norms = fs.norms  # the guard's history, with the posts admitted meanwhile
                self.fragments[p] = new
                self.payloads.retire(p, self.served[p][1])
                self.served[p] = served
                with self.lock:
                    self.merging[p] = {}
                recycle = outcome is not None and self.writing[p] is not fs
                if outcome is not None and not recycle:
                    self.retired[p] = fs
                if journaled:  # its segments wait for the file (journal.py)
                    self.unsnapped[p].append((new.version, segments))
                    # the file every `snapshot_every` merges (config.py), counted from the
                    # one being written if any: the writer writes the latest state
                    being = self.writing[p]
                    held = max(self.file_versions[p], being.version if being else 0)
                    ask = new.version - held >= self.settings.snapshot_period()
            t_finish = self.clock()
            phases["install"] = t_finish - t_install
            assert self.snapshots is not None
            if journaled:
                if ask:
                    self.snapshots.request(p)
            else:  # the file holds it: the journal's records and the segments let go
                try:
                    self._let_go(p, new.version, segments)
                    self.resync[p] = False
                finally:
                    self.snapshots.locks[p].release()
            if recycle:  # the superseded fragment (unless its file is being written from it)
                POOL.give([*fs.params.values(), *fs.momentum.values()])
            for c in taken.values():
                c.release()
            fs = new
            if outcome is not None:  # published: its histograms, each observed once
                now = self.clock()
                phases["finish"] = now - t_finish
                timed = {k: v for k, v in phases.items() if k not in SCHED_ONLY}
                self.metrics.merged(
                    p, round_, outcome, t_merge, now, len(self.fragments), fs.version - 1, timed
                )
            with self.lock:
                for learner_id in taken:
                    if learner_id in self.learners:
                        self.learners[learner_id].contributions += 1
                if outcome is not None:
                    items = list(taken.items())
                    for i in outcome.included:
                        learner_id, c = items[i]
                        if learner_id in self.learners:
                            self.learners[learner_id].fragment_tokens_merged += c.tokens
                if outcome is not None:
                    self.totals["merged_contributors"] += outcome.contributors
                    self.totals["staleness_sum"] += outcome.staleness
                    self.totals["merge_scale_sum"] += outcome.scale
                    self.totals["merges_scaled"] += 1
                self.rounds.observe_sync(self.clock() - t0)
        self._save_ledger()
        self.on_change()
        if outcome is not None:
            log.info(  # served `now`: its time and parts, as the merge histograms saw them
                "Merged fragment=%d version=%d rule=%s contributors=%d tokens=%d sum=%s in %.0f ms"
                " (%s)",
                p,
                fs.version,
                outcome.rule,
                outcome.contributors,
                outcome.tokens,
                "streamed" if outcome.streamed else "resummed",
                (now - t_merge) * 1e3,
                ", ".join(f"{part} {s * 1e3:.0f}" for part, s in phases.items()),
            )
        return fs.version if outcome is not None else None

    def _merged(
        self,
        p: int,
        spec: FragmentSpec,
        fs: FragmentState,
        taken: dict[str, Contribution],
        live_tokens: float,
        resync: bool = False,
        phases: dict[str, float] | None = None,
        summed: RoundSum | None = None,
        segments: Sequence[PendingLog] = (),
    ) -> tuple[MergeOutcome | None, FragmentState, tuple[int, memoryview], bool]:
        """The next state of fragment p from `taken`, durable, and its served encoding;
        `fs` and the contributions are only read. Durable as a merge journal record (True
        last), or (False) in the fragment file, written here: then the caller holds
        `snapshots.locks[p]` on return and releases it once it has let go of the journal.
        `phases` gets the seconds of compute, encode and durable: the served payload is
        encoded (the cores) while the durable part waits for the disk (its fsyncs, in a
        `DURABLES` thread), so `durable` is what the disk took beyond the encode; it is
        served only once both are done.
        `segments`: the pending log's segments that hold `taken`'s records, made durable
        before the journal record that names them (an update is in its round before its
        uploader's fsync returns)."""
        phases = {} if phases is None else phases
        t0, sched0 = self.clock(), thread_sched()
        try:
            with self.computing:
                outcome = self.policy.merge(
                    spec, fs.params, fs.momentum, fs.version, list(taken.values()), live_tokens,
                    summed,
                )  # fmt: skip
        finally:
            if summed is not None:
                summed.discard()  # claimed by the merge, or let go of here
        new = next_state(fs, taken, outcome)
        t1, sched1 = self.clock(), thread_sched()
        phases["compute"] = t1 - t0
        if sched0 is not None and sched1 is not None:  # the log line's, not a histogram's
            phases["ran"], phases["queued"] = sched1[0] - sched0[0], sched1[1] - sched0[1]
        journaled = (
            outcome is not None
            and not resync
            and new.version - self.file_versions[p] <= self.settings.snapshot_lag
        )
        persisting = DURABLES.submit(
            self._persist, p, fs, new, taken, live_tokens, journaled, segments,
            outcome is not None and outcome.streamed,
        )  # fmt: skip
        try:
            served = self._encode(p, new)  # beside the fsyncs: the cores while the disk works
        except BaseException:
            self._abandon(p, persisting, journaled, outcome)
            raise
        t2 = self.clock()
        try:
            durable_at, parts = persisting.result()
        except Exception:
            self.payloads.retire(p, served[1])  # never served
            give_back(outcome)
            raise
        phases["encode"], phases["durable"] = t2 - t1, max(0.0, durable_at - t2)
        phases.update({k: at - t1 for k, at in parts.items()})
        return outcome, new, served, journaled

    def _persist(
        self,
        p: int,
        fs: FragmentState,
        new: FragmentState,
        taken: dict[str, Contribution],
        live_tokens: float,
        journaled: bool,
        segments: Sequence[PendingLog],
        streamed: bool = False,
    ) -> tuple[float, dict[str, float]]:
        """`new` durable: as a journal record of its inputs, or in its file (then holding
        `snapshots.locks[p]`, see `_merged`); returns when it was done (the clock's), and
        for a journaled merge when its inputs and its record were (`SCHED_ONLY`).

        The record is written as soon as its digest is computed, beside the inputs' fsync:
        both wait for the disk's cache flush, and one after the other they waited for two
        (the record's fdatasync took up to 181 ms after the inputs', bench/RESULTS.md). A
        crash between the two can leave the record durable and some of its inputs not:
        that merge was never served (it is served once both are durable), and replay drops
        the last record of a fragment whose inputs are short of its count (`inputs`,
        journal.py), so the updates that are there wait in the open round again."""
        assert self.snapshots is not None
        parts: dict[str, float] = {}
        if journaled:
            inputs = INPUTS.submit(self._inputs_durable, p, segments)  # the disk, beside
            try:
                record = MergeRecord(  # its digest (the cores)
                    version=fs.version,
                    ids=list(taken),
                    high_water={i: c.order for i, c in taken.items()},
                    live_tokens=float(live_tokens),
                    policy=policy_fields(self.policy),
                    digest=digest(new),
                    stream=streamed,
                    inputs=sum(len(c.ids) for c in taken.values()),
                )
                self.journals[p].append(record)
                parts["record"] = self.clock()
            finally:
                wait([inputs])  # whatever the record did: its thread is done with them
            parts["inputs"] = inputs.result()
        else:
            self.snapshots.locks[p].acquire()  # no older state's write lands after it
            try:
                with self.metrics.file_write.labels("merge").time():
                    self.store.save_fragment(p, new)
            except BaseException:
                self.snapshots.locks[p].release()
                raise
        return self.clock(), parts

    def _abandon(
        self,
        p: int,
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
                assert self.snapshots is not None
                self.snapshots.locks[p].release()
        give_back(outcome)

    def _inputs_durable(self, p: int, segments: Sequence[PendingLog]) -> float:
        """The records a journaled merge names, durable before it is served: replay rebuilds
        the merge from them, and an update joins its round before its uploader's fsync
        returns. Mostly at once (those fsyncs ran beside the compute), and beside the
        record's digest and write (`_persist`, in `INPUTS`); returns when (the clock's). A
        failed one stops the process, as the uploader's would (`_make_durable`)."""
        try:
            for seg in segments:
                seg.sync_all()
        except OSError as e:
            self._log_lost(p, e)
            raise
        return self.clock()

    def _write_file(self, p: int) -> None:
        """Write fragment p's served state to its file if the file is behind, then let go of
        what the file now holds (`Snapshots`, which holds `snapshots.locks[p]`)."""
        with self.frag_locks[p]:
            cur = self.fragments[p]
            if cur.version <= self.file_versions[p]:
                return
            self.writing[p] = cur
        try:
            with self.metrics.file_write.labels("background").time():
                self.store.save_fragment(p, cur)
        finally:
            with self.frag_locks[p]:
                self.writing[p] = None
                retired, self.retired[p] = self.retired[p], None
            if retired is not None:
                POOL.give([*retired.params.values(), *retired.momentum.values()])
        self._let_go(p, cur.version, [])

    def _let_go(self, p: int, version: int, segments: list[PendingLog]) -> None:
        """Fragment p's file holds `version`: its journal's records up to it, and the log
        segments of the merges up to it, go (the caller holds `snapshots.locks[p]`)."""
        self.file_versions[p] = version
        self.journals[p].compact(version)
        with self.frag_locks[p]:
            done = [seg for v, segs in self.unsnapped[p] if v <= version for seg in segs]
            self.unsnapped[p] = [(v, segs) for v, segs in self.unsnapped[p] if v > version]
        unique = {id(seg): seg for seg in [*done, *segments]}
        self.store.pending(p).drop(list(unique.values()))

    def flush(self, timeout: float = 60.0) -> None:
        """Return once every fragment file holds its served version (tests, export), those
        the writer was not yet asked for (`snapshot_every`) too."""
        if self.snapshots is not None:
            for p in self.owned:
                if self.fragments[p].version > self.file_versions[p]:
                    self.snapshots.request(p)
            self.snapshots.flush(timeout)

    def _put_back(self, p: int, taken: dict[str, Contribution]) -> None:
        """A merge that changed nothing: its contributions wait in p's round again, beside
        (or added to) what came while it ran; its log segments stay for the next merge."""
        with self.frag_locks[p], self.lock:
            self.sums[p].spoil()  # the round's order is no longer its terms' order
            self.rounds.restore(p, taken, Contribution.add)
            self.merging[p] = {}
            self.resync[p] = True
