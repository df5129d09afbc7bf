"""Durable synchronizer state: what a restarted synchronizer needs to resume exactly.

    <state_dir>/layout.json                 fragment layout, written once at init
    <state_dir>/model.json                  what the job trains (ModelSpec), written at init
    <state_dir>/fragment-0003.safetensors   Theta_p, momentum b_p, version, stats, high-water marks
    <state_dir>/pending-0003.000007.log     updates of p accepted since its last merge (the WAL),
                                            in segments; `pending-0003.log` is an older one's
    <state_dir>/merges-0003.log             merges of p its file does not hold yet (journal.py)
    <state_dir>/ledger.json                 learners (incarnations, contributions), totals

Whole files are replaced atomically (write a temporary file, fsync, rename, fsync the
directory), so a SIGKILL at any instant leaves the previous or the next version of each,
never a torn one. The pending log is append-only: an accepted update is appended and
fsynced before the synchronizer answers `accepted`. A merge seals the segments that hold
its round's records (new records go to a new segment while it computes and persists) and
deletes them only once the fragment file holds the merge that consumed them; a merge is
durable before that, as a merge journal record of its inputs (journal.py), and a restart
redoes the journaled merges the file lacks, then replays every segment left, skipping
what the high-water marks say is merged. A record torn by a crash (it was never
acknowledged) is cut off when the log is read back.

A fragment file is written from the tensors' own memory (`codec.pieces`: header, then each
tensor's bytes, no serialized copy in between), then fsynced: in the background, up to
`snapshot_lag` merges behind the version served (journal.py), or before it is served.

A fragment file carries, per learner, the highest (incarnation, learner_step) merged into
it: with the pending log's records it tells a restarted synchronizer exactly which
updates it already holds, however long ago they came.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from ddiloco.synchronizer import codec
from ddiloco.synchronizer.buffers import ALIGN, BODIES, aligned
from ddiloco.synchronizer.direct import write_direct
from ddiloco.synchronizer.protocol import Layout, ModelSpec

Tensors = dict[str, torch.Tensor]
Order = tuple[int, int]
"""(incarnation, learner_step): the position of an update among one learner's of a fragment."""

_RECORD = struct.Struct("<QI")  # payload length (| _XXH3 | _ALIGNED), checksum of the payload
_XXH3 = 1 << 63
_ALIGNED = 1 << 62
"""A record of `ALIGN`-byte blocks: the header alone in the first, then the payload, zero
padded to a whole block (every record written since direct I/O; older ones are packed)."""
_FLAGS = _XXH3 | _ALIGNED


@dataclass
class FragmentState:
    params: Tensors
    momentum: Tensors
    version: int = 0
    merges: int = 0
    tokens_merged: int = 0
    contributions: int = 0
    high_water: dict[str, Order] = field(default_factory=dict)
    """Per learner, the highest update order merged into this fragment."""
    norms: list[float] = field(default_factory=list)
    """Norms of recently accepted updates (the relative guard's history survives restarts)."""
    theta_norm: float | None = field(default=None, init=False, repr=False, compare=False)
    """The norm of `params`, computed once (`Synchronizer._theta_norm`). Not an init field,
    so `dataclasses.replace` (how a merge makes the next state) never carries it over to
    new params; code that assigns `params` in place must reset it."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(path: Path, parts: list[memoryview | bytes]) -> None:
    """Write `parts` one after the other into a new file (not yet fsynced)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view[: 1 << 30]) :]
    finally:
        os.close(fd)


