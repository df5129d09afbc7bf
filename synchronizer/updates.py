"""The update path of `Synchronizer`: an update's admission, from its header to durable.

A mixin, as merging.py is: its methods read and write the synchronizer's state (`fragments`,
`rounds`, `frag_locks`, `sums`, `store`, ...), set up in service.py.

    sync.body_limit(p)      # the largest body p's route reads (before the body)
    sync.submit(payload)    # decode, check, log, hold in the round, fsync: then `accepted`

An update is checked in this order, each refusal a `SyncError` that changes nothing: a model
to update (init done), its header (admission.parse_update), the shard that owns its
fragment, its learner, duplicate (under the synchronizer's lock, no decode), its encoding
and shapes (encodings.py), a finite norm, then under the fragment's lock its staleness and the
norm guard against the durable history.
"""

from __future__ import annotations

import errno
import logging

import torch

from ddiloco.synchronizer import admission, update_passes
from ddiloco.synchronizer.buffers import POOL
from ddiloco.synchronizer.contribution import Contribution
from ddiloco.synchronizer.merge import cap_counters
from ddiloco.synchronizer.metrics import encoding_of
from ddiloco.synchronizer.storage.pending import PendingLog
from ddiloco.synchronizer.storage.segments import FragmentLog, Ticket
from ddiloco.synchronizer.storage.state import FragmentState, Order
from ddiloco.synchronizer.update_passes import Term
from ddiloco.wire import codec, encodings
from ddiloco.wire.auth import JOB, Principal
from ddiloco.wire.errors import Refusal, SyncError
from ddiloco.wire.protocol import UpdateMeta, UpdateResponse
from ddiloco.wire.quant import Quantized

log = logging.getLogger(__name__)

HEADER_SLACK = 1 << 20
"""Bytes a safetensors header with metadata may add to a fragment's tensors."""

__all__ = ["HEADER_SLACK", "Updates"]


