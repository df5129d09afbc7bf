"""Each fragment's served version: encoded once per merge in the synchronizer's
`broadcast_encoding` (config.py), in the download format of wire/broadcast.py.

    b = encode(payloads, "int8-delta", p, version, theta)          # a reset: S_v = Theta_v
    b = encode(payloads, "int8-delta", p, version, theta, prev=b)  # after a merge
    body, label = b.body(held="3f9a.41")        # the delta if the learner holds S_{v-1}

For a delta encoding the synchronizer keeps S_v, the reconstruction every learner holds
(wire/broadcast.py). Each delta carries the last one's quantization error along, so the error
never accumulates: S_v is within half a quantization step of Theta_v however many versions
went by. What merges and the outer optimizer read stays Theta (exact, float32).

A lineage starts whenever S is set to Theta (the layout adopted, a restart, a replay of
journaled merges): S is not persisted, so a restart serves whole fragments to every learner
once, and the new lineage (random) keeps a learner's S of before it from being taken for the
new one's. A lineage that starts at version 0 is named by S_0's content
(`broadcast.initial_token`). A delta whose S would not be finite (an overflow) is not
published: S restarts from Theta (a new lineage, whole fragments).

A delta is encoded in one sweep per tensor, a cache-sized chunk at a time and split between
threads (`_delta`): the difference, its codes and scales (written into the delta payload),
and S_v (written into the whole payload, which is S_v's only copy), with no full-size
temporary; the same bytes as quantizing the whole difference and applying it
(tests/unit/test_delta_encode.py).
"""

from __future__ import annotations

import functools
import secrets
import threading
from typing import Final, NamedTuple

import torch

from ddiloco.synchronizer import parallel_passes
from ddiloco.synchronizer.served_buffers import Served
from ddiloco.wire import broadcast, encodings, quant
from ddiloco.wire.broadcast import BASE_KEY, DELTAS, MAX_TOKEN, TOKEN_KEY, UNCHANGED

__all__ = ["LABELS", "Broadcast", "encode"]


class Broadcast(NamedTuple):
    """One fragment's served version: its payloads (buffers of `Served`) and, for a delta
    encoding, the S it stands for."""

    version: int
    whole: memoryview
    """Theta_v (float32, bfloat16 or int8 codes), or, for a delta encoding, S_v in float32."""
    label: str
    """`whole`'s encoding, for the bytes-served metric."""
    delta: memoryview | None = None
    """Q(Theta_v - S_{v-1}): for a learner holding `base`."""
    delta_label: str = ""
    """`delta`'s encoding (int8-delta, int4-delta)."""
    token: str | None = None
    """Names S_v (delta encodings)."""
    base: str | None = None
    """Names S_{v-1}, what `delta` applies to."""
    held: dict[str, torch.Tensor] | None = None
    """S_v itself, float32 (delta encodings): views of `whole`'s tensors (which keep its
    buffer from reuse while they live), the next delta's base."""
    same: memoryview | None = None
    """For a learner that holds S_v already (`token`): a payload of no tensors saying so."""

    def views(self) -> list[memoryview]:
        """Every payload buffer (to retire once superseded)."""
        return [self.whole] if self.delta is None else [self.whole, self.delta]

    def body(self, held: str | None) -> tuple[memoryview, str]:
        """What a learner holding `held` (a token, or None) gets, and its label: no tensors
        when it holds S_v, the delta when it holds S_{v-1}, else the whole."""
        if held is None or len(held) > MAX_TOKEN:
            return self.whole, self.label
        if self.same is not None and held == self.token:
            return self.same, UNCHANGED
        if self.delta is not None and held == self.base:
            return self.delta, self.delta_label
        return self.whole, self.label


LABELS: Final = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}
"""Each whole payload's label in the bytes-served metric (a delta's is its encoding, an
answer of no tensors `broadcast.UNCHANGED`)."""


def _lineage() -> str:
    return secrets.token_hex(8)


