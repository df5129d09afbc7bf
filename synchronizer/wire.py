"""Learner-to-synchronizer update encodings: float tensors, or blockwise absmax int8 / int4.

    payload, sent = encode_update(delta, meta, "int4", block=128)   # the learner
    anchor += sent                     # error feedback: what int4 dropped goes out next time
    tensors = decode_update(payload, codec.read_header(payload, codes=True), spec,
                            accepted=frozenset({"int4", "bfloat16"}))  # the synchronizer

An update is a safetensors payload whose metadata is `UpdateMeta` (with `encoding`). The
float encodings (float32, bfloat16) carry each layout tensor as it is, in a float dtype. The
quantized ones (int8, int4; synchronizer/quant.py) carry, for each layout tensor `name`,
`name` -> its codes, flat (I8, or U8 holding two int4 codes per byte, low nibble first, each
offset to 0..14) and `name#scales` -> one float32 scale per block of `ddiloco.block` values
(metadata), the last block padded with zeros. A value is code x its block's scale.

`sent` is what the synchronizer will decode, as float32: the learner's anchor moves by it,
so what quantization dropped stays in the learner's parameters minus its anchor and goes
out with the fragment's next hand-over (error feedback; nothing is lost, only delayed).

The synchronizer refuses an encoding it was not configured for (`accepted`,
`SyncSettings.update_encodings`) with `Refusal.ENCODING` (415), and anything malformed with
`PayloadError` (422): tensors missing or extra, codes or scales of the wrong dtype or length
for the layout shape and block, a scale non-finite or negative, an int4 code above 14, a
block size that is not a sane even integer, a float update holding integer tensors. Only
safetensors is read (no pickle). An update with no `encoding` (an older learner) has the
encoding of its float tensors: bfloat16 if they all are, else float32.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Final

import torch

from ddiloco.synchronizer import codec, quant
from ddiloco.synchronizer.buffers import POOL
from ddiloco.synchronizer.errors import PayloadError, Refusal, SyncError
from ddiloco.synchronizer.protocol import UPDATE_ENCODINGS, FragmentSpec, UpdateMeta

__all__ = [
    "ALL",
    "BLOCK_KEY",
    "FLOAT_ENCODINGS",
    "MAX_BLOCK",
    "QUANTIZED",
    "SCALES_SUFFIX",
    "decode_update",
    "encode_update",
    "encoding_of",
    "require",
    "views_body",
]

FLOAT_ENCODINGS: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}
QUANTIZED: Final = ("int8", "int4")
ALL: Final = frozenset(UPDATE_ENCODINGS)
"""Every encoding: what a replay of the pending log (updates accepted earlier) decodes."""
CODE_DTYPE: Final = {"int8": "I8", "int4": "U8"}
"""The safetensors dtype of each quantized encoding's codes."""
BLOCK_KEY: Final = "ddiloco.block"
SCALES_SUFFIX: Final = "#scales"
MAX_BLOCK: Final = 1 << 16
"""The largest block accepted: 64 Ki values per scale (any larger saves nothing)."""
CHUNK: Final = 1 << 20
"""Values a quantized tensor is dequantized in at a time (whole blocks): the synchronizer
can pause between them for a merge, and an int4 chunk's nibbles (1 MB) stay in cache."""


def encode_update(
    delta: dict[str, torch.Tensor],
    meta: UpdateMeta,
    encoding: str,
    block: int = quant.DEFAULT_BLOCK,
) -> tuple[bytes, dict[str, torch.Tensor]]:
    """The update's payload in `encoding`, and `sent`: float32 tensors (the delta's shapes,
    on the CPU) that the synchronizer will decode from it. ValueError on an unknown encoding,
    a bad block or a non-finite value (quantized)."""
    if encoding not in UPDATE_ENCODINGS:
        raise ValueError(
            f"unknown update encoding {encoding!r}; expected one of {UPDATE_ENCODINGS}"
        )
    metadata = meta.model_copy(update={"encoding": encoding}).to_metadata()
    if encoding in FLOAT_ENCODINGS:
        dtype = FLOAT_ENCODINGS[encoding]
        tensors = {k: v.detach().to("cpu", dtype) for k, v in delta.items()}
        sent = {k: v.to(torch.float32) for k, v in tensors.items()}
        return codec.encode(tensors, metadata), sent
    out: dict[str, torch.Tensor] = {}
    sent = {}
    for name, d in delta.items():
        if name.endswith(SCALES_SUFFIX) or name + SCALES_SUFFIX in delta:
            raise ValueError(f"tensor name {name!r} collides with the {SCALES_SUFFIX} suffix")
        q = quant.quantize(d.detach().to("cpu", torch.float32), encoding, block)  # type: ignore[arg-type]
        out[name] = q.codes
        out[name + SCALES_SUFFIX] = q.scales
        sent[name] = quant.dequantize(q)
    metadata[BLOCK_KEY] = str(block)
    return codec.encode(out, metadata), sent


