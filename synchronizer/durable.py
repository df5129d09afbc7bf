"""A merge made durable, and what a restart redoes: the `Synchronizer`'s persistence, out of
merging.py and service.py.

`Durable` is a mixin of `Synchronizer` (through `Merging`), split out by seam, as the other
mixins are: its methods read and write the synchronizer's state (`fragments`, `journals`,
`snapshots`, `file_versions`, `unsnapped`, ...), documented in service.py.

    self._persist(p, fs, new, taken, ...)   # a merge durable: its journal record beside its
                                            # inputs' fsync (journal.py), or its file
    self._write_file(p)                     # the background writer (snapshots.py): the file,
    self._let_go(p, version, segments)      # then the journal's records and the segments
    self._replay()                          # a restart: the journaled merges the files lack
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from ddiloco.synchronizer.buffers import POOL
from ddiloco.synchronizer.contribution import Contribution
from ddiloco.synchronizer.merge import MergeOutcome
from ddiloco.synchronizer.storage.journal import MergeRecord, digest, policy_fields, replay
from ddiloco.synchronizer.storage.pending import PendingLog
from ddiloco.synchronizer.storage.state import FragmentState

log = logging.getLogger(__name__)

__all__ = ["DURABLES", "Durable", "give_back"]

DURABLES = ThreadPoolExecutor(32, thread_name_prefix="ddiloco-durable")
"""Where a merge's durable part (its fsyncs) runs while the merge's thread encodes the
payload it will serve (`Merging._merged`); threads are made as merges overlap."""
INPUTS = ThreadPoolExecutor(32, thread_name_prefix="ddiloco-inputs")
"""Where a journaled merge fsyncs the segments that hold its inputs while its durable part
computes and writes the record (`Durable._persist`): a pool of its own, as its callers run
in `DURABLES` (a task waiting for one queued behind it in the same pool could wait for
good)."""


def give_back(outcome: MergeOutcome | None) -> None:
    """A merge's result that will not be installed: its tensors back to the pool."""
    if outcome is not None:
        POOL.give([*outcome.params.values(), *outcome.momentum.values()])


class Durable:
    """The durable part of `Synchronizer`'s merges and its restart (a mixin: see the module
    docstring)."""

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
        for a journaled merge when its inputs and its record were (merging.py `SCHED_ONLY`).

        The record is written as soon as its digest is computed, beside the inputs' fsync:
        both wait for the disk's cache flush, and one after the other they waited for two
        (bench/RESULTS.md, "Figures behind the code"). A
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
                for view in self.served[p].views():
                    self.payloads.retire(p, view)
                self.served[p] = self._encode(p, fs)  # a delta encoding's copy: from Theta
                self.store.save_fragment(p, fs)
                self.file_versions[p] = fs.version
                self.journals[p].compact(fs.version)
                log.info(
                    "Redid %d journaled merges of fragment %d: version %d",
                    done.merges,
                    p,
                    fs.version,
                )
            if done.dropped is not None:  # its version is the next merge's: no record of it
                self.journals[p].clear()
            for meta, delta, norms, body in done.rest:
                self._hold(p, meta, delta, norms=norms, body=body)
                count += 1
        return count