def encode(
    payloads: Served,
    encoding: str,
    p: int,
    version: int,
    theta: dict[str, torch.Tensor],
    prev: Broadcast | None = None,
    block: int = quant.DEFAULT_BLOCK,
) -> Broadcast:
    """Fragment p's served version `version` (Theta: `theta`, float32, only read). A delta
    encoding with `prev` (the version served before, S_{v-1}) serves the delta from it and
    its S_v; without (`prev` None, or from another encoding) S restarts from Theta. ValueError
    on a non-finite Theta (a merge refuses one before it gets here)."""
    if encoding in ("float32", "bfloat16"):
        return Broadcast(version, payloads.encode(p, theta), LABELS[encoding])
    if encoding == "int8":
        codes = {k: quant.quantize(v, "int8", block) for k, v in theta.items()}
        meta = broadcast.quantized_meta("int8", "int8", block, theta)
        return Broadcast(version, payloads.encode_codes(p, codes, meta), LABELS["int8"])
    q_encoding = DELTAS[encoding]
    if prev is not None and prev.held is not None and prev.version == version:
        # a merge that merged nothing: the same S, served again whole (new buffers: the
        # caller retires the old ones)
        whole, held = _whole(payloads, p, prev.held, str(prev.token))
        return prev._replace(whole=whole, delta=None, base=None, held=held)
    if prev is not None and prev.held is not None and prev.token is not None:
        token = broadcast.token(prev.token.rsplit(".", 1)[0], version)
        meta = broadcast.quantized_meta(q_encoding, encoding, block, theta)
        meta |= {TOKEN_KEY: token, BASE_KEY: prev.token}
        got = _delta(payloads, p, q_encoding, block, theta, prev.held, meta, token)
        if got is not None:  # else a difference or S_v overflowed: S restarts from Theta
            delta, whole, held = got
            return Broadcast(
                version, whole, "fp32", delta, encoding, token, prev.token, held, _same(token)
            )
    if not all(bool(torch.isfinite(v).all()) for v in theta.values()):
        raise ValueError(f"fragment {p} version {version} is not finite: it is never served")
    token = broadcast.initial_token(theta) if version == 0 else broadcast.token(_lineage(), version)
    whole, held = _whole(payloads, p, theta, token)
    return Broadcast(version, whole, "fp32", None, "", token, None, held, _same(token))


CHUNK: Final = 1 << 17
"""Values of a tensor a delta is encoded at a time (`_delta`): 512 KiB of float32, so that a
chunk's passes (difference, quantization, S_v, its check) run in a core's cache, and few
enough chunks that the Python between the passes costs little."""

_local = threading.local()


def _scratch(n: int) -> torch.Tensor:
    """This thread's float32 scratch of at least `n` values."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < n:
        buf = _local.scratch = torch.empty(n, dtype=torch.float32)
    return buf


def _whole(
    payloads: Served, p: int, tensors: dict[str, torch.Tensor], token: str
) -> tuple[memoryview, dict[str, torch.Tensor]]:
    """S (`tensors`, copied as float32) as a delta encoding's whole payload named `token`,
    and S as views of it: the next delta's base is the payload, not a copy beside it."""
    names = sorted(tensors)
    entries = [(k, torch.float32, tuple(tensors[k].shape)) for k in names]
    whole, outs = payloads.allot(p, entries, broadcast.whole_meta(token))
    for k in names:
        if outs[k].numel():
            parallel_passes.copy_(outs[k], tensors[k], payloads.ways)
    return whole, {k: outs[k].view(tensors[k].shape) for k in names}