def encoding_of(header: codec.Header) -> str:
    """The update's encoding: its metadata's `encoding`, else (an older sender) that of its
    float tensors. PayloadError if the metadata names no known encoding."""
    named = header.metadata.get("encoding")
    if named is not None:
        if named not in UPDATE_ENCODINGS:
            raise PayloadError(
                f"update encoding {named[:32]!r} is not one of {', '.join(UPDATE_ENCODINGS)}"
            )
        return named
    dtypes = {t.dtype for t in header.tensors.values()}
    return "bfloat16" if dtypes == {"BF16"} else "float32"


def require(encoding: str, accepted: frozenset[str]) -> None:
    """Refuse (415) an encoding this synchronizer was not configured for."""
    if encoding in accepted:
        return
    ours = ", ".join(e for e in UPDATE_ENCODINGS if e in accepted) or "none"
    raise SyncError(
        Refusal.ENCODING,
        f"this synchronizer accepts {ours}; the update is {encoding}: set the learner's "
        f"DDILOCO_UPDATE_ENCODING (--update-encoding) to one of those, or add {encoding} to "
        "the synchronizer's DDILOCO_UPDATE_ENCODINGS",
    )


def views_body(header: codec.Header) -> bool:
    """Whether `decode_update` gives views of the payload (a float encoding) rather than
    float32 buffers of `buffers.POOL` (a quantized one)."""
    return encoding_of(header) in FLOAT_ENCODINGS


