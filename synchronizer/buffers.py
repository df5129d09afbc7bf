"""Reusable buffers for the update path: no page faults per update.

A fresh 64 MB tensor costs more than the work done in it: glibc maps every allocation that large
with mmap and unmaps it on free, so each update's float32 copy, each merge's new parameters and
momentum, first touch every page again: allocating and filling a fresh one costs several times
filling one already touched (bench/RESULTS.md, "Figures behind the code"). `POOL` keeps the buffers
the update path gives back and hands them out again, by shape.

    t = POOL.take((4096, 4096))        # float32, contents undefined (the caller overwrites)
    ...
    POOL.give(t)                       # only a tensor POOL made, and nobody still holds it

Giving back is explicit and optional: a tensor never given back is freed as any other.
`give` ignores tensors the pool did not make (a test's, an init upload's), so a caller may
hand it whatever it is done with. The pool keeps at most `max_bytes` idle.

`BODIES` does the same for the upload port's request bodies (synchronizer/upload_port.py): a fresh
`bytearray(32 MB)` is zero-filled under the GIL, page by page, before `recv_into` writes it again (a
tenth of the synchronizer's CPU at saturation, bench/RESULTS.md, "Figures behind the code"); a body
of a size seen before lands in a buffer already touched. Capacities are whole MiB, so bodies whose
headers differ by a few bytes share them. The buffers are page-aligned, with room for the pending
log's record header in front of the body: the log writes it to the disk from there (`frame`,
`O_DIRECT`), with no copy into the page cache.

    body = BODIES.take(size)           # a memoryview of exactly `size` bytes
    ...                                # read into it, submit it (nothing may keep it)
    BODIES.give(body)
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterable

import torch

__all__ = ["ALIGN", "BODIES", "POOL", "BytePool", "Float32Pool", "aligned"]


class Float32Pool:
    """Idle float32 tensors by shape; thread-safe."""

    def __init__(self, max_bytes: int = 2 << 30) -> None:
        self.max_bytes = max_bytes
        self.idle: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self.idle_bytes = 0
        self.ours: set[int] = set()
        """data_ptr of every tensor handed out and not yet given back."""
        self.lock = threading.Lock()

    def take(self, shape: Iterable[int]) -> torch.Tensor:
        key = tuple(shape)
        with self.lock:
            free = self.idle.get(key)
            if free:
                t = free.pop()
                self.idle_bytes -= t.numel() * 4
            else:
                t = None
        if t is None:
            t = torch.empty(key, dtype=torch.float32)
        if t.numel():
            with self.lock:
                self.ours.add(t.data_ptr())
        return t

    def prime(self, shape: Iterable[int], count: int) -> int:
        """Add idle tensors of `shape`, their pages touched, until `count` are idle (as far
        as the pool has room); returns how many it made. Counted once: tensors taken
        meanwhile are not replaced. `Synchronizer` primes what a fragment's first merges
        take, before its first round closes (prefault.py)."""
        key = tuple(shape)
        size = 4
        for d in key:
            size *= d
        with self.lock:
            want = count - len(self.idle.get(key, ()))
        made = 0
        while made < want and size:
            with self.lock:
                if self.idle_bytes + size > self.max_bytes:
                    break
                self.idle_bytes += size  # reserved: two primers never overshoot
            t = torch.empty(key, dtype=torch.float32)
            t.fill_(0.0)  # every page
            with self.lock:
                self.idle.setdefault(key, []).append(t)
            made += 1
        return made

    def give(self, tensors: Iterable[torch.Tensor]) -> None:
        """Take back tensors the caller no longer uses (others are left alone)."""
        for t in tensors:
            if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() == 0:
                continue
            with self.lock:
                if t.data_ptr() not in self.ours:
                    continue
                self.ours.discard(t.data_ptr())
                size = t.numel() * 4
                if self.idle_bytes + size > self.max_bytes:
                    continue
                self.idle.setdefault(tuple(t.shape), []).append(t)
                self.idle_bytes += size


POOL = Float32Pool()
"""The process's pool (the synchronizer's update path: quantized decodes, merge.py)."""


ALIGN = 4096
"""The unit of direct I/O (`O_DIRECT`): buffer addresses, file offsets and lengths are
multiples of it (a 4 KiB-sector disk's; 512-byte ones accept it too)."""


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of `ALIGN`."""
    return -(-n // ALIGN) * ALIGN


class BytePool:
    """Idle page-aligned buffers (anonymous `mmap`s) by capacity (a whole number of
    `grain`s); thread-safe. A body sits `ALIGN` bytes into its buffer, so the pending log
    can write the record header in front of it and the body, padded, straight to the disk
    (`frame`, pending.py: `O_DIRECT`, no copy into the page cache). Bodies under one grain are
    not pooled (a fresh small buffer costs little)."""

    def __init__(self, max_bytes: int = 1 << 30, grain: int = 1 << 20) -> None:
        self.max_bytes, self.grain = max_bytes, grain
        self.idle: dict[int, list[mmap.mmap]] = {}
        self.idle_bytes = 0
        self.since: dict[int, mmap.mmap] = {}
        """id() -> every idle buffer, the longest idle first: the first to go when a buffer
        given back does not fit (a primed one of a size nobody sends, say)."""
        self.ours: dict[int, mmap.mmap] = {}
        """id() of every buffer handed out and not yet given back."""
        self.pins: dict[int, int] = {}
        """id() of a buffer whose body a round still reads -> how many hold it (`pin`)."""
        self.given: set[int] = set()
        """Pinned buffers already given back: idle once the last pin goes."""
        self.lock = threading.Lock()

    def capacity(self, size: int) -> int:
        """The capacity of the buffer a body of `size` bytes takes."""
        return -(-(ALIGN + aligned(size)) // self.grain) * self.grain

    def take(self, size: int) -> memoryview:
        """A writable view of `size` bytes, contents undefined (the caller fills them all)."""
        need = ALIGN + aligned(size)
        capacity = self.capacity(size)
        buf = None
        if size >= self.grain:
            with self.lock:
                free = self.idle.get(capacity)
                buf = free.pop() if free else None
                if buf is not None:
                    self.idle_bytes -= capacity
                    del self.since[id(buf)]
        if buf is None:
            buf = mmap.mmap(-1, capacity if size >= self.grain else need)
        with self.lock:
            self.ours[id(buf)] = buf
        return memoryview(buf)[ALIGN : ALIGN + size]

    def frame(self, view: memoryview | bytes | bytearray) -> memoryview | None:
        """For a view `take` gave and not yet taken back: its buffer from offset 0 to the
        body's end rounded up to `ALIGN` (`ALIGN` bytes of room in front, the body, then
        slack); None for anything else."""
        if not isinstance(view, memoryview):
            return None
        with self.lock:
            buf = self.ours.get(id(view.obj))
        if buf is None or view.obj is not buf or len(buf) < ALIGN + aligned(len(view)):
            return None
        return memoryview(buf)[: ALIGN + aligned(len(view))]

    def give(self, view: memoryview) -> None:
        """Take back a view `take` gave (anything else is left alone); the caller and every
        view or tensor over it are done with it, unless it is pinned: then it waits for the
        last `unpin`."""
        buf = view.obj
        if not isinstance(buf, mmap.mmap):
            return
        with self.lock:
            if self.ours.get(id(buf)) is not buf or id(buf) in self.given:
                return
            if self.pins.get(id(buf)):
                self.given.add(id(buf))
                return
            evicted = self._idle(buf)
        del evicted  # unmapped here, not under the lock

    def pin(self, view: memoryview | bytes | bytearray) -> None:
        """Keep the buffer of `view` (a body `take` gave) out of the pool until `unpin`,
        whenever it is given back: a round holds tensors that read it (merge.py)."""
        buf = view.obj if isinstance(view, memoryview) else None
        with self.lock:
            if buf is not None and self.ours.get(id(buf)) is buf:
                self.pins[id(buf)] = self.pins.get(id(buf), 0) + 1

    def unpin(self, view: memoryview | bytes | bytearray) -> None:
        buf = view.obj if isinstance(view, memoryview) else None
        with self.lock:
            if buf is None or self.ours.get(id(buf)) is not buf or not self.pins.get(id(buf)):
                return
            self.pins[id(buf)] -= 1
            if self.pins[id(buf)]:
                return
            del self.pins[id(buf)]
            if id(buf) not in self.given:
                return
            self.given.discard(id(buf))
            evicted = self._idle(buf)
        del evicted  # unmapped here, not under the lock

    def prime(self, size: int, count: int) -> int:
        """Add idle buffers of the capacity a body of `size` bytes takes, their pages
        touched, until `count` are idle (as far as the pool has room; counted once);
        returns how many it made. Bodies under a grain are not pooled: none."""
        if size < self.grain:
            return 0
        capacity = self.capacity(size)
        with self.lock:
            want = count - len(self.idle.get(capacity, ()))
        made = 0
        while made < want:
            with self.lock:
                if self.idle_bytes + capacity > self.max_bytes:
                    break
                self.idle_bytes += capacity
            buf = mmap.mmap(-1, capacity)
            torch.frombuffer(buf, dtype=torch.uint8).fill_(0)  # every page, GIL released
            with self.lock:
                self.idle.setdefault(capacity, []).append(buf)
                self.since[id(buf)] = buf
            made += 1
        return made

    def _idle(self, buf: mmap.mmap) -> list[mmap.mmap]:
        """`buf` is nobody's now (the caller holds the lock): idle, in place of the buffers
        idle longest if the pool would hold more than `max_bytes` (returned, for the caller
        to drop outside the lock). A buffer given back is about to be wanted again; one
        idle since priming may never be (bodies of every accepted encoding are primed, and
        a job sends one): dropping the newest instead unmapped every int4 body as its merge
        let go of it (most of a merge's finish) and mapped a fresh one for the next
        upload (bench/RESULTS.md, "Figures behind the code")."""
        del self.ours[id(buf)]
        if len(buf) < self.grain or len(buf) > self.max_bytes:
            return [buf]
        evicted = []
        while self.idle_bytes + len(buf) > self.max_bytes:
            old = self.since.pop(next(iter(self.since)))
            self.idle[len(old)].remove(old)
            self.idle_bytes -= len(old)
            evicted.append(old)
        self.idle.setdefault(len(buf), []).append(buf)
        self.since[id(buf)] = buf
        self.idle_bytes += len(buf)
        return evicted


BODIES = BytePool()
"""The upload port's request bodies (synchronizer/upload_port.py)."""
