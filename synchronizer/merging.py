"""Merging a fragment's round: the `Synchronizer`'s merge path, out of service.py.

`Merging` is a mixin of `Synchronizer` (service.py), split out by seam, not by owner: its
methods read and write the synchronizer's state (`fragments`, `rounds`, `frag_locks`,
`journals`, `snapshots`, ...), documented there. What happens in a merge:

    sync.merge(p)      # take p's round (under the fragment's lock, first: locks.py), compute
                       # the next version (`MergePolicy`, the round's streamed sum), make it
                       # durable (a journal record, or the fragment file: journal.py), encode
                       # its served copy, install it (the lock again), let go of its inputs

Its durable part (`_persist`), the background writer's `_write_file` and a restart's
`_replay` are in durable.py (`Durable`, this mixin's base); a refused merge puts its round
back (`_put_back`).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence

from ddiloco.synchronizer.broadcast import Broadcast
from ddiloco.synchronizer.buffers import POOL
from ddiloco.synchronizer.contribution import Contribution
from ddiloco.synchronizer.durable import DURABLES, Durable, give_back
from ddiloco.synchronizer.merge import MergeOutcome, NonFiniteMerge
from ddiloco.synchronizer.storage.journal import next_state
from ddiloco.synchronizer.storage.pending import PendingLog
from ddiloco.synchronizer.storage.state import FragmentState
from ddiloco.synchronizer.stream import RoundSum
from ddiloco.wire.protocol import FragmentSpec

log = logging.getLogger(__name__)

__all__ = ["Merging"]

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


class Merging(Durable):
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
                for view in self.served[p].views():
                    self.payloads.retire(p, view)
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
                self.metrics.merged(  # served since its install: `finish` lets go after
                    p,
                    round_,
                    outcome,
                    t_merge,
                    now,
                    len(self.fragments),
                    fs.version - 1,
                    timed,
                    served=t_finish,
                )
            with self.lock:
                for learner_id in taken:
                    if learner_id in self.learners:
                        self.learners[learner_id].contributions += 1
                        self.dirty.add(learner_id)  # its counts, and its period's tokens
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
    ) -> tuple[MergeOutcome | None, FragmentState, Broadcast, bool]:
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
            # beside the fsyncs: the cores while the disk works; a delta encoding's delta from
            # the version served now (one merge of p at a time: it stays served meanwhile)
            served = self._encode(p, new, self.served[p])
        except BaseException:
            self._abandon(p, persisting, journaled, outcome)
            raise
        t2 = self.clock()
        try:
            durable_at, parts = persisting.result()
        except Exception:
            for view in served.views():  # never served
                self.payloads.retire(p, view)
            give_back(outcome)
            raise
        phases["encode"], phases["durable"] = t2 - t1, max(0.0, durable_at - t2)
        phases.update({k: at - t1 for k, at in parts.items()})
        return outcome, new, served, journaled

    def _put_back(self, p: int, taken: dict[str, Contribution]) -> None:
        """A merge that changed nothing: its contributions wait in p's round again, beside
        (or added to) what came while it ran; its log segments stay for the next merge."""
        with self.frag_locks[p], self.lock:
            self.sums[p].spoil()  # the round's order is no longer its terms' order
            self.rounds.restore(p, taken, Contribution.add)
            self.merging[p] = {}
            self.resync[p] = True