def decode_update(
    payload: bytes,
    header: codec.Header,
    spec: FragmentSpec,
    accepted: frozenset[str],
    pause: Callable[[], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Tensors of `spec`'s names and shapes from an update whose header passed
    `codec.read_header(payload, codes=True)`: a float encoding's as read-only views of the
    payload in their own dtype (no copy: passes.py reads them where they are; the caller
    keeps the payload alive and unwritten while it holds them), a quantized one's as float32
    buffers of `buffers.POOL`. Raises SyncError(ENCODING) for an encoding not in
    `accepted`, PayloadError for anything malformed (the module docstring lists it).

    `pause`: called between a quantized tensor's chunks of `CHUNK` values (the synchronizer
    waits there while a merge computes: dequantization is most of a quantized update's CPU)."""
    encoding = encoding_of(header)
    require(encoding, accepted)
    if encoding in FLOAT_ENCODINGS:
        return _decode_float(payload, header, spec)
    return _decode_quantized(payload, header, spec, encoding, pause)


def _decode_float(
    payload: bytes, header: codec.Header, spec: FragmentSpec
) -> dict[str, torch.Tensor]:
    for name, t in header.tensors.items():
        if t.dtype not in codec.ST_DTYPES:
            allowed = ", ".join(codec.ST_DTYPES)
            raise PayloadError(
                f"tensor {name!r} has dtype {t.dtype}; a float update allows {allowed}"
            )
    return codec.tensor_views(payload, header)  # shapes and finiteness: admission.py


def _block(header: codec.Header) -> int:
    raw = header.metadata.get(BLOCK_KEY)
    if raw is None:
        raise PayloadError(f"a quantized update needs its block size ({BLOCK_KEY!r} metadata)")
    text = raw.strip()
    if not text.isdigit() or len(text) > 6:
        raise PayloadError(f"{BLOCK_KEY} {raw[:16]!r} is not an integer")
    block = int(text)
    if not 2 <= block <= MAX_BLOCK or block % 2:
        raise PayloadError(f"{BLOCK_KEY} {block} is not an even number in 2..{MAX_BLOCK}")
    return block


def _decode_quantized(
    payload: bytes,
    header: codec.Header,
    spec: FragmentSpec,
    encoding: str,
    pause: Callable[[], None] | None = None,
) -> dict[str, torch.Tensor]:
    block = _block(header)
    code_dtype = CODE_DTYPE[encoding]
    expected: dict[str, tuple[str, int]] = {}  # payload tensor -> (dtype, numel)
    for t in spec.tensors:
        blocks = -(-math.prod(t.shape) // block)
        per_block = block // 2 if encoding == "int4" else block
        expected[t.name] = (code_dtype, blocks * per_block)
        expected[t.name + SCALES_SUFFIX] = ("F32", blocks)
    if len(expected) != 2 * len(spec.tensors):
        raise PayloadError(f"fragment {spec.index} has tensor names that end in {SCALES_SUFFIX}")
    missing = sorted(set(expected) - set(header.tensors))
    extra = sorted(set(header.tensors) - set(expected))
    if missing or extra:
        raise PayloadError(
            f"{encoding} update of fragment {spec.index} does not match the layout: missing "
            f"{missing[:5]}, unexpected {extra[:5]}"
        )
    for name, (dtype, numel) in expected.items():
        got = header.tensors[name]
        if got.dtype != dtype or got.shape != (numel,):
            raise PayloadError(
                f"{encoding} update tensor {name!r} is {got.dtype} {list(got.shape)}; block "
                f"{block} and the layout need {dtype} [{numel}]"
            )
    tensors = codec.tensor_views(payload, header)
    out = {}
    try:
        for t in spec.tensors:
            scales = tensors[t.name + SCALES_SUFFIX]
            if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
                raise PayloadError("a scale is non-finite or negative")
            dst = POOL.take(t.shape)
            out[t.name] = dst
            _dequantize_into(dst.view(-1), tensors[t.name], scales, encoding, block, pause)
    except PayloadError as e:
        POOL.give(out.values())
        raise PayloadError(f"{encoding} update tensor {t.name!r}: {e}") from None
    return out


def _dequantize_into(
    dst: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    encoding: str,
    block: int,
    pause: Callable[[], None] | None = None,
) -> None:
    """`quant.dequantize` written into `dst` (flat float32, the tensor's numel), in place:
    the codes go once into float32, are range-checked (int4) and scaled there; only a last,
    partial block takes a small temporary. The codes' lengths were checked by the caller.
    Chunks of whole blocks, about `CHUNK` values each (the same elementwise arithmetic,
    so the same bits), with `pause()` between them."""
    n = dst.numel()
    nb = scales.numel()
    qmax = quant.QMAX[encoding]
    work = dst if nb * block == n else torch.empty(nb * block, dtype=torch.float32)
    per = max(1, CHUNK // block)  # blocks per chunk
    pairs = min(nb, per) * block // 2  # int4: bytes (two codes each) per chunk
    wide = torch.empty(pairs, dtype=torch.int16) if encoding == "int4" else None
    high = torch.empty(pairs, dtype=torch.int16) if encoding == "int4" else None
    for b0 in range(0, nb, per):
        if b0 and pause is not None:
            pause()
        b1 = min(nb, b0 + per)
        seg = work[b0 * block : b1 * block]
        if wide is not None and high is not None:
            signed = _unpack_int4(
                codes[b0 * block // 2 : b1 * block // 2],
                wide[: (b1 - b0) * block // 2],
                high[: (b1 - b0) * block // 2],
                qmax,
            )
            seg.copy_(signed)
        else:
            seg.copy_(codes[b0 * block : b1 * block])
        seg.view(b1 - b0, block).mul_(scales[b0:b1, None])
    if work is not dst:
        dst.copy_(work[:n])


def _unpack_int4(
    packed: torch.Tensor, wide: torch.Tensor, high: torch.Tensor, qmax: int
) -> torch.Tensor:
    """Two codes per byte (low nibble first, offset by `qmax`) as signed int8 values in order,
    in `wide`'s bytes: each byte widened to int16 whose two bytes, in memory order, are then
    its (low, high) nibble; then range-checked and offset, still one byte per code. 0.3 ms per Mi
    codes here, where unpacking into the two strided columns of a (n, 2) uint8 tensor took
    0.8 and converting and offsetting in float32 another 0.2 (bench/RESULTS.md, issue 15).
    The float32 values (code x scale) are the same bits: the offset is exact either way."""
    wide.copy_(packed)
    torch.bitwise_right_shift(wide, 4, out=high)  # the high nibble
    wide.bitwise_and_(0x0F)  # the low one
    if sys.byteorder == "little":  # the low nibble's byte comes first in memory
        high.bitwise_left_shift_(8)
    else:
        wide.bitwise_left_shift_(8)
    wide.bitwise_or_(high)
    nibbles = wide.view(torch.uint8)
    if nibbles.numel() and int(nibbles.max()) > 2 * qmax:
        raise PayloadError(f"int4 code above {2 * qmax}")
    return nibbles.sub_(qmax).view(torch.int8)  # 0..2 qmax -> -qmax..qmax (mod 256)
