"""Reusable float32 buffers for the update path: no page faults per update.

A fresh 64 MB tensor costs more than the work done in it: glibc maps every allocation that
large with mmap and unmaps it on free, so each update's float32 copy, each merge's new
parameters and momentum, first touch every page again (bench/RESULTS.md, issue 15: 36 ms to
allocate and fill 16M floats, 7 ms to fill them in a buffer already touched). `POOL` keeps
the buffers the update path gives back and hands them out again, by shape.

    t = POOL.take((4096, 4096))        # float32, contents undefined (the caller overwrites)
    ...
    POOL.give(t)                       # only a tensor POOL made, and nobody still holds it

Giving back is explicit and optional: a tensor never given back is freed as any other.
`give` ignores tensors the pool did not make (a test's, an init upload's), so a caller may
hand it whatever it is done with. The pool keeps at most `max_bytes` idle.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

__all__ = ["POOL", "Float32Pool"]


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
"""The process's pool (the synchronizer's update path: codec.decode_float32, merge.py)."""