class Updates:
    """The update path of `Synchronizer` (a mixin: see the module docstring)."""

    def body_limit(self, p: int | None) -> int:
        """The largest body the update route of fragment p (None: the init route) can need;
        pure and lock-free. An update before init, or to a fragment that does not exist, is
        refused from its header alone."""
        if p is None:
            return self.settings.max_init_bytes
        if self.layout is None or not 0 <= p < len(self.layout.fragments):
            return HEADER_SLACK
        return self.layout.fragments[p].numel() * 4 + HEADER_SLACK

    def _high_water(self, p: int, learner_id: str) -> Order | None:
        """The highest order held for this learner and fragment, merged or pending."""
        marks = [self.fragments[p].high_water.get(learner_id)]
        for held in (self.rounds.rounds[p].contributions, self.merging[p]):
            c = held.get(learner_id)
            marks.append(c.order if c is not None else None)
        known = [m for m in marks if m is not None]
        return max(known) if known else None

    def submit(
        self, payload: bytes, path_fragment: int | None = None, speaker: Principal = JOB
    ) -> UpdateResponse:
        """Admit one update sent with `speaker`'s credential (routes.py and the upload port
        pass the request's; the job key by default)."""
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
        rec = self._learner(meta.learner_id)
        admission.check_tokens(meta, rec.tokens_per_step, self.settings.max_tokens_per_step)
        if meta.incarnation > rec.incarnation:  # the ledger's count is durable: a restart keeps it
            raise SyncError(
                Refusal.FORBIDDEN,
                f"update says incarnation {meta.incarnation} of learner {meta.learner_id!r}, "
                f"which has joined {rec.incarnation} time(s): incarnations are issued at join",
            )
        p, s = meta.fragment, self.settings
        spec = self.layout.fragments[p]
        with self.lock:  # a duplicate stays one (high-water marks only grow): no decode
            if admission.is_duplicate(meta, self._high_water(p, meta.learner_id)):
                return UpdateResponse(
                    status="duplicate", fragment=p, round_version=self.fragments[p].version
                )
        # The passes over the bytes run before the fragment's lock, so concurrent updates
        # of one fragment decode side by side: views of the body in the layout's shapes, in
        # an accepted encoding (415 else, encodings.py), its finite norm, the log record's
        # checksum. At most `cpu_slots` uploads measure and checksum at once (`cpu`): a merge
        # is not one runnable thread of sixteen. A quantized update is dequantized once into
        # float32 of `POOL` for its norm and its round-sum term (update_passes.py, stream.py), with
        # no slot: dequantizing is where its ingest spends its cores (a slot for it cut
        # int4's capacity by more than a third); it waits between chunks while a merge
        # computes instead (`merge_first`, locks.py). The round keeps only its codes.
        delta = encodings.decode_update(payload, header, spec, self.accepted)  # views of payload
        dense = None
        if any(isinstance(t, Quantized) for t in delta.values()):
            dense = {k: update_passes.dense(t, self.computing.wait) for k, t in delta.items()}
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
                ticket = plog.reserve(len(payload))  # its place in the log, in round order
                try:
                    fs.norms = [*fs.norms, n][-admission.NORM_HISTORY :]
                    self._hold(
                        p, meta, delta, opens=verdict == "fresh", norms=norms, body=payload,
                        dense=dense,
                    )  # fmt: skip
                except BaseException as e:
                    self._unheld(p, plog, ticket, e)
                    raise
                held = True
                summing = self.sums[p]
                # the round after the one a merge in flight took, if any
                round_version = fs.version + (2 if self.merging[p] else 1)
        finally:
            if not held and dense is not None:  # refused, or a duplicate
                POOL.give(dense.values())
        self._fill(p, plog, ticket, payload, record)  # its bytes, beside the fragment's others
        with self.cpu:
            summing.drain()  # its term in the round's sum (stream.py), unless another adds it
        self._make_durable(p, plog, ticket)  # one fsync for every record filled before it
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

    def _unheld(self, p: int, plog: FragmentLog, ticket: Ticket, e: BaseException) -> None:
        """An update whose place in the log was reserved failed to be held (a bug): its place
        will never be written, so no record after it could be made durable (their syncs
        would wait for it forever). They fail instead, and the process stops: a restart
        reads the log up to that place (the records after it were never acknowledged)."""
        err = OSError(errno.EIO, f"an update's place was reserved and never written: {e!r}")
        plog.abandon(ticket, err)
        self._log_lost(p, err)

    def _fill(
        self, p: int, plog: FragmentLog, ticket: Ticket, payload: memoryview | bytes, record: bytes
    ) -> None:
        """Write the update's record in the place reserved for it (pending.py), outside the
        fragment's lock. The update is held in its round already, so a failed write (the
        disk's error: its place was allocated) leaves memory ahead of the log: the process
        stops, as for a failed fsync (`_make_durable`)."""
        try:
            plog.fill(ticket, payload, record)
        except OSError as e:
            self._log_lost(p, e)
            raise

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
            self._log_lost(p, e)
            raise

    def _log_lost(self, p: int, e: OSError) -> None:
        """A failed write or fsync of fragment p's pending log: stop the process (`_fill`,
        `_make_durable`)."""
        log.critical("the pending log of fragment %d failed (%s): stopping", p, e)
        self.on_fatal()

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
        # p's round changes only under p's lock (held): a learner's next update is summed
        # into its contribution, and its term in the round's sum replaced (passes over the
        # fragment), outside the synchronizer's lock
        pending = self.rounds.rounds[p].contributions.get(meta.learner_id)
        if pending is not None:
            if dense is not None:  # summed from the float32 made already (same bits)
                self.sums[p].absorb(pending, meta, dense)
            else:
                self.sums[p].absorb(pending, meta, delta, body)
        with self.lock:
            if pending is None:
                pending = Contribution.of(meta, delta, norms, body)
                self.sums[p].offer(pending, dense)
            self.rounds.add(p, meta.learner_id, pending, opens=opens)
            if (rec := self.learners.get(meta.learner_id)) is not None:
                rec.period_tokens = cap_counters(
                    meta.tokens, meta.steps, self.policy.counter_cap_steps
                )[0]

    def reject(self, kind: Refusal | str = Refusal.INVALID) -> None:
        with self.lock:
            self.refusals[str(kind)] += 1
