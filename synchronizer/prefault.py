"""Touch, at start, the buffers a fragment's first merges and uploads will take.

A synchronizer starts with empty pools (buffers.py, served_buffers.py), so its first round of uploads and
merges allocates every buffer it uses, and each fresh page faults on first touch, all at once: every
learner posts when it starts, every fragment's first round closes together, and 16 upload threads
fault their 32 MB bodies while four merges fault their 64 MB tensors. On a loaded machine the first
merge of each fragment was the slowest of a run by far, most of it the outer step's page faults
(bench/RESULTS.md, "Figures behind the code"). So when the layout is adopted (init, before its
answer; a restart, before the port opens: learners waiting to re-send come all at once then too) the
synchronizer makes, per owned fragment, what its merges take (the round's sum, the new momentum and
Theta: `PER_MERGE` float32 tensors per tensor; `Served.KEEP` payload buffers), buffers for
`BODIES_PER_FRAGMENT` uploads in each accepted encoding, and its merge journal's file, within each
pool's limit (2 GB and 1 GB idle: a few seconds at most), and moves its Theta and momentum into the
pool's tensors (`adopt`). Loaded from a file or an init body they were tensors the pool did not
make, so the first merge's install dropped them and each fragment's second merge faulted two fresh
float32 tensors per tensor (bench/RESULTS.md, "Figures behind the code"); adopted, they come back to
the pool when superseded, as a merged state's do. Not in a background thread: under the first
uploads it finished after the first merges it was meant for. `TuningSettings.prime_buffers` turns it
off.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Final

import torch

from ddiloco.synchronizer.buffers import BODIES, POOL
from ddiloco.synchronizer.served_buffers import Served
from ddiloco.synchronizer.storage.journal import MergeJournal
from ddiloco.synchronizer.storage.state import FragmentState
from ddiloco.wire.quant import DEFAULT_BLOCK

log = logging.getLogger(__name__)

PER_MERGE: Final = 3
"""Float32 tensors a merge takes per tensor of its fragment: the round's direction, b', Theta'."""
BODIES_PER_FRAGMENT: Final = 2
BODY_SLACK: Final = 1024
"""Bytes of header assumed beside an update's data (a learner's is under 1 KiB)."""
FLOAT_BYTES: Final = {"bfloat16": 2, "float32": 4}


def body_size(numels: Iterable[int], encoding: str) -> int:
    """About the size of an update of tensors of `numels` values in `encoding` (a quantized
    one at the learner's default block): what the upload port's buffer for it holds. A
    quantized update's body is held until its merge too (its codes are read there)."""
    if encoding in FLOAT_BYTES:
        return sum(numels) * FLOAT_BYTES[encoding] + BODY_SLACK
    per_code = {"int8": 1.0, "int4": 0.5}[encoding]
    blocks = [-(-n // DEFAULT_BLOCK) for n in numels]
    return sum(int(b * DEFAULT_BLOCK * per_code) + 4 * b for b in blocks) + BODY_SLACK


def prime(
    fragments: Sequence[FragmentState],
    owned: Iterable[int],
    payloads: Served,
    journals: Sequence[MergeJournal],
    encodings: Iterable[str],
) -> dict[str, int]:
    """Make the buffers (module docstring); returns how many of each it made."""
    t0 = time.monotonic()
    made = {"adopted": 0, "pool": 0, "served": 0, "bodies": 0}
    encodings = sorted(set(encodings))
    shapes: Counter[tuple[int, ...]] = Counter()  # the pools keep buffers by shape, by size
    bodies: Counter[int] = Counter()  # by capacity, of a size that takes it
    size_of: dict[int, int] = {}
    for p in owned:
        fs = fragments[p]
        journals[p].create()
        made["adopted"] += adopt(fs.params) + adopt(fs.momentum)
        for t in fs.params.values():
            shapes[tuple(t.shape)] += PER_MERGE
        numels = [t.numel() for t in fs.params.values()]
        for encoding in encodings:
            size = body_size(numels, encoding)
            size_of.setdefault(BODIES.capacity(size), size)
            bodies[BODIES.capacity(size)] += BODIES_PER_FRAGMENT
    for shape, count in shapes.items():
        made["pool"] += POOL.prime(shape, count)
    for p in owned:
        made["served"] += payloads.prime(p, fragments[p].params)
    for capacity, count in bodies.items():
        made["bodies"] += BODIES.prime(size_of[capacity], count)
    log.info("Primed buffers in %.2f s: %s", time.monotonic() - t0, made)
    return made


def adopt(tensors: dict[str, torch.Tensor]) -> int:
    """Move each float32 tensor of a loaded state into one of `POOL`'s (the same values,
    every page written), so that when a merge supersedes the state its tensors go back to
    the pool for the next merge; returns how many it moved. Others are read once (their
    pages mapped)."""
    moved = 0
    for name, t in tensors.items():
        if not t.numel():
            continue
        if t.dtype != torch.float32:  # not the pool's kind: its pages mapped, no copy
            torch.aminmax(t.reshape(-1))
            continue
        tensors[name] = POOL.take(t.shape).copy_(t)
        moved += 1
    return moved
