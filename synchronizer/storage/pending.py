"""The pending log: each fragment's accepted, not yet merged updates, on disk before
`accepted` is answered (out of state.py, which keeps the fragment files and the ledger).

    log = PendingLog(path)                   # one file (a segment: segments.py)
    ticket = log.reserve(len(payload))       # under the fragment's lock: its place in order
    log.fill(ticket, payload, header)        # outside it: the bytes written there
    log.sync(ticket)                         # durable on return (group commit)

The file starts with a header block naming its format (records.py, which also lays out a
record: a header block of length and XXH3-64, then the payload in whole blocks). A record
torn by a crash, or whose place was reserved and never written (either way it was never
acknowledged), is cut off when the log is read back, with every record after it.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

from ddiloco.synchronizer.buffers import ALIGN, BODIES, aligned
from ddiloco.synchronizer.storage.records import (
    PENDING,
    check_file_header,
    encoded,
    file_header,
    fsync_dir,
    record_header,
    records_in,
)

__all__ = ["PendingLog"]


class PendingLog:
    """Append-only, fsynced log of one fragment's accepted, not yet merged updates.

    The file's first block is its header (kind and format version, records.py); each record
    is a block holding its length and XXH3-64 checksum (`xxhash`: the GIL released, faster
    than zlib's crc32), then the payload zero padded to whole blocks.

    Direct I/O: records are written in whole `ALIGN`-byte blocks, so a body the upload
    port read into a `BODIES` buffer goes from that buffer to the disk with `O_DIRECT`:
    no copy into the page cache, whose page allocation and writeback cost the synchronizer
    more CPU than the copy itself (bench/RESULTS.md, "Figures behind the code"). Any other
    payload, or a file system that refuses `O_DIRECT`, is written through the page cache
    in the same format. Either way `sync` fsyncs.

    Order under the lock, bytes outside it: `reserve` (under the fragment's lock, in the order the
    round takes its updates) allocates the record's place at the end of the file (`posix_fallocate`:
    a full disk refuses the update there, before it is held), and `fill` writes it there (`pwrite`,
    outside the lock: under it, the fragment's other uploads queued behind each 32 MB write;
    bench/RESULTS.md, "Figures behind the code"). `write` is both. Group commit: `sync` waits until
    every record reserved before its own is filled, then makes them durable with one fsync, so the
    ones filled while an fsync runs share the next, and a record is acknowledged only once every
    record before it is durable: a crash leaves, after the acknowledged ones, at most records whose
    place is zeros or torn, cut off on reading. A failed fill (the disk's error after its place was
    allocated) fails every `sync` from then on: the caller stops the process. `remove` (after
    the merge that consumed every record is durable) deletes the file; a `sync` of a record
    written before it returns at once: that record is in the durable fragment file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        self.direct: int | None = None
        """The same file opened with `O_DIRECT` (None: not tried yet, or refused)."""
        self.direct_tried = False
        self.direct_refused = False
        """A direct write was refused (EINVAL): the page cache from then on (the descriptor
        stays open until `close`: a concurrent fill may be using it)."""
        self.generation = 0
        """Counts `remove`s: a record written in an earlier generation is merged and durable."""
        self.written = 0
        """Bytes reserved in this generation (reservations are serialized by the fragment
        lock)."""
        self.filled = 0
        """Bytes of this generation written, every record up to here (`fill`s end out of
        order: `done` holds the ones past a gap)."""
        self.done: dict[int, int] = {}
        """Filled records past `filled`: start -> end."""
        self.failed: OSError | None = None
        """A fill that failed: no record after it can be made durable."""
        self.synced = 0
        """Bytes of this generation known durable."""
        self.sync_lock = threading.Lock()
        self.fills = threading.Condition()
        """Guards `filled`, `done`, `failed`; notified as fills end."""

    def _open(self) -> int:
        if self.fd is None:
            new = not self.path.exists()
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                size = os.fstat(fd).st_size
                if size < ALIGN:  # new: its header, durable with the first record's fsync
                    if os.pwrite(fd, file_header(PENDING), 0) != ALIGN:
                        raise OSError(errno.EIO, f"short write to {self.path}")
                    size = ALIGN
                if new:
                    fsync_dir(self.path.parent)
            except BaseException:
                os.close(fd)  # opened again, header first, by the next reservation
                raise
            self.fd = fd
            self.written = self.filled = self.synced = size
        return self.fd

    def create(self) -> None:
        """Create the file now (its name durable), not at the first record."""
        self._open()

    def _direct(self) -> int | None:
        """The `O_DIRECT` descriptor, if the file system takes it."""
        if self.direct_refused:
            return None
        if not self.direct_tried:
            self.direct_tried = True
            if self.written % ALIGN == 0:
                try:
                    self.direct = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
                except (OSError, AttributeError):  # no O_DIRECT here: the page cache it is
                    self.direct = None
        return self.direct

    @staticmethod
    def record(payload: bytes | bytearray | memoryview) -> bytes:
        """The record header of `payload` (its checksum: a pass over the bytes, so callers
        compute it before they take a lock)."""
        return record_header(payload)

    def write(
        self, payload: bytes | bytearray | memoryview, header: bytes | None = None
    ) -> tuple[int, int]:
        """Append one record, not yet durable; returns the ticket `sync` takes."""
        ticket = self.reserve(len(payload))
        self.fill(ticket, payload, header)
        return ticket

    def reserve(self, n: int) -> tuple[int, int]:
        """The place of a record of an `n`-byte payload at the end of the log, allocated
        (a full disk raises here, nothing reserved); the caller holds the fragment's lock
        (records are in the order reserved). Returns the ticket `fill` and `sync` take."""
        fd = self._open()
        self._direct()  # decided here, under the lock, not by concurrent fills
        start = self.written
        size = ALIGN + aligned(n)
        try:
            os.posix_fallocate(fd, start, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                os.ftruncate(fd, start)
                raise
        self.written = start + size
        return self.generation, self.written

    def fill(
        self,
        ticket: tuple[int, int],
        payload: bytes | bytearray | memoryview,
        header: bytes | None = None,
    ) -> None:
        """Write the record reserved as `ticket` in its place; outside the fragment's lock,
        concurrently with other fills. A failure is the disk's (the place was allocated):
        every `sync` fails from then on."""
        generation, end = ticket
        size = ALIGN + aligned(len(payload))
        start = end - size
        try:
            head = header if header is not None else self.record(payload)
            if self._pwrite(start, size, payload, head) != size:
                raise OSError(errno.EIO, f"short write to {self.path}")
        except OSError as e:
            self.abandon(ticket, e)
            raise
        with self.fills:
            if generation != self.generation:
                return
            self.done[start] = end
            while self.filled in self.done:
                self.filled = self.done.pop(self.filled)
            self.fills.notify_all()

    def abandon(self, ticket: tuple[int, int], err: OSError) -> None:
        """The record reserved as `ticket` will never be filled: every `sync` of a record
        from it on fails with `err` (none of them can be made durable)."""
        with self.fills:
            if ticket[0] == self.generation:
                self.failed = err
            self.fills.notify_all()

    def _pwrite(
        self, start: int, size: int, payload: bytes | bytearray | memoryview, head: bytes
    ) -> int:
        n = len(payload)
        frame = BODIES.frame(payload) if start % ALIGN == 0 else None
        direct = self.direct if frame is not None and not self.direct_refused else None
        assert self.fd is not None
        if direct is not None and frame is not None:
            frame[: len(head)] = head  # the block in front of the body is ours
            frame[len(head) : ALIGN] = bytes(ALIGN - len(head))
            frame[ALIGN + n :] = bytes(size - ALIGN - n)
            try:
                return os.pwrite(direct, frame, start)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct_refused = True  # refused after all (alignment): the page cache
        parts: list[Any] = [head + bytes(ALIGN - len(head)), payload, bytes(aligned(n) - n)]
        return os.pwritev(self.fd, parts, start)

    encoded = staticmethod(encoded)

    def sync(self, ticket: tuple[int, int]) -> None:
        """Return once the record behind `ticket` is durable: in the log (one fsync for
        every record filled before it started, once every record before this one is) or
        merged into a durable fragment file. Raises the failed fill's error if a record up
        to this one could not be written."""
        generation, end = ticket
        if generation != self.generation or self.synced >= end:
            return  # durable already: no wait for the lock (another fsync, or a `remove`)
        with self.fills:
            while generation == self.generation and self.filled < end:
                if self.failed is not None:
                    raise OSError(self.failed.errno, f"a record before this one: {self.failed}")
                self.fills.wait()
        with self.sync_lock:
            if generation != self.generation or self.synced >= end:
                return
            with self.fills:
                target = self.filled
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
        start = check_file_header(self.path, data, PENDING)
        if start is None:  # created, never synced: nothing in it was acknowledged
            out, pos = [], 0
        else:
            out, pos = records_in(data, start)  # zeros: a place reserved, never filled
        if pos < len(data) and repair:
            with open(self.path, "rb+") as f:
                f.truncate(pos)
                os.fsync(f.fileno())
        return out

    def _next_generation(self) -> None:
        """Records written so far are merged and durable elsewhere: a new count (the caller
        holds `sync_lock`)."""
        with self.fills:
            self.generation += 1
            self.written = self.filled = self.synced = 0
            self.done.clear()
            self.failed = None
            self.fills.notify_all()

    def _close_fds(self) -> None:
        for fd in (self.fd, self.direct):
            if fd is not None:
                os.close(fd)
        self.fd = self.direct = None
        self.direct_tried = self.direct_refused = False

    def close(self) -> None:
        with self.sync_lock:
            self._close_fds()

    def remove(self) -> None:
        """Delete the file (its records are merged and durable elsewhere); a `sync` of a record in
        it returns at once. Not fsynced: a deletion a crash undoes replays records the fragment
        file's high-water marks skip. The unlink is outside the lock: freeing a segment's blocks
        takes a long time under load (bench/RESULTS.md, "Figures behind the code"), and a merge
        syncing its inputs waited for each segment the writer was deleting."""
        with self.sync_lock:
            self._close_fds()
            self._next_generation()
        self.path.unlink(missing_ok=True)
