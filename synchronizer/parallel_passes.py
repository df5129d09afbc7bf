"""A merge's passes over a large tensor, split between its own thread and helpers.

    parts = split.run(n, lambda s: pass_over(s), ways=2)   # [0, h) here, [h, n) in a helper
    split.scale_(t, 0.5, ways=2)                           # t *= 0.5, in pieces

The merge's elementwise passes (the rule's final scaling, the outer step's three adds, the
finiteness check, the served copy's conversion) are one torch call per tensor on one thread
(`torch_threads`: threads inside one call waited on each other). On a machine whose cores are shared
with uploads and clients, that thread got one share of them: the slowest merges spent most of their
compute runnable and waiting for a core (`ran` / `queued` in the merge's log line; bench/RESULTS.md,
"Figures behind the code"). In `ways` pieces, each a runnable thread of its own, a merge gets that
many shares under load and that many cores when they are free.

The pieces start at multiples of `STRIDE` values, so each piece's vector loop has the
same alignment and its scalar tail falls where the whole tensor's does: the same bits as
one call (tested). A piece not yet started by a helper when the merge's thread finishes
its own is taken back and done here, so a merge never waits for a helper busy with
another merge's piece.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TypeVar

import torch

__all__ = ["MIN_PIECE", "STRIDE", "bounds", "copy_", "run", "scale_", "stats"]

T = TypeVar("T")

MIN_PIECE: Final = 1 << 20
"""The fewest values worth a piece of their own (4 MiB of float32): below that, handing a
piece over costs about what it saves."""
STRIDE: Final = 1 << 16
"""Pieces start at multiples of this many values (every vector width divides it)."""

HELPERS = ThreadPoolExecutor(16, thread_name_prefix="ddiloco-split")
"""Threads for the pieces a merge hands over, made as pieces overlap."""

stats = {"pieces": 0, "helped": 0}
"""Pieces handed over, and of those the ones a helper did (tests, and what a profile reads)."""
_stats_lock = threading.Lock()


def bounds(n: int, ways: int) -> list[tuple[int, int]]:
    """[start, end) of each piece of `n` values in at most `ways` pieces."""
    k = max(1, min(ways, n // MIN_PIECE))
    if k == 1:
        return [(0, n)]
    step = -(-n // k // STRIDE) * STRIDE  # ceil(n / k), rounded up to a stride
    cuts = [min(n, i * step) for i in range(k)] + [n]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def run(n: int, fn: Callable[[slice], T], ways: int = 1) -> list[T]:
    """`fn` over each piece of range(n) (as a slice), the first on this thread, the others
    in helpers; their results in order."""
    pieces = [slice(a, b) for a, b in bounds(n, ways)]
    if len(pieces) == 1:
        return [fn(pieces[0])]
    handed = [HELPERS.submit(fn, s) for s in pieces[1:]]
    out, helped = [fn(pieces[0])], 0
    for fut, s in zip(handed, pieces[1:], strict=True):
        if fut.cancel():  # not started: a helper is busy elsewhere
            out.append(fn(s))
        else:
            out.append(fut.result())
            helped += 1
    with _stats_lock:
        stats["pieces"] += len(handed)
        stats["helped"] += helped
    return out


def scale_(t: torch.Tensor, factor: float, ways: int = 1) -> torch.Tensor:
    """t *= factor (contiguous `t`), in pieces; returns `t`."""
    flat = t.view(-1)
    run(flat.numel(), lambda s: flat[s].mul_(factor), ways)
    return t


def copy_(dst: torch.Tensor, src: torch.Tensor, ways: int = 1) -> None:
    """dst[:] = src, flat (any dtypes: a conversion), in pieces."""
    d, s_ = dst.reshape(-1), src.detach().reshape(-1)
    run(d.numel(), lambda s: d[s].copy_(s_[s]), ways)
