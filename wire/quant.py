"""Blockwise absmax quantization of update deltas and served fragments (int8, int4).

    q = quantize(delta, "int8")              # Quantized: codes (int8 / packed uint8) + scales
    approx = dequantize(q)                   # float32, delta's shape

What quantization drops from an update is not lost: the learner's anchor moves by what the
synchronizer decodes, so the rest goes out with the fragment's next hand-over (encodings.py).

The tensor is flattened and cut into blocks of `block` values (the last one padded with zeros);
each block's scale is its largest magnitude over qmax (127 for int8, 7 for int4), so the
block's largest value is exact and every other one is off by at most scale / 2. int4 codes
are offset to 0..14 and packed two to a byte, low nibble first. Scales are float32: a
float16 scale would overflow for a block whose absmax exceeds 65504 * 7.

On the wire (wire/encodings.py) the synchronizer keeps a received update's codes as they
arrived (a `Quantized` of views of its body, checked by `check_codes`) and dequantizes them a
chunk of blocks at a time (`dequantize_blocks`, synchronizer/update_passes.py): once at
admission, into float32 it gives back after its norm and round-sum term, and again wherever a
merge or a replay reads them. An int4 update waiting for its merge holds 1/8 of the memory of
the float32 it stands for.

`quantize` and `dequantize` are vectorised over the whole tensor (one pass per operation, no
Python loop over blocks); non-finite input is refused, because one inf would make its
block's scale inf and every code in it NaN on the other side.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Final, Literal

import torch

Encoding = Literal["int8", "int4"]
QMAX: Final[dict[str, int]] = {"int8": 127, "int4": 7}
DEFAULT_BLOCK: Final = 128
"""Values per scale. 4 bytes of scale per 128 values is 3% on int8 and 6% on int4."""


@dataclass(frozen=True)
class Quantized:
    encoding: Encoding
    shape: tuple[int, ...]
    block: int
    codes: torch.Tensor
    """int8 codes (int8), or int4 codes packed two per byte (uint8), flat."""
    scales: torch.Tensor
    """float32, one per block."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4