def _replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def _xxh3(data: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


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
        out, pos = [], 0
        while pos + _RECORD.size <= len(data):
            flagged, crc = _RECORD.unpack_from(data, pos)
            n = flagged & ~_FLAGS
            start = pos + (ALIGN if flagged & _ALIGNED else _RECORD.size)
            end = start + (aligned(n) if flagged & _ALIGNED else n)
            body = data[start : start + n]
            check = _xxh3 if flagged & _XXH3 else zlib.crc32
            if len(body) < n or end > len(data) or check(body) != crc:
                break
            out.append(body)
            pos = end
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
        the fragment file's high-water marks skip."""
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


class StateStore:
    """Reads and durably writes the files above; one instance per state directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs: dict[int, FragmentLog] = {}
        self.logs_lock = threading.Lock()
        """First posts of a fragment come concurrently: two `FragmentLog`s of one fragment
        would each number segments on their own (one's writes invisible to the other's
        seal and read; a CI run read 23 of 24 accepted records back from the live log)."""

    def _fragment_path(self, p: int) -> Path:
        return self.root / f"fragment-{p:04d}.safetensors"

    def pending(self, p: int) -> FragmentLog:
        with self.logs_lock:
            if p not in self.logs:
                self.logs[p] = FragmentLog(self.root, p)
            return self.logs[p]

    def close(self) -> None:
        for log in self.logs.values():
            log.close()

    def load_layout(self) -> Layout | None:
        path = self.root / "layout.json"
        return Layout.model_validate_json(path.read_text()) if path.exists() else None

    def save_layout(self, layout: Layout) -> None:
        tmp = self.root / ".layout.json.tmp"
        tmp.write_text(layout.model_dump_json())
        _replace(tmp, self.root / "layout.json")

    def load_model(self) -> ModelSpec | None:
        path = self.root / "model.json"
        return ModelSpec.model_validate_json(path.read_text()) if path.exists() else None

    def save_model(self, model: ModelSpec) -> None:
        tmp = self.root / ".model.json.tmp"
        tmp.write_text(model.model_dump_json())
        _replace(tmp, self.root / "model.json")

    def save_fragment(self, p: int, fs: FragmentState) -> None:
        tensors = {f"param/{k}": v for k, v in fs.params.items()}
        tensors |= {f"momentum/{k}": v for k, v in fs.momentum.items()}
        meta = {
            "version": str(fs.version),
            "merges": str(fs.merges),
            "tokens_merged": str(fs.tokens_merged),
            "contributions": str(fs.contributions),
            "high_water": json.dumps({k: list(v) for k, v in fs.high_water.items()}),
            "norms": json.dumps(fs.norms),
        }
        final = self._fragment_path(p)
        tmp = final.with_name(f".{final.name}.tmp")
        parts = codec.pieces(tensors, meta)  # the tensors' own bytes: no serialized copy
        if parts is None:
            save_file(tensors, str(tmp), metadata=meta)
        elif not write_direct(tmp, parts):
            _write_all(tmp, parts)
        _replace(tmp, final)

    def fragment_version(self, p: int) -> int:
        """The version fragment p's file holds (its header only)."""
        with safe_open(str(self._fragment_path(p)), framework="pt") as f:
            return int((f.metadata() or {}).get("version", 0))

    def load_fragment(self, p: int) -> FragmentState:
        params: Tensors = {}
        momentum: Tensors = {}
        with safe_open(str(self._fragment_path(p)), framework="pt") as f:
            meta = f.metadata() or {}
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                kind, _, name = key.partition("/")
                (params if kind == "param" else momentum)[name] = f.get_tensor(key)
        return FragmentState(
            params=params,
            momentum=momentum,
            version=int(meta.get("version", 0)),
            merges=int(meta.get("merges", 0)),
            tokens_merged=int(meta.get("tokens_merged", 0)),
            contributions=int(meta.get("contributions", 0)),
            high_water={
                k: (int(v[0]), int(v[1]))
                for k, v in json.loads(meta.get("high_water", "{}")).items()
            },
            norms=[float(x) for x in json.loads(meta.get("norms", "[]"))],
        )

    def load_fragments(self, layout: Layout) -> list[FragmentState]:
        return [self.load_fragment(f.index) for f in layout.fragments]

    def save_ledger(self, ledger: dict[str, Any]) -> None:
        tmp = self.root / ".ledger.json.tmp"
        tmp.write_text(json.dumps(ledger, sort_keys=True))
        _replace(tmp, self.root / "ledger.json")

    def load_ledger(self) -> dict[str, Any]:
        path = self.root / "ledger.json"
        return json.loads(path.read_text()) if path.exists() else {}