def _delta(
    payloads: Served,
    p: int,
    q_encoding: quant.Encoding,
    block: int,
    theta: dict[str, torch.Tensor],
    base: dict[str, torch.Tensor],
    meta: dict[str, str],
    token: str,
) -> tuple[memoryview, memoryview, dict[str, torch.Tensor]] | None:
    """The delta payload Q(Theta - S_{v-1}) (`base`: S_{v-1}) and the whole payload S_v
    named `token`, with S_v as views of it; None when a difference or S_v is not finite
    (both payloads given back). The same bytes as quantizing each difference
    (`quant.quantize`), applying it (`broadcast.apply_delta`) and encoding both: the codes,
    scales and S_v are written into their payloads a chunk at a time (`CHUNK`), each tensor
    split between threads (parallel_passes.py), with no full-size temporary."""
    names = sorted(theta)
    if sorted(base) != names or any(base[k].numel() != theta[k].numel() for k in names):
        return None
    if block < 2 or block % 2:  # a block `quant.quantize` refuses
        return None
    code_dtype = torch.uint8 if q_encoding == "int4" else torch.int8
    per = block // 2 if q_encoding == "int4" else block
    parts: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for k in names:
        nb = -(-theta[k].numel() // block)
        parts[k] = (code_dtype, (nb * per,))
        parts[k + encodings.SCALES_SUFFIX] = (torch.float32, (nb,))
    delta_entries = [(k, *parts[k]) for k in sorted(parts)]
    whole_entries = [(k, torch.float32, tuple(theta[k].shape)) for k in names]
    delta, douts = payloads.allot(p, delta_entries, meta)
    whole, wouts = payloads.allot(p, whole_entries, broadcast.whole_meta(token))
    for k in names:
        x = theta[k].detach().reshape(-1)
        if x.dtype != torch.float32:
            x = x.to(torch.float32)
        h, out = base[k].detach().reshape(-1), wouts[k]
        codes, scales = douts[k], douts[k + encodings.SCALES_SUFFIX]
        piece = functools.partial(_delta_piece, x, h, out, codes, scales, q_encoding, block)
        if x.numel() and not all(parallel_passes.run(x.numel(), piece, payloads.ways)):
            payloads.retire(p, delta)
            payloads.retire(p, whole)
            return None
    return delta, whole, {k: wouts[k].view(theta[k].shape) for k in names}


def _delta_piece(
    x: torch.Tensor,
    h: torch.Tensor,
    out: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    encoding: quant.Encoding,
    block: int,
    s: slice,
) -> bool:
    """The blocks of one tensor (flat: Theta `x`, S_{v-1} `h`) that start in `s`: codes and
    scales into `codes` and `scales`, S_v into `out`, chunk by chunk; the piece that ends the
    tensor also does its last block when it is partial (zero-padded, as `quantize` pads).
    False when a value is not finite."""
    n = x.numel()
    full = n // block * block
    lo = -(-s.start // block) * block
    hi = full if s.stop == n else min(full, -(-s.stop // block) * block)
    per = block // 2 if encoding == "int4" else block
    step = max(1, CHUNK // block) * block
    scratch = _scratch(max(step, 2 * block))
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        b0, b1 = a // block, b // block
        w = out[a:b]
        torch.sub(x[a:b], h[a:b], out=w)
        if not quant.quantize_into(
            w, encoding, codes[b0 * per : b1 * per], scales[b0:b1], scratch[: b - a]
        ) or not _settle(w, scales[b0:b1], h[a:b]):
            return False
    if s.stop == n and full < n:
        b0 = full // block
        d = scratch[:block]
        d.zero_()
        torch.sub(x[full:], h[full:], out=d[: n - full])
        if not quant.quantize_into(
            d, encoding, codes[b0 * per :], scales[b0:], scratch[block : 2 * block]
        ):
            return False
        _dequantized(d, scales[b0:])
        if not _finite(torch.add(d[: n - full], h[full:], out=out[full:])):
            return False
    return True


def _dequantized(w: torch.Tensor, scales: torch.Tensor) -> None:
    """D(codes) into `w`, which holds `quant.quantize_into`'s float codes: the same bits as
    `quant.dequantize_blocks` (the codes as float32 times their block's scale)."""
    w.view(scales.numel(), -1).mul_(scales[:, None])


def _settle(w: torch.Tensor, scales: torch.Tensor, h: torch.Tensor) -> bool:
    """S_v = S_{v-1} + D(codes) into `w` (`broadcast.apply_delta`'s arithmetic); whether it
    is finite."""
    _dequantized(w, scales)
    return _finite(w.add_(h))


def _finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite: its sum is finite only then (an inf or a NaN
    makes it inf or NaN), and a sum is a fraction of `isfinite`'s cost; a sum that overflowed
    on finite values is told apart by the exact check."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _same(token: str) -> memoryview:
    return memoryview(broadcast.unchanged(token))