Term = torch.Tensor | Quantized
"""An update's tensor as the synchronizer decodes it (wire/encodings.py): a float tensor in
its own dtype, or quantized codes and scales."""


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def quantize(x: torch.Tensor, encoding: Encoding, block: int = DEFAULT_BLOCK) -> Quantized:
    """`x` (any float dtype) as blockwise absmax codes. Raises ValueError on a non-finite value."""
    if encoding not in QMAX:
        raise ValueError(f"unknown encoding {encoding!r}; expected one of {sorted(QMAX)}")
    if block < 2 or block % 2:
        raise ValueError(f"block must be an even number >= 2, got {block}")
    flat = x.detach().reshape(-1).to(torch.float32)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("cannot quantize a tensor with non-finite values")
    n = flat.numel()
    nb = _blocks(n, block)
    padded = torch.zeros(nb * block, dtype=torch.float32)
    padded[:n] = flat
    grid = padded.view(nb, block)
    qmax = QMAX[encoding]
    absmax = grid.abs().amax(dim=1)
    scales = absmax / qmax
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    codes = torch.round(grid * inv[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    if encoding == "int4":
        u = (codes.view(-1) + qmax).to(torch.uint8)  # 0..14
        packed = u[0::2] | (u[1::2] << 4)
        return Quantized(encoding, tuple(x.shape), block, packed, scales)
    return Quantized(encoding, tuple(x.shape), block, codes.view(-1), scales)


def quantize_into(
    d: torch.Tensor,
    encoding: Encoding,
    codes: torch.Tensor,
    scales: torch.Tensor,
    scratch: torch.Tensor,
) -> bool:
    """Blocks of `d` (float32, flat, scales.numel() whole blocks) quantized as `quantize`
    does, into `codes` (int8; int4: packed uint8, half as many) and `scales` (float32): the
    same bits, without its padded copy or full-size temporaries (synchronizer/served_versions.py
    runs it a cache-sized chunk at a time). `d` is overwritten with the codes as float32, read back
    from their integers as dequantization reads them (a zero is +0.0); `scratch` (float32,
    d's size) is clobbered. False, with the
    outputs meaningless, when a value of `d` is not finite (its block's absmax is not)."""
    qmax = QMAX[encoding]
    nb = scales.numel()
    n = d.numel()
    if not nb:
        return True
    grid = d.view(nb, n // nb)
    torch.amax(torch.abs(d, out=scratch).view(nb, n // nb), dim=1, out=scales)
    if not bool(torch.isfinite(scales).all()):
        return False
    scales.div_(qmax)
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    grid.mul_(inv[:, None])
    d.round_().clamp_(-qmax, qmax)
    if encoding != "int4":
        codes.copy_(d)
        d.copy_(codes)
        return True
    raw = scratch.view(torch.uint8)
    small, packed = raw[:n].view(torch.int8), raw[n : 2 * n].view(torch.int16)
    small.copy_(d)  # -qmax..qmax: float to int8 is a vector conversion, to uint8 is not
    d.copy_(small)
    small.add_(qmax)  # 0..2 qmax
    pairs = small.view(torch.int16)  # each pair of codes, as one int16 in memory order
    if sys.byteorder == "little":  # the first code (the low nibble's) is the low byte
        torch.bitwise_and(pairs, 0x0F, out=packed)
        packed.bitwise_or_(pairs.bitwise_right_shift_(4))
    else:
        torch.bitwise_and(pairs, 0x0F, out=packed).bitwise_left_shift_(4)
        packed.bitwise_or_(pairs.bitwise_right_shift_(8))
    codes.copy_(packed)
    return True


def dequantize(q: Quantized) -> torch.Tensor:
    """The float32 tensor `q` stands for, in its original shape."""
    qmax = QMAX[q.encoding]
    nb = q.scales.numel()
    if q.encoding == "int4":
        if q.codes.dtype != torch.uint8 or q.codes.numel() * 2 != nb * q.block:
            raise ValueError("int4 codes do not match their scales")
        lo = (q.codes & 0x0F).to(torch.int16)
        hi = (q.codes >> 4).to(torch.int16)
        if bool((lo > 2 * qmax).any()) or bool((hi > 2 * qmax).any()):
            raise ValueError("int4 code out of range")
        codes = torch.stack((lo, hi), dim=1).view(-1) - qmax
    else:
        if q.codes.dtype != torch.int8 or q.codes.numel() != nb * q.block:
            raise ValueError("int8 codes do not match their scales")
        codes = q.codes
    if not bool(torch.isfinite(q.scales).all()) or bool((q.scales < 0).any()):
        raise ValueError("scales must be finite and non-negative")
    values = codes.view(nb, q.block).to(torch.float32) * q.scales.to(torch.float32)[:, None]
    return values.view(-1)[: q.numel].view(q.shape)


_local = threading.local()


def _pair_buffers(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's two int16 buffers of at least `n` values (int4 unpacking)."""
    bufs = getattr(_local, "pairs", None)
    if bufs is None or bufs[0].numel() < n:
        bufs = _local.pairs = (torch.empty(n, dtype=torch.int16), torch.empty(n, dtype=torch.int16))
    return bufs[0][:n], bufs[1][:n]


def check_codes(q: Quantized) -> None:
    """ValueError unless every scale of `q` is finite and non-negative and (int4) every code
    is in 0..14: what a received update is checked for before anything reads it (two
    byte-wide passes for int4's codes, 1.4 ms per 16M values here). The codes' and scales'
    dtypes and lengths are the caller's to have checked (encodings.py, against the layout)."""
    if not bool(torch.isfinite(q.scales).all()) or bool((q.scales < 0).any()):
        raise ValueError("a scale is non-finite or negative")
    if q.encoding != "int4" or not q.codes.numel():
        return
    high = 2 * QMAX["int4"]
    step = 1 << 20
    scratch = torch.empty(min(step, q.codes.numel()), dtype=torch.uint8)
    for i in range(0, q.codes.numel(), step):
        part = q.codes[i : i + step]
        if (
            int(part.max()) >> 4 > high
            or int(torch.bitwise_and(part, 0x0F, out=scratch[: part.numel()]).max()) > high
        ):
            raise ValueError(f"int4 code above {high}")


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Two codes per byte (low nibble first, offset by qmax) as signed int8 values in order: each
    byte widened to int16 whose two bytes, in memory order, are then its (low, high) nibble,
    range-checked and offset as bytes: faster than unpacking into the two strided columns of an (n,
    2) uint8 tensor and offsetting in float32 (bench/RESULTS.md, "Figures behind the code"). The
    values are exact either way, so code x scale is the same float32 bits."""
    wide, high = _pair_buffers(packed.numel())
    wide.copy_(packed)
    torch.bitwise_right_shift(wide, 4, out=high)  # the high nibble
    wide.bitwise_and_(0x0F)  # the low one
    if sys.byteorder == "little":  # the low nibble's byte comes first in memory
        high.bitwise_left_shift_(8)
    else:
        wide.bitwise_left_shift_(8)
    wide.bitwise_or_(high)
    qmax = QMAX["int4"]
    nibbles = wide.view(torch.uint8)
    if nibbles.numel() and int(nibbles.max()) > 2 * qmax:
        raise ValueError(f"int4 code above {2 * qmax}")
    return nibbles.sub_(qmax).view(torch.int8)  # 0..2 qmax -> -qmax..qmax (mod 256)


def values(q: Quantized, start: int, end: int) -> Quantized:
    """Values `start`..`end` of `q` (flat) as a Quantized of their own, views of its codes
    and scales: `start` a multiple of its block, `end` one too or its last value (a merge's
    piece, parallel_passes.py; dequantized, the same bits as those values of `q`)."""
    if start % q.block or (end % q.block and end != q.numel):
        raise ValueError(f"values {start}..{end} do not start and end on {q.block}-value blocks")
    b0, b1 = start // q.block, _blocks(end, q.block)
    per = q.block // 2 if q.encoding == "int4" else q.block
    return Quantized(
        q.encoding, (end - start,), q.block, q.codes[b0 * per : b1 * per], q.scales[b0:b1]
    )


def dequantize_blocks(q: Quantized, b0: int, b1: int, out: torch.Tensor) -> torch.Tensor:
    """Blocks `b0`..`b1` of `q` as float32, written into `out` (flat, at least that many
    values, the last block's padding included): `out`'s first (b1 - b0) x block values,
    returned. The same bits as `dequantize` (the same elementwise arithmetic)."""
    block = q.block
    seg = out[: (b1 - b0) * block]
    if q.encoding == "int4":
        seg.copy_(_unpack_int4(q.codes[b0 * block // 2 : b1 * block // 2]))
    else:
        seg.copy_(q.codes[b0 * block : b1 * block])
    seg.view(b1 - b0, block).mul_(q.scales[b0:b1, None])
    return seg
