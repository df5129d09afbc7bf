"""Passes over an update in its own encoding: a bf16 update is never copied whole into
float32, a quantized one once, at admission, and not kept.

    n = norm(delta_bf16)                     # fp32-accumulated dots of blocks, summed in fp64
    axpy(direction, delta_bf16, w / n)       # direction += w / n * delta, in L2-sized chunks
    scale_into(out, delta_bf16, w)           # out = w * delta (a merge's first term)
    d = dense(q, pause)                      # q: quant.Quantized (views of an int8/int4
    axpy(direction, q, w / n)                # body): float32 of POOL; or read in chunks

A quantized update (`quant.Quantized`) stays codes while it waits for its merge: 1/8 of its float32
for int4. Admission dequantizes it once (`dense`, in place, a chunk at a time), measures its norm
and queues its round-sum term from that float32, which then goes back to the pool (stream.py);
dequantizing into the cache for the norm and again for the term cost more than writing and reading
the float32 once (bench/RESULTS.md, "Figures behind the code"). A merge or a replay that reads its
codes again dequantizes them into the thread's `CHUNK`-value scratch, whole blocks at a time: the
same float32 values as `quant.dequantize`, so the same bits as the float32 admission read.

Converting an accepted bf16 update at admission into a float32 buffer, reading that again
for its norm and again in the merge would be four full-size passes, two of them over twice
the update's bytes, on a machine whose memory bandwidth is the synchronizer's bound
(bench/RESULTS.md, "Figures behind the code"). So the update stays where the upload port read it
(buffers.BODIES, pinned until its merge), its norm reads it once, and the merge reads it
once more, converting `CHUNK` values at a time into a float32 scratch buffer that stays in
cache.

The norm of a large bf16 tensor: torch's `bmm` over blocks of `BLOCK` values accumulates each
block's sum of squares in float32 (oneDNN's bf16 dot product) and rounds it to bf16; the blocks are
summed in float64 (`BMM_MIN` says how exact): several times faster than `vector_norm(bf16,
dtype=float32)` or a float32 copy and its norm (bench/RESULTS.md, "Figures behind the code"). NaN
and Inf reach the result (the guard refuses them, admission.py). A float32 tensor's norm is one
`torch.linalg.vector_norm` call.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Final

import torch

from ddiloco.synchronizer.buffers import POOL
from ddiloco.wire.quant import Quantized, Term, dequantize_blocks

__all__ = ["BLOCK", "CHUNK", "Term", "axpy", "dense", "norm", "scale_into"]

CHUNK: Final = 1 << 20
"""Values converted at a time: 4 MiB of float32, in the L3 cache (32 MiB here). An axpy of
16M bf16 values: 5.1 ms, 5.5 at 256 Ki (L2-sized), 12.9 at 128 Ki, 15.4 at 64 Ki, and 14.8
for the float32 copy and add it replaces. Few chunks matter under load: each torch call
gives up the GIL and waits to take it back behind the upload threads, and a merge of ten
bf16 contributions in chunks of 256 Ki made 1,280 such round trips (its p90 fell from 1.08
to 0.68 s with chunks of 1 Mi and the shorter switch interval, server.py)."""
BLOCK: Final = 4096
"""Values per float32-accumulated dot in a bf16 norm."""
BMM_MIN: Final = 1 << 22
"""The smallest bf16 tensor normed by blocks (1024 of them and more): measured on random
values, its relative error is 6e-5 at 4M values and 2e-5 at 16M, where the float32
reduction over a float32 copy it replaces gave 6e-5 and 4e-4. A smaller one (a few blocks
would keep more of bf16's 2^-9 rounding) is converted a chunk at a time (~1e-7)."""

_local = threading.local()


def _scratch() -> torch.Tensor:
    buf = getattr(_local, "scratch", None)
    if buf is None:
        buf = _local.scratch = torch.empty(CHUNK, dtype=torch.float32)
    return buf


def _spans(
    q: Quantized,
    pause: Callable[[], None] | None = None,
    into: torch.Tensor | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """(offset, float32 values) of `q`, flat, a chunk of whole blocks at a time, each in this
    thread's scratch (valid until the next) or, given `into` (flat float32 of q's numel),
    written in place there (a last, partial block through the scratch); `pause()` between
    chunks."""
    per = max(1, CHUNK // q.block)  # blocks per chunk (MAX_BLOCK <= CHUNK)
    n, nb = q.numel, q.scales.numel()
    scratch = _scratch()
    for b0 in range(0, nb, per):
        if b0 and pause is not None:
            pause()
        b1 = min(nb, b0 + per)
        start, end = b0 * q.block, b1 * q.block
        if into is not None and end <= n:
            yield start, dequantize_blocks(q, b0, b1, into[start:end])
            continue
        values = dequantize_blocks(q, b0, b1, scratch)[: min(n, end) - start]
        if into is not None:
            values = into[start : start + values.numel()].copy_(values)
        yield start, values


def norm(t: Term, pause: Callable[[], None] | None = None) -> float:
    """The L2 norm of `t` (any float dtype, or quantized: that of its float32 values, the
    same bits as admission's); NaN or Inf if it holds one or overflows. `pause`: called
    between a quantized tensor's chunks as they are dequantized."""
    if isinstance(t, Quantized):  # the norm of its float32, as admission measures it
        values = dense(t, pause)
        try:
            return norm(values)
        finally:
            POOL.give([values])
    if t.dtype == torch.float32:
        return float(torch.linalg.vector_norm(t))
    flat = t.reshape(-1)
    if t.dtype == torch.bfloat16 and flat.numel() >= BMM_MIN:
        k = flat.numel() // BLOCK
        head, rest = flat[: k * BLOCK], flat[k * BLOCK :]
        total = 0.0
        if k:
            dots = torch.bmm(head.view(k, 1, BLOCK), head.view(k, BLOCK, 1))
            total += float(dots.to(torch.float64).sum())
        if rest.numel():
            total += float(torch.dot(rest, rest).to(torch.float64))
        return math.sqrt(total) if total >= 0 else math.nan
    sq = 0.0  # chunks converted, float32 norms, float64 across them
    scratch = _scratch()
    for i in range(0, flat.numel(), CHUNK):
        part = flat[i : i + CHUNK]
        tmp = scratch[: part.numel()]
        tmp.copy_(part)
        sq += float(torch.linalg.vector_norm(tmp)) ** 2
    return math.sqrt(sq)


def axpy(dst: torch.Tensor, src: Term, alpha: float) -> None:
    """dst += alpha * src, `dst` contiguous float32, `src` any float dtype of its shape (or
    quantized, of its shape)."""
    if isinstance(src, Quantized):
        d = dst.view(-1)
        for start, values in _spans(src):
            d[start : start + values.numel()].add_(values, alpha=alpha)
        return
    if src.dtype == torch.float32:
        dst.add_(src, alpha=alpha)
        return
    d, s = dst.view(-1), src.reshape(-1)
    scratch = _scratch()
    for i in range(0, d.numel(), CHUNK):
        part = s[i : i + CHUNK]
        tmp = scratch[: part.numel()]
        tmp.copy_(part)
        d[i : i + CHUNK].add_(tmp, alpha=alpha)


def scale_into(dst: torch.Tensor, src: Term, alpha: float) -> None:
    """dst = alpha * src (`dst` contiguous float32): a sum's first term, with no zero-filled
    pass before it."""
    if isinstance(src, Quantized):
        d = dst.view(-1)
        for start, values in _spans(src):
            torch.mul(values, alpha, out=d[start : start + values.numel()])
        return
    if src.dtype == torch.float32:
        torch.mul(src, alpha, out=dst)
        return
    d, s = dst.view(-1), src.reshape(-1)
    for i in range(0, d.numel(), CHUNK):
        out = d[i : i + CHUNK]
        out.copy_(s[i : i + CHUNK])
        if alpha != 1.0:
            out.mul_(alpha)


def dense(t: Term, pause: Callable[[], None] | None = None) -> torch.Tensor:
    """`t` as a float32 tensor of its shape (`t` itself if it is one); a quantized one's in a
    buffer of `POOL`, dequantized in place a chunk at a time, `pause()` between chunks."""
    if isinstance(t, Quantized):
        out = POOL.take(t.shape)
        for _ in _spans(t, pause, into=out.view(-1)):
            pass
        return out
    return t.float()
