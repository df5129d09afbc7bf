"""Learner-to-synchronizer update encodings: float tensors, or blockwise absmax int8 / int4.

    payload, sent = encode_update(delta, meta, "int4", block=128)   # the learner
    anchor += sent                     # error feedback: what int4 dropped goes out next time
    tensors = decode_update(payload, codec.read_header(payload, codes=True), spec,
                            accepted=frozenset({"int4", "bfloat16"}))  # the synchronizer

An update is a safetensors payload whose metadata is `UpdateMeta` (with `encoding`). The
float encodings (float32, bfloat16) carry each layout tensor as it is, in a float dtype. The
quantized ones (int8, int4; wire/quant.py) carry, for each layout tensor `name`,
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
block size that is not a sane even integer, a float update holding integer tensors, or one
whose tensors are not of the float dtype its `encoding` names (bfloat16 tensors labelled
float32 would pass a synchronizer that does not accept bfloat16), or one whose metadata names
no encoding. Only safetensors is read (no pickle).
"""

from __future__ import annotations

import math
from typing import Final

import torch

from ddiloco.wire import codec, quant
from ddiloco.wire.errors import PayloadError, Refusal, SyncError
from ddiloco.wire.protocol import UPDATE_ENCODINGS, FragmentSpec, UpdateMeta

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
]

FLOAT_ENCODINGS: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}
FLOAT_WIRE_DTYPES: Final[dict[str, str]] = {"float32": "F32", "bfloat16": "BF16"}
"""The safetensors dtype of each float encoding's tensors."""
QUANTIZED: Final = ("int8", "int4")
ALL: Final = frozenset(UPDATE_ENCODINGS)
"""Every encoding: what a replay of the pending log (updates accepted earlier) decodes."""
CODE_DTYPE: Final = {"int8": "I8", "int4": "U8"}
"""The safetensors dtype of each quantized encoding's codes."""
BLOCK_KEY: Final = "ddiloco.block"
SCALES_SUFFIX: Final = "#scales"
MAX_BLOCK: Final = 1 << 16
"""The largest block accepted: 64 Ki values per scale (any larger saves nothing)."""


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
    """The update's encoding, its metadata's `encoding`. PayloadError if the metadata names
    none, or no known one."""
    named = header.metadata.get("encoding")
    if named is None:
        raise PayloadError(
            f"update metadata names no encoding (one of {', '.join(UPDATE_ENCODINGS)})"
        )
    if named not in UPDATE_ENCODINGS:
        raise PayloadError(
            f"update encoding {named[:32]!r} is not one of {', '.join(UPDATE_ENCODINGS)}"
        )
    return named


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


def decode_update(
    payload: bytes,
    header: codec.Header,
    spec: FragmentSpec,
    accepted: frozenset[str],
) -> dict[str, quant.Term]:
    """Tensors of `spec`'s names and shapes from an update whose header passed
    `codec.read_header(payload, codes=True)`, as read-only views of the payload, no copy:
    a float encoding's as tensors in their own dtype, a quantized one's as `quant.Quantized`
    (codes and scales; the synchronizer reads either where it lies, dequantizing a chunk at
    a time). The caller keeps the payload alive and unwritten while it holds them. Raises
    SyncError(ENCODING) for an encoding not in `accepted`, PayloadError for anything
    malformed (the module docstring lists it)."""
    encoding = encoding_of(header)
    require(encoding, accepted)
    if encoding in FLOAT_ENCODINGS:
        return _decode_float(payload, header, spec, encoding)
    return _decode_quantized(payload, header, spec, encoding)


def _decode_float(
    payload: bytes, header: codec.Header, spec: FragmentSpec, named: str
) -> dict[str, quant.Term]:
    """The float tensors' views: each of the dtype the update's encoding `named`, or
    float32. float32 is never narrower than the encoding named: a learner's outbox sums
    updates queued behind an outage in float32 (learner/outbox.py), which keeps bits a job's
    bf16 would drop and claims no encoding the synchronizer was not configured for; a
    narrower dtype than named is refused."""
    want = FLOAT_WIRE_DTYPES[named]
    for name, t in header.tensors.items():
        if t.dtype not in codec.ST_DTYPES:
            allowed = ", ".join(codec.ST_DTYPES)
            raise PayloadError(
                f"tensor {name!r} has dtype {t.dtype}; a float update allows {allowed}"
            )
        if t.dtype not in (want, "F32"):
            raise PayloadError(
                f"tensor {name!r} has dtype {t.dtype}, but the update's encoding is {named} "
                f"({want}): an update's tensors are of the dtype its encoding names"
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
) -> dict[str, quant.Term]:
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
    out: dict[str, quant.Term] = {}
    for t in spec.tensors:
        q = quant.Quantized(
            encoding,  # type: ignore[arg-type]
            tuple(t.shape),
            block,
            tensors[t.name],
            tensors[t.name + SCALES_SUFFIX],
        )
        try:
            quant.check_codes(q)
        except ValueError as e:
            raise PayloadError(f"{encoding} update tensor {t.name!r}: {e}") from None
        out[t.name] = q
    return out
