"""Safetensors payloads: tensors <-> bytes, every header checked before anything reads it.

Only safetensors crosses the network (no pickle, no torch.load): decoding cannot run code.
Every payload's header is parsed and checked here first (`read_header`: a JSON object of at
most `MAX_HEADER_BYTES`, nested no deeper than a safetensors header can be, only the wire
dtypes, shapes and offsets that tile the data buffer exactly), so the safetensors library
never sees a header we did not check. Anything else raises `PayloadError`, nothing else.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ddiloco.wire.errors import PayloadError
from ddiloco.wire.protocol import LAYOUT_KEY, Layout

__all__ = [
    "MAX_HEADER_BYTES",
    "WIRE_DTYPES",
    "Header",
    "PayloadError",
    "decode",
    "encode",
    "header_bytes",
    "layout_from_metadata",
    "pieces",
    "read_header",
    "read_metadata",
    "tensor_views",
]

WIRE_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
ST_DTYPES: Final[dict[str, tuple[torch.dtype, int]]] = {
    "F32": (torch.float32, 4),
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
}
"""The safetensors dtype names of the wire dtypes, with their item size in bytes."""
CODE_DTYPES: Final[dict[str, tuple[torch.dtype, int]]] = {
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
}
"""The dtypes of quantized update codes (int8, int4 packed two per byte; wire/encodings.py),
accepted by `read_header(codes=True)` only: the update route's, which encodings.py then checks."""

MAX_HEADER_BYTES: Final = 16 << 20
"""The largest safetensors header accepted (the init payload's carries the whole layout)."""
MAX_DEPTH: Final = 3
"""A safetensors header nests three deep: {name: {"shape": [...]}}."""
MAX_DIMS: Final = 16
MAX_INT: Final = (1 << 63) - 1
_ENTRY_KEYS: Final = frozenset({"dtype", "shape", "data_offsets"})
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\Z)', re.DOTALL)
"""A JSON string, or an unterminated one up to the end: it always matches where it starts,
so stripping strings is one linear pass whatever the input."""
_INNERMOST = re.compile(r"\[[^\[\]{}]*+\]|\{[^\[\]{}]*+\}")
_BRACKETS = re.compile(r"[\[\]{}]")


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    """The safetensors dtype name (one of `ST_DTYPES`)."""
    shape: tuple[int, ...]
    begin: int
    end: int
    """Byte offsets into the data buffer (after the header)."""


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_bytes: int
    """Length of the data buffer the offsets index."""


_NAMES: Final[dict[torch.dtype, str]] = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
}
"""Dtypes `pieces` lays out itself (the safetensors names); any other goes through the
safetensors library."""


def header_bytes(
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None
) -> tuple[bytes, list[tuple[int, int]]]:
    """A safetensors header (its 8-byte length first) for tensors of these names, dtypes
    and shapes laid out in this order, and each one's (begin, end) in the data after it."""
    header: dict[str, Any] = {}
    offsets: list[tuple[int, int]] = []
    at = 0
    for name, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [at, at + size],
        }
        offsets.append((at, at + size))
        at += size
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, offsets


def pieces(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> list[memoryview | bytes] | None:
    """A safetensors file as its parts: the header, then each tensor's bytes as a view of
    the tensor itself (no copy). None if a dtype is not in `_NAMES`. The views keep the
    tensors alive; write or join them before the tensors change."""
    ts = {name: tensors[name].detach().cpu().contiguous() for name in sorted(tensors)}
    if any(t.dtype not in _NAMES for t in ts.values()):
        return None
    head, _ = header_bytes([(n, t.dtype, tuple(t.shape)) for n, t in ts.items()], metadata)
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in ts.values() if t.numel()]
    return [head, *views]


def encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """Tensors as a safetensors payload (one copy of their bytes, into the result)."""
    parts = pieces(tensors, metadata)
    if parts is None:
        contiguous = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        return st_save(contiguous, metadata=metadata)
    return b"".join(parts)


def _bad(why: str) -> NoReturn:
    raise PayloadError(f"payload is not safetensors: {why}")


def _check_depth(text: str) -> None:
    """Refuse JSON nested deeper than MAX_DEPTH (or with unbalanced brackets) before parsing:
    strip the strings, then peel the innermost containers MAX_DEPTH times; any bracket left
    is nesting a header cannot have. Linear passes, no recursion."""
    bare = _STRING.sub('""', text)
    for _ in range(MAX_DEPTH):
        bare, n = _INNERMOST.subn("0", bare)
        if n == 0:
            break
    if _BRACKETS.search(bare):
        _bad(f"header nests deeper than {MAX_DEPTH} levels or has unbalanced brackets")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        _bad("header repeats a key")
    return out


def _no_constant(name: str) -> NoReturn:
    _bad(f"header holds the non-JSON constant {name}")


