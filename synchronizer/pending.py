"""The pending log: each fragment's accepted, not yet merged updates, on disk before
`accepted` is answered (out of state.py, which keeps the fragment files and the ledger).

    log = FragmentLog(root, p)               # its segments, found on disk
    ticket = log.write(payload, header)      # under the fragment's lock, not yet durable
    log.sync(ticket)                         # outside it: durable on return (group commit)
    taken = log.seal()                       # a merge takes every record written so far
    log.drop(taken)                          # once the merged fragment is durable

A record is an 8-byte length, a 4-byte checksum and the payload (see `PendingLog`); a
record torn by a crash (it was never acknowledged) is cut off when the log is read back.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
import zlib
from pathlib import Path
from typing import Any

import xxhash

from ddiloco.synchronizer.buffers import ALIGN, BODIES, aligned

__all__ = ["FragmentLog", "PendingLog", "Ticket", "records_in"]

_RECORD = struct.Struct("<QI")  # payload length (| _XXH3 | _ALIGNED), checksum of the payload
_XXH3 = 1 << 63
_ALIGNED = 1 << 62
"""A record of `ALIGN`-byte blocks: the header alone in the first, then the payload, zero
padded to a whole block (every record written since direct I/O; older ones are packed)."""
_FLAGS = _XXH3 | _ALIGNED


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _xxh3(data: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


def records_in(data: bytes, *, zero_ends: bool = False) -> tuple[list[bytes], int]:
    """The whole records at the start of `data` (`PendingLog`'s format), and where they
    end: at the end of `data`, a torn record, or (`zero_ends`) a header of zeros, which
    would read as an empty record of the old format (a preallocated file's free space,
    journalfile.py)."""
    out, pos = [], 0
    while pos + _RECORD.size <= len(data):
        flagged, crc = _RECORD.unpack_from(data, pos)
        if zero_ends and flagged == 0 and crc == 0:
            break
        n = flagged & ~_FLAGS
        start = pos + (ALIGN if flagged & _ALIGNED else _RECORD.size)
        end = start + (aligned(n) if flagged & _ALIGNED else n)
        body = data[start : start + n]
        check = _xxh3 if flagged & _XXH3 else zlib.crc32
        if len(body) < n or end > len(data) or check(body) != crc:
            break
        out.append(body)
        pos = end
    return out, pos


class PendingLog:
    """Append-only, fsynced log of one fragment's accepted, not yet merged updates.

    A record is an 8-byte length, a 4-byte checksum, the payload. The checksum is the low
    32 bits of XXH3-64 (`xxhash`: 9 GB/s here, the GIL released, against zlib's crc32 at
    1.7 GB/s, which was 11% of the synchronizer's busy time under `bench/sync_ingest.py`),
    flagged by the length's top bit; a record without the flag (an older synchronizer's) is
    checked with zlib's crc32, so an upgrade replays the log it finds.

    Direct I/O: records are written in whole `ALIGN`-byte blocks (the header alone in the
    first block, flagged `_ALIGNED`, then the payload, zero padded), so a body the upload
    port read into a `BODIES` buffer goes from that buffer to the disk with `O_DIRECT`:
    no copy into the page cache, whose page allocation and writeback cost the synchronizer
    9 ms of CPU per 32 MB record against 0.6 (bench/RESULTS.md, issue 15). Any other
    payload, or a file system that refuses `O_DIRECT`, is written through the page cache
    in the same format. Either way `sync` fsyncs.

    Group commit: `write` (under the fragment's lock) appends without waiting for the disk,
    `sync` (outside it) makes every record written so far durable with one fsync, so the
    updates of one fragment queue for the page cache copy only, and the ones that arrive
    while an fsync runs share the next. `clear` (after the merge that consumed every record
    is durable) truncates in place; a `sync` of a record written before it returns at once:
    that record is in the durable fragment file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        self.direct: int | None = None
        """The same file opened with `O_DIRECT` (None: not tried yet, or refused)."""
        self.direct_tried = False
        self.generation = 0
        """Counts `clear`s: a record written in an earlier generation is merged and durable."""
        self.written = 0
        """Bytes appended in this generation (writes are serialized by the fragment lock)."""
        self.synced = 0
        """Bytes of this generation known durable."""
        self.sync_lock = threading.Lock()

    def _open(self) -> int:
        if self.fd is None:
            new = not self.path.exists()
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            if new:
                _fsync_dir(self.path.parent)
            self.written = self.synced = os.fstat(self.fd).st_size
        return self.fd

    def create(self) -> None:
        """Create the file now (its name durable), not at the first record."""
        self._open()

    def _direct(self) -> int | None:
        """The `O_DIRECT` descriptor, if the file system takes it and the file ends on a
        block boundary (it does unless an older synchronizer wrote it)."""
        if not self.direct_tried:
            self.direct_tried = True
            if self.written % ALIGN == 0:
                try:
                    self.direct = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_DIRECT)
                except (OSError, AttributeError):  # no O_DIRECT here: the page cache it is
                    self.direct = None
        return self.direct

    @staticmethod
    def record(payload: bytes | bytearray | memoryview) -> bytes:
        """The record header of `payload` (its checksum: a pass over the bytes, so callers
        compute it before they take a lock)."""
        return _RECORD.pack(len(payload) | _FLAGS, _xxh3(payload))

    def write(
        self, payload: bytes | bytearray | memoryview, header: bytes | None = None
    ) -> tuple[int, int]:
        """Append one record, not yet durable; returns the ticket `sync` takes."""
        fd = self._open()
        head = header if header is not None else self.record(payload)
        n = len(payload)
        size = ALIGN + aligned(n)
        frame = BODIES.frame(payload) if self.written % ALIGN == 0 else None
        direct = self._direct() if frame is not None else None
        try:
            if direct is not None and frame is not None:
                frame[: len(head)] = head  # the block in front of the body is ours
                frame[len(head) : ALIGN] = bytes(ALIGN - len(head))
                frame[ALIGN + n :] = bytes(size - ALIGN - n)
                try:
                    done = os.write(direct, frame)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    os.close(direct)  # refused after all (alignment): the page cache
                    self.direct = None
                    done = os.writev(fd, self._packed(head, payload, n))
            else:
                done = os.writev(fd, self._packed(head, payload, n))
        except OSError:
            os.ftruncate(fd, self.written)  # a torn record would hide the ones after it
            raise
        if done != size:  # a short write (a full disk): cut it off
            os.ftruncate(fd, self.written)
            raise OSError(f"short write to {self.path}")
        self.written += size
        return self.generation, self.written

    @staticmethod
    def _packed(head: bytes, payload: bytes | bytearray | memoryview, n: int) -> list[Any]:
        return [head + bytes(ALIGN - len(head)), payload, bytes(aligned(n) - n)]

    @classmethod
    def encoded(cls, payload: bytes) -> bytes:
        """One whole record of `payload`, as `write` lays it out (for a file written in
        one go: the merge journal's compaction)."""
        return b"".join(cls._packed(cls.record(payload), payload, len(payload)))

    def sync(self, ticket: tuple[int, int]) -> None:
        """Return once the record behind `ticket` is durable: in the log (one fsync for
        every record written before it started) or merged into a durable fragment file."""
        generation, end = ticket
        if generation != self.generation or self.synced >= end:
            return  # durable already: no wait for the lock (another fsync, or a `remove`)
        with self.sync_lock:
            if generation != self.generation or self.synced >= end:
                return
            target = self.written
            assert self.fd is not None
            os.fsync(self.fd)
            if generation == self.generation:
                self.synced = max(self.synced, target)

    def append(self, payload: bytes | bytearray) -> None:
        self.sync(self.write(payload))

    def sync_all(self) -> None:
        """Every record written so far durable (a sealed segment takes no more: all of it)."""
        self.sync((self.generation, self.written))

    def read(self, *, repair: bool = True) -> list[bytes]:
        """Every whole record; a torn tail (a crash mid-append) is cut off the file, unless
        `repair` is False (a reader beside a running synchronizer: `ddiloco export`)."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        out, pos = records_in(data)
        if pos < len(data) and repair:
            with open(self.path, "rb+") as f:
                f.truncate(pos)
                os.fsync(f.fileno())
        return out

    def clear(self) -> None:
        """Empty the log (after the merge that consumed every record in it is durable)."""
        with self.sync_lock:
            if self.fd is None:
                with open(self.path, "wb") as f:
                    os.fsync(f.fileno())
            else:
                os.ftruncate(self.fd, 0)
                os.fsync(self.fd)
            self.generation += 1
            self.written = self.synced = 0

    def _close_fds(self) -> None:
        for fd in (self.fd, self.direct):
            if fd is not None:
                os.close(fd)
        self.fd = self.direct = None
        self.direct_tried = False

    def close(self) -> None:
        with self.sync_lock:
            self._close_fds()

    def remove(self) -> None:
        """Delete the file (its records are merged and durable elsewhere); a `sync` of a
        record in it returns at once. Not fsynced: a deletion a crash undoes replays records
        the fragment file's high-water marks skip. The unlink is outside the lock: freeing
        a segment's blocks took 135-322 ms at 1 GB/s (bench/RESULTS.md), and a merge
        syncing its inputs waited for each segment the writer was deleting."""
        with self.sync_lock:
            self._close_fds()
            self.generation += 1
            self.written = self.synced = 0
        self.path.unlink(missing_ok=True)


Ticket = tuple[PendingLog, tuple[int, int]]


class FragmentLog:
    """One fragment's pending log as a series of `PendingLog` segments, so a merge can be
    persisted while the next round's updates are logged (bench/RESULTS.md, issue 15):

        ticket = log.write(payload, header)      # under the fragment's lock
        log.sync(ticket)                         # outside it: durable on return
        taken = log.seal()                       # under the lock, with the round it takes
        ...                                      # the merge computes and saves, unlocked
        log.drop(taken)                          # once the merged fragment is durable

    Segments are `pending-PPPP.NNNNNN.log` in the order written; an older synchronizer's
    single `pending-PPPP.log` is read first. Writes go to the open segment (created on the
    first write after a `seal`); `seal` closes it to writes and returns every sealed segment
    not yet dropped (a merge that failed leaves its segments to the next). A restart reads
    them all, in order, and writes to a new one."""

    def __init__(self, root: Path, p: int) -> None:
        self.root, self.p = root, p
        seqs = ((f.name.split(".")[1], f) for f in root.glob(f"pending-{p:04d}.*.log"))
        found = sorted((int(n), f) for n, f in seqs if n.isdigit())
        legacy = root / f"pending-{p:04d}.log"
        self.sealed: list[PendingLog] = [PendingLog(f) for f in [legacy] if f.exists()]
        self.sealed += [PendingLog(f) for _, f in found]
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
        if self.open is None:
            self.open = PendingLog(self.root / f"pending-{self.p:04d}.{self.next_seq:06d}.log")
            self.next_seq += 1
        return self.open, self.open.write(payload, header)

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
