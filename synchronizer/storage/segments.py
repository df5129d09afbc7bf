"""A fragment's pending log as a series of segments (`PendingLog` files, pending.py), so a
merge can be persisted while the next round's updates are logged:

    log = FragmentLog(root, p)               # its segments, found on disk
    ticket = log.reserve(len(payload))       # under the fragment's lock: its place in order
    log.fill(ticket, payload, header)        # outside it: the bytes written there
    log.sync(ticket)                         # durable on return (group commit)
    taken = log.seal()                       # a merge takes every record written so far
    log.drop(taken)                          # once the merged fragment is durable
"""

from __future__ import annotations

import threading
from pathlib import Path

from ddiloco.synchronizer.storage.pending import PendingLog

__all__ = ["FragmentLog", "Ticket"]

Ticket = tuple[PendingLog, tuple[int, int]]


class FragmentLog:
    """One fragment's pending log as a series of `PendingLog` segments, so a merge can be
    persisted while the next round's updates are logged (the merge holds no lock that
    uploads of its fragment wait for):

        ticket = log.reserve(len(payload))       # under the fragment's lock
        log.fill(ticket, payload, header)        # outside it
        log.sync(ticket)                         # durable on return
        taken = log.seal()                       # under the lock, with the round it takes
        ...                                      # the merge computes and saves, unlocked
        log.drop(taken)                          # once the merged fragment is durable

    Segments are `pending-PPPP.NNNNNN.log` in the order written. Writes go to the open segment (created on the
    first write after a `seal`); `seal` closes it to writes and returns every sealed segment
    not yet dropped (a merge that failed leaves its segments to the next). A restart reads
    them all, in order, and writes to a new one."""

    def __init__(self, root: Path, p: int) -> None:
        self.root, self.p = root, p
        seqs = ((f.name.split(".")[1], f) for f in root.glob(f"pending-{p:04d}.*.log"))
        found = sorted((int(n), f) for n, f in seqs if n.isdigit())
        self.sealed: list[PendingLog] = [PendingLog(f) for _, f in found]
        self.next_seq = found[-1][0] + 1 if found else 1
        self.open: PendingLog | None = None
        self.segments_lock = threading.Lock()
        """Guards `sealed`: `drop` may come from the snapshot thread (journal.py)."""

    @property
    def path(self) -> Path:
        """The segment that takes writes now (the last one, before any write)."""
        if self.open is not None:
            return self.open.path
        if self.sealed:
            return self.sealed[-1].path
        return self.root / f"pending-{self.p:04d}.{self.next_seq:06d}.log"

    def write(self, payload: bytes | bytearray | memoryview, header: bytes | None = None) -> Ticket:
        ticket = self.reserve(len(payload))
        self.fill(ticket, payload, header)
        return ticket

    def reserve(self, n: int) -> Ticket:
        """A record's place in the open segment (`PendingLog.reserve`; under the fragment's
        lock)."""
        if self.open is None:
            self.open = PendingLog(self.root / f"pending-{self.p:04d}.{self.next_seq:06d}.log")
            self.next_seq += 1
        return self.open, self.open.reserve(n)

    @staticmethod
    def fill(
        ticket: Ticket, payload: bytes | bytearray | memoryview, header: bytes | None = None
    ) -> None:
        log, at = ticket
        log.fill(at, payload, header)

    @staticmethod
    def abandon(ticket: Ticket, err: OSError) -> None:
        log, at = ticket
        log.abandon(at, err)

    @staticmethod
    def sync(ticket: Ticket) -> None:
        log, at = ticket
        log.sync(at)

    def append(self, payload: bytes | bytearray) -> None:
        self.sync(self.write(payload))

    def _segments(self) -> list[PendingLog]:
        with self.segments_lock:
            return [*self.sealed, *([self.open] if self.open else [])]

    def read(self, *, repair: bool = True) -> list[bytes]:
        """Every whole record of every segment, in the order written."""
        return [r for log in self._segments() for r in log.read(repair=repair)]

    def seal(self) -> list[PendingLog]:
        """Close the open segment to writes; every segment not yet dropped, for the merge
        that takes every record written so far (the caller holds the fragment's lock)."""
        with self.segments_lock:
            if self.open is not None:
                self.sealed.append(self.open)
                self.open = None
            return list(self.sealed)

    def drop(self, segments: list[PendingLog]) -> None:
        """Delete segments whose every record is merged into a durable fragment file."""
        gone = {id(log) for log in segments}
        with self.segments_lock:
            self.sealed = [log for log in self.sealed if id(log) not in gone]
        for log in segments:
            log.remove()

    def close(self) -> None:
        for log in self._segments():
            log.close()
