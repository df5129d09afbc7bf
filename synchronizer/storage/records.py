"""The record files' common format (the pending log's segments and the merge journal) and the
state directory's format version, which every file on disk carries (docs/storage.md).

    head = file_header(PENDING)              # block 0 of a new record file
    start = check_file_header(path, data, PENDING)   # where its records start (or refused)
    rec = encoded(payload)                   # one record: header block, payload, padding
    payloads, end = records_in(data, start)  # the whole records, and where they end

A record file starts with one `ALIGN`-byte block: an 8-byte magic naming the kind of file
and the 4-byte little-endian format version (`FORMAT`), then zeros. Each record follows in
whole `ALIGN`-byte blocks: a block holding the record header (8-byte payload length, 8-byte
XXH3-64 of the payload, little-endian) and zeros, then the payload zero-padded to a whole
block. Whole blocks let a body go from its upload buffer to the disk with `O_DIRECT`.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Final

import xxhash

from ddiloco.synchronizer.buffers import ALIGN, aligned

__all__ = [
    "FORMAT",
    "JOURNAL",
    "PENDING",
    "StateFormatError",
    "check_file_header",
    "checksum",
    "encoded",
    "file_header",
    "fsync_dir",
    "load_json",
    "record_header",
    "records_in",
    "replace",
    "save_json",
]

FORMAT: Final = 1
"""The state directory's format version: in every file it holds (the JSON files' `format`,
the fragment files' `format` metadata, the record files' header, the ledger's
`user_version`). A file of another version is refused, never read."""

PENDING: Final = b"ddpend\0\0"
"""The magic of a pending log segment (`pending-PPPP.NNNNNN.log`)."""
JOURNAL: Final = b"ddmerge\0"
"""The magic of a merge journal (`merges-PPPP.log`)."""

_FILE = struct.Struct("<8sI")
_RECORD = struct.Struct("<QQ")  # payload length, XXH3-64 of the payload
RECORD_HEADER: Final = _RECORD.size


class StateFormatError(ValueError):
    """A file of the state directory is not of this synchronizer's format; one line, naming
    the file and both versions."""

    def __init__(self, path: Path, found: object, what: str = "") -> None:
        detail = f" ({what})" if what else ""
        super().__init__(
            f"{path} is state format {found}{detail}; this synchronizer reads format "
            f"{FORMAT} only: use a state directory of this version"
        )


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(tmp: Path, final: Path) -> None:
    """`tmp` fsynced, renamed over `final`, the directory fsynced: the old or the new file
    whatever a crash interrupts."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(final.parent)


def save_json(path: Path, kind: str, body: Any) -> None:
    """`{"format": FORMAT, kind: body}` written whole over `path` (`replace`)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"format": FORMAT, kind: body}, sort_keys=True))
    replace(tmp, path)


def load_json(path: Path, kind: str) -> Any:
    """The `kind` body `save_json` wrote to `path`; `StateFormatError` for a file of another
    format (or none), or one without `kind`."""
    try:
        saved = json.loads(path.read_text())
    except ValueError:
        raise StateFormatError(path, "unknown", "not JSON") from None
    found = saved.get("format") if isinstance(saved, dict) else None
    if found != FORMAT:
        raise StateFormatError(path, found)
    if kind not in saved or len(saved) != 2:
        raise StateFormatError(path, found, f"expected the keys format and {kind}")
    return saved[kind]


def file_header(magic: bytes) -> bytes:
    """Block 0 of a new record file of kind `magic`."""
    head = _FILE.pack(magic, FORMAT)
    return head + bytes(ALIGN - len(head))


def check_file_header(path: Path, data: bytes, magic: bytes) -> int | None:
    """Where the records of `data` (a record file's first bytes, at least `ALIGN` of them if
    it has them) start; None if its header was never made durable (a file created but never
    synced: it holds no acknowledged record). `StateFormatError` for another kind or version."""
    head = data[: _FILE.size]
    if len(data) < ALIGN or not head.strip(b"\0"):
        return None
    kind, version = _FILE.unpack(head)
    if kind != magic:
        raise StateFormatError(path, "unknown", f"not a {magic.rstrip(bytes(1)).decode()} file")
    if version != FORMAT:
        raise StateFormatError(path, version)
    return ALIGN


def checksum(payload: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def record_header(payload: bytes | bytearray | memoryview) -> bytes:
    """The header of a record of `payload` (its checksum is a pass over the bytes: callers
    compute it before they take a lock)."""
    return _RECORD.pack(len(payload), checksum(payload))


def encoded(payload: bytes | bytearray | memoryview, head: bytes | None = None) -> bytes:
    """One whole record of `payload`."""
    head = head if head is not None else record_header(payload)
    n = len(payload)
    return b"".join([head, bytes(ALIGN - len(head)), payload, bytes(aligned(n) - n)])


def records_in(data: bytes, start: int = ALIGN) -> tuple[list[bytes], int]:
    """The whole records of `data` from `start`, and where they end: at the end of `data`,
    at a header of zeros (a place reserved and never written, or a journal's free space),
    or at a torn record (short, or its checksum wrong)."""
    out, pos = [], start
    while pos + _RECORD.size <= len(data):
        n, check = _RECORD.unpack_from(data, pos)
        if n == 0 and check == 0:
            break
        body_at = pos + ALIGN
        end = body_at + aligned(n)
        body = data[body_at : body_at + n]
        if len(body) < n or end > len(data) or checksum(body) != check:
            break
        out.append(body)
        pos = end
    return out, pos