def _utf8(s: str) -> bool:
    """False for a string holding a lone surrogate (a `\\ud800` escape): not UTF-8."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_count(x: object) -> bool:
    return type(x) is int and 0 <= x <= MAX_INT


def _entry(name: object, raw: object, dtypes: dict[str, tuple[torch.dtype, int]]) -> TensorEntry:
    if not isinstance(raw, dict) or set(raw) != _ENTRY_KEYS:
        _bad(f"entry {name!r} is not {{dtype, shape, data_offsets}}")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(dtype, str):
        _bad(f"entry {name!r} has a dtype that is not a string")
    if dtype not in dtypes:
        allowed = ", ".join(dtypes)
        raise PayloadError(f"tensor {name!r} has dtype {dtype[:32]!r}; the wire allows {allowed}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
        _bad(f"entry {name!r} has a shape that is not a list of at most {MAX_DIMS} sizes >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets)):
        _bad(f"entry {name!r} has data_offsets that are not [begin, end]")
    begin, end = offsets
    if end < begin or end - begin != math.prod(shape) * dtypes[dtype][1]:
        _bad(f"entry {name!r}: data_offsets {offsets} do not hold a {dtype} tensor of {shape}")
    return TensorEntry(dtype, tuple(shape), begin, end)


def read_header(payload: bytes, *, codes: bool = False) -> Header:
    """Parse and check a safetensors header without touching any tensor data. `codes` also
    admits the `CODE_DTYPES` of a quantized update (the update route: encodings.py checks them)."""
    if len(payload) < 8:
        _bad("shorter than its 8-byte header length")
    n = int.from_bytes(payload[:8], "little")
    if n <= 0 or 8 + n > len(payload):
        _bad("header length out of range")
    if n > MAX_HEADER_BYTES:
        _bad(f"header of {n} bytes is larger than {MAX_HEADER_BYTES}")
    try:
        text = bytes(payload[8 : 8 + n]).decode("utf-8")
    except UnicodeDecodeError:
        _bad("header is not UTF-8")
    if not text.startswith("{"):
        _bad("header is not a JSON object")
    _check_depth(text)
    try:
        raw = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # ValueError covers JSONDecodeError
        _bad(f"bad header ({str(e)[:200]})")
    if not isinstance(raw, dict):
        _bad("header is not a JSON object")
    meta = raw.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        _bad("__metadata__ is not a map of strings")
    if not all(map(_utf8, [*raw, *meta, *meta.values()])):
        _bad("header holds a string that is not UTF-8 (a lone surrogate escape)")
    dtypes = ST_DTYPES | CODE_DTYPES if codes else ST_DTYPES
    tensors = {name: _entry(name, entry, dtypes) for name, entry in raw.items()}
    data_bytes = len(payload) - 8 - n
    at = 0
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin != at:
            _bad(f"tensor {name!r} starts at byte {t.begin}, not where the previous ended ({at})")
        at = t.end
    if at != data_bytes:
        _bad(f"tensors cover {at} bytes of a {data_bytes}-byte data buffer")
    return Header(tensors, meta, data_bytes)


def read_metadata(payload: bytes) -> dict[str, str]:
    """The safetensors header's `__metadata__`, without decoding any tensor (the whole
    header is checked, as `read_header` does)."""
    return read_header(payload).metadata


def decode(payload: bytes, header: Header | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a payload whose header passed `read_header` (pass it if already read);
    raises only PayloadError."""
    header = header or read_header(payload)
    try:
        tensors = st_load(bytes(payload))
    except Exception as e:  # the header was checked: this is a library disagreement
        raise PayloadError(f"payload is not valid safetensors: {str(e)[:200]}") from None
    for name, t in header.tensors.items():
        got = tensors.get(name)
        want = (ST_DTYPES | CODE_DTYPES)[t.dtype][0]
        if got is None or tuple(got.shape) != t.shape or got.dtype != want:
            raise PayloadError(f"payload is not valid safetensors: tensor {name!r} misread")
    if len(tensors) != len(header.tensors):
        raise PayloadError("payload is not valid safetensors: unexpected tensors")
    return tensors


def tensor_views(
    payload: bytes | bytearray | memoryview, header: Header
) -> dict[str, torch.Tensor]:
    """Every tensor of a payload whose header passed `read_header`, as a read-only view of
    the body's bytes in its own dtype and shape (no copy: the caller converts what it keeps,
    and must not write to them nor keep them past the body)."""
    view = memoryview(payload)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    start = len(view) - header.data_bytes
    dtypes = ST_DTYPES | CODE_DTYPES
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():  # a bytes body is read-only; it is only ever read
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        for name, t in header.tensors.items():
            dtype = dtypes[t.dtype][0]
            if t.end == t.begin:
                out[name] = torch.empty(t.shape, dtype=dtype)
                continue
            src = view[start + t.begin : start + t.end]
            out[name] = torch.frombuffer(src, dtype=dtype).view(t.shape)
    return out


def layout_from_metadata(meta: dict[str, str]) -> Layout:
    raw = meta.get(LAYOUT_KEY)
    if raw is None:
        raise PayloadError(f"init payload lacks the {LAYOUT_KEY!r} metadata")
    try:
        return Layout.model_validate_json(raw)
    except ValueError as e:
        raise PayloadError(f"init payload has an invalid layout: {str(e)[:500]}") from None
