"""Whole files written with `O_DIRECT` through a page-aligned staging buffer.

    if not write_direct(tmp, parts):      # state.py: a fragment file's header and tensors
        ...                               # the file system refused O_DIRECT: page cache

The pending log's records need no staging (their bodies sit in aligned buffers already,
pending.py `PendingLog.write`); a fragment file's parts are the tensors' own memory, which is
not, so they are copied through `STAGE` bytes at a time.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from pathlib import Path

import torch

from ddiloco.synchronizer.buffers import aligned

__all__ = ["STAGE", "write_direct"]

STAGE = 32 << 20
"""The direct-I/O staging buffer of a file write (`write_direct`). Each `os.write` of it is
one request in the disk's queue beside the pending log's 32 MB records, and the queue
serves them by bytes in flight: with smaller requests the background writer fell
`snapshot_lag` behind under a saturated ingest and merges wrote their own files
(bench/RESULTS.md, "Figures behind the code")."""
_stages: list[mmap.mmap] = []
_stages_lock = threading.Lock()


def _copy(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src, with the GIL released for large copies (torch's copy)."""
    if len(src) < 1 << 20 or src.readonly:
        dst[:] = src
        return
    out = torch.frombuffer(dst, dtype=torch.uint8)
    out.copy_(torch.frombuffer(src, dtype=torch.uint8))


def write_direct(path: Path, parts: list[memoryview | bytes]) -> bool:
    """Write `parts` into a new file with `O_DIRECT` through a page-aligned staging buffer (not yet
    fsynced): one memory copy instead of the page cache's allocation, copy and writeback
    (bench/RESULTS.md, "Figures behind the code"). False, with nothing written, where the file
    system refuses `O_DIRECT` (the caller writes through the page cache)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except (OSError, AttributeError):
        return False
    with _stages_lock:
        stage = _stages.pop() if _stages else mmap.mmap(-1, STAGE)
    try:
        _stream(fd, memoryview(stage), parts)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        os.close(fd)  # opened, but the I/O refused: the page cache it is
        fd = -1
        path.unlink(missing_ok=True)
        return False
    finally:
        if fd >= 0:
            os.close(fd)
        with _stages_lock:
            if len(_stages) < 2:
                _stages.append(stage)
    return True


def _stream(fd: int, buf: memoryview, parts: list[memoryview | bytes]) -> None:
    """`parts` into `fd` (opened `O_DIRECT`) through `buf`, in whole blocks; the file is
    then cut to the parts' length."""

    def flush(n: int) -> None:
        view = buf[:n]
        while view:
            view = view[os.write(fd, view) :]

    fill = total = 0
    for part in parts:
        src = memoryview(part).cast("B")
        while src:
            take = min(len(src), len(buf) - fill)
            _copy(buf[fill : fill + take], src[:take])
            fill, total, src = fill + take, total + take, src[take:]
            if fill == len(buf):
                flush(fill)
                fill = 0
    if fill:
        end = aligned(fill)
        buf[fill:end] = bytes(end - fill)
        flush(end)
    os.ftruncate(fd, total)  # the last block's padding goes
