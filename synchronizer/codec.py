"""Safetensors payloads: tensors <-> bytes, and the checks an incoming update must pass.

Only safetensors crosses the network (no pickle, no torch.load): decoding cannot run code.
"""

from __future__ import annotations

import json
import math
from typing import Final

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ddiloco.synchronizer.errors import PayloadError
from ddiloco.synchronizer.protocol import LAYOUT_KEY, FragmentSpec, Layout

__all__ = ["WIRE_DTYPES", "PayloadError", "check_fragment", "decode", "encode", "read_metadata"]

WIRE_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    contiguous = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return st_save(contiguous, metadata=metadata)


def read_metadata(payload: bytes) -> dict[str, str]:
    """The safetensors header's `__metadata__`, without decoding any tensor."""
    if len(payload) < 8:
        raise PayloadError("payload is not safetensors: shorter than its 8-byte header length")
    n = int.from_bytes(payload[:8], "little")
    if n <= 0 or 8 + n > len(payload):
        raise PayloadError("payload is not safetensors: header length out of range")
    try:
        header = json.loads(payload[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PayloadError(f"payload is not safetensors: bad header ({e})") from None
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise PayloadError("payload is not safetensors: __metadata__ is not a map")
    return {str(k): str(v) for k, v in meta.items()}


def decode(payload: bytes) -> dict[str, torch.Tensor]:
    try:
        return st_load(payload)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise PayloadError(f"payload is not valid safetensors: {e}") from None


def check_fragment(tensors: dict[str, torch.Tensor], spec: FragmentSpec) -> None:
    """Refuse tensors that do not match the fragment's names, shapes, dtypes, or hold NaN/Inf."""
    expected = {t.name: t for t in spec.tensors}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise PayloadError(
            f"fragment {spec.index} tensors do not match the layout: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    for name, t in tensors.items():
        want = expected[name]
        if list(t.shape) != want.shape:
            raise PayloadError(
                f"tensor {name!r} has shape {list(t.shape)}, layout says {want.shape}"
            )
        if t.dtype not in WIRE_DTYPES.values():
            allowed = ", ".join(WIRE_DTYPES)
            raise PayloadError(f"tensor {name!r} has dtype {t.dtype}; allowed: {allowed}")
        if not bool(torch.isfinite(t).all()):
            raise PayloadError(f"tensor {name!r} contains NaN or Inf")


def layout_from_metadata(meta: dict[str, str]) -> Layout:
    raw = meta.get(LAYOUT_KEY)
    if raw is None:
        raise PayloadError(f"init payload lacks the {LAYOUT_KEY!r} metadata")
    try:
        return Layout.model_validate_json(raw)
    except ValueError as e:
        raise PayloadError(f"init payload has an invalid layout: {e}") from None


def norm(tensors: dict[str, torch.Tensor]) -> float:
    sq = sum(float(t.float().pow(2).sum()) for t in tensors.values())
    return math.sqrt(sq)
