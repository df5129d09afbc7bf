"""The merge journal's file: each record written over zeros written (and made durable)
before it, so a merge's record is durable with one `fdatasync` and no file-system commit.

    f = JournalFile(path)
    f.create()                 # the file: RESERVE bytes of zeros, durable, its name too
    f.append(payload)          # durable on return: one pwrite, one fdatasync
    f.read()                   # the records, up to the first header of zeros (or torn one)
    f.clear()                  # zeros over the records, in place
    tmp = f.prepare(keep)      # a file of `keep` and zeros beside it (no lock needed)
    f.replace(tmp, since)      # ... with the records appended since, renamed over it

Why (bench/RESULTS.md, "Figures behind the code"): an append to a file that grows changes its size
and its blocks, so its `fsync` commits the file system's journal, and on ext4 (data=ordered) that
commit waits for the data of every file with blocks allocated in it: the pending log's updates and
the fragment files the background writer was writing. The merge's durable part then took 150-670 ms
at p99 where its own bytes are one 8 KiB record. Written in place over blocks that hold zeros on
disk already, the record changes no metadata that `fdatasync` must write: it writes the record's
blocks and flushes the disk's cache.

The format is the pending log's (records.py: a header block naming the kind and format version,
then records of a 4 KiB block holding the record header and the payload padded to whole blocks),
with its own magic; a header of zeros ends the records (`records_in`). A torn record (a crash in the middle of `append`, or of `clear`,
which zeroes in place) ends the records; `read` zeroes everything after them, so no stale record can
follow a later one. What a torn `clear` leaves is a prefix of records the fragment file holds
already: replay skips those (journal.py `replay`: a record below the file's version).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from ddiloco.synchronizer.buffers import ALIGN
from ddiloco.synchronizer.storage.records import (
    JOURNAL,
    check_file_header,
    encoded,
    file_header,
    fsync_dir,
    records_in,
)

__all__ = ["RESERVE", "JournalFile"]

RESERVE: Final = 256 << 10
"""Zeros kept ahead of the records: 32 records of 8 KiB (a merge record is one header
block and one block of JSON up to ~60 learners); the file doubles when they run out."""

_datasync = getattr(os, "fdatasync", os.fsync)
"""`fdatasync` where the platform has it (not macOS): the file's data, not its times."""


class JournalFile:
    """One preallocated record file (module docstring). Not thread-safe: its owner
    (`MergeJournal`) serializes the calls."""

    def __init__(self, path: Path, reserve: int = RESERVE) -> None:
        self.path = path
        self.reserve = reserve
        self.fd: int | None = None
        self.end = ALIGN
        """Where the next record goes: the end of the records (after the file header)."""
        self.size = 0
        """The file's size: `end` and the zeros after it."""

    def _open(self) -> int:
        if self.fd is not None:
            return self.fd
        new = not self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            data = os.pread(fd, size, 0) if size else b""
            changed = False
            if check_file_header(self.path, data, JOURNAL) is None:  # new, or never durable
                data = file_header(JOURNAL) + bytes(max(0, size - ALIGN))
                _write_all(fd, data, 0)
                size = len(data)
                changed = True
            _, self.end = records_in(data)
            self.size = size
            changed = self._zero_after(fd, data) or changed
            if self.size - self.end < self.reserve:  # new
                self._grow(fd, self.end + self.reserve)
            elif changed:
                os.fsync(fd)
            if new:
                fsync_dir(self.path.parent)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return fd

    def _zero_after(self, fd: int, data: bytes) -> bool:
        """Zeros over whatever follows the records (a torn one); whether any was written."""
        tail = data[self.end :]
        if not tail.strip(b"\0"):
            return False
        os.pwrite(fd, bytes(len(tail)), self.end)
        return True

    def _grow(self, fd: int, size: int) -> None:
        """The file `size` bytes long, zeros after `self.size`, durable (the file's size
        and blocks: a full fsync, once per doubling)."""
        size = max(size, 2 * self.size)
        if size > self.size:
            _write_all(fd, bytes(size - self.size), self.size)
            self.size = size
        os.fsync(fd)

    def create(self) -> None:
        """The file now (zeros, durable, its name too), not at the first record."""
        self._open()

    def append(self, payload: bytes) -> None:
        """One record, durable on return. A failed write is zeroed again (best effort)
        and raised; a failed `fdatasync` is raised (the caller stops: fragment.py)."""
        fd = self._open()
        rec = encoded(payload)
        if self.end + len(rec) > self.size:
            self._grow(fd, self.end + len(rec) + self.reserve)
        try:
            _write_all(fd, rec, self.end)
        except OSError:
            with contextlib.suppress(OSError):  # else: a torn record, which ends them
                os.pwrite(fd, bytes(len(rec)), self.end)
            raise
        _datasync(fd)
        self.end += len(rec)

    def read(self, *, repair: bool = True) -> list[bytes]:
        """Every whole record; what follows them (a torn record) is zeroed unless `repair`
        is False (a reader beside a running synchronizer: `ddiloco export`)."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        start = check_file_header(self.path, data, JOURNAL)
        if start is None:  # created, its header never durable: no record either
            return []
        out, end = records_in(data, start)
        if repair and data[end:].strip(b"\0"):
            fd = os.open(self.path, os.O_WRONLY)
            try:
                os.pwrite(fd, bytes(len(data) - end), end)
                os.fsync(fd)
            finally:
                os.close(fd)
            if self.fd is not None:
                self.end = end
        return out

    def clear(self) -> None:
        """No records: zeros over them, in place (one fdatasync: no metadata changes)."""
        fd = self._open()
        if self.end > ALIGN:
            _write_all(fd, bytes(self.end - ALIGN), ALIGN)
            _datasync(fd)
        self.end = ALIGN

    def prepare(self, keep: Sequence[bytes]) -> Path:
        """A file of `keep` and zeros beside this one, fsynced (`replace` puts it in
        place): written without the owner's lock, while merges append here."""
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        body = file_header(JOURNAL) + b"".join(encoded(r) for r in keep)
        with open(tmp, "wb") as f:
            f.write(body + bytes(max(self.reserve, self.size - len(body))))
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def replace(self, tmp: Path, since: Sequence[bytes] = ()) -> None:
        """`tmp` (from `prepare`), with the records appended here since, renamed over this
        file, the directory fsynced: durable before the next append."""
        if since:
            fd = os.open(tmp, os.O_RDWR)
            try:
                data = os.pread(fd, os.fstat(fd).st_size, 0)
                _, end = records_in(data)
                _write_all(fd, b"".join(encoded(r) for r in since), end)
                os.fsync(fd)
            finally:
                os.close(fd)
        self.close()
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.fd = None
        self.end, self.size = ALIGN, 0


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"short write at {offset}")
        view, offset = view[n:], offset + n
