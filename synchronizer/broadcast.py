"""What downloads get: each fragment's served version in the synchronizer's
`broadcast_encoding` (config.py), encoded once per merge, and how a learner reads it back.

    b = encode(payloads, "int8-delta", p, version, theta)          # a reset: S_v = Theta_v
    b = encode(payloads, "int8-delta", p, version, theta, prev=b)  # after a merge
    body, label = b.body(held="3f9a.41")        # the delta if the learner holds S_{v-1}
    got = read(body, held=Held(token, tensors))  # the learner: the tensors it adopts

Encodings:
- `float32`, `bfloat16`: Theta_v's tensors in that dtype (no metadata: the plain payload).
- `int8`: Theta_v as blockwise absmax int8 codes with a float32 scale per block, the layout
  updates use (encodings.py: `name` -> codes, flat; `name#scales` -> scales); the learner adopts
  their dequantized values.
- `int8-delta`, `int4-delta`: the synchronizer keeps per fragment S_v, the served
  reconstruction every learner holds, not Theta_v itself:
  S_v = S_{v-1} + D(Q(Theta_v - S_{v-1})) (Q: blockwise int8 or int4, D: its dequantization).
  Each delta carries the last one's quantization error along, so the error never accumulates:
  S_v is within half a quantization step of Theta_v however many versions went by. A learner
  that holds S_{v-1} names its token (`held`, the query parameter `protocol.HELD_QUERY`) and
  gets Q(Theta_v - S_{v-1}); any other (one that missed a version, a new joiner, one holding
  a token of before a restart) gets S_v whole, in float32, so that it ends with the same
  bits. Both sides compute S_v with `apply_delta`, elementwise float32 arithmetic (one
  multiply, one add, each rounded once), so a learner that followed every delta holds S_v
  bit for bit. What merges and the outer optimizer read stays Theta (exact, float32).

Tokens name an S: "<lineage>.<version>". A lineage starts whenever S is set to Theta (the
layout adopted, a restart, a replay of journaled merges): S is not persisted, so a restart
serves whole fragments to every learner once, and the new lineage (random) keeps a learner's
S of before it from being taken for the new one's. A lineage that starts at version 0 is
named by S_0's content instead (`initial_token`): a joiner holding the same initial values
names them by the same token and downloads nothing of version 0 (an answer of no tensors,
`ddiloco.download: unchanged`) and only the delta of version 1. A learner asking with the
token of the copy served gets that same answer. A delta whose S would not be finite (an
overflow) is not published: S restarts from Theta (a new lineage, whole fragments).

Quantized payloads carry metadata: `encoding` (int8 / int4) and `ddiloco.block` as updates
do (so encodings.decode_update checks them), `ddiloco.download` (this module's encoding of the
body), `ddiloco.shapes` (the tensors' shapes, JSON: the codes are flat), and for a delta
`ddiloco.served` (the token of S_v) and `ddiloco.base` (of the S it applies to). A float32
whole payload of a delta encoding carries `ddiloco.download` and `ddiloco.served`.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from dataclasses import dataclass
from typing import Final, NamedTuple

import torch

from ddiloco.synchronizer.served_buffers import Served
from ddiloco.wire import codec, encodings, quant
from ddiloco.wire.errors import PayloadError
from ddiloco.wire.protocol import BROADCAST_ENCODINGS, FragmentSpec, TensorSpec

__all__ = [
    "DELTAS",
    "Broadcast",
    "Download",
    "Held",
    "StaleBase",
    "apply_delta",
    "encode",
    "initial_token",
    "read",
    "whole_dtype",
]

DELTAS: Final[dict[str, quant.Encoding]] = {"int8-delta": "int8", "int4-delta": "int4"}
"""The delta encodings and the quantization of their deltas."""
DOWNLOAD_KEY: Final = "ddiloco.download"
TOKEN_KEY: Final = "ddiloco.served"
BASE_KEY: Final = "ddiloco.base"
SHAPES_KEY: Final = "ddiloco.shapes"
UNCHANGED: Final = "unchanged"
"""The download kind (and metric label) of an answer to a learner that holds the served copy
already: no tensors."""
MAX_TOKEN: Final = 64
"""The longest `held` token looked at; a longer one is no token of ours (a whole answer)."""


def whole_dtype(encoding: str) -> str:
    """The float dtype of `encoding`'s whole payloads (served_buffers.py): float32 for the
    quantized ones (a delta encoding's whole S_v must keep its every bit)."""
    if encoding not in BROADCAST_ENCODINGS:
        raise ValueError(f"unknown broadcast encoding {encoding!r}; one of {BROADCAST_ENCODINGS}")
    return "bfloat16" if encoding == "bfloat16" else "float32"


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
    """S_v itself, float32 (delta encodings): the next delta's base."""
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
"""Each whole payload's label in the bytes-served metric (a delta's is its encoding)."""


def _lineage() -> str:
    return secrets.token_hex(8)


def initial_token(tensors: dict[str, torch.Tensor]) -> str:
    """The token of S_0 when it is `tensors` (float32): a lineage that starts at version 0
    is named by its content, so a learner holding the same initial values (it built the
    model from the job's seed, or initialized the job) names them without a download."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode() + b"\0")
        h.update(tensors[name].detach().to(torch.float32).contiguous().view(torch.uint8).numpy())
    return _token(h.hexdigest()[:32], 0)


def _token(lineage: str, version: int) -> str:
    return f"{lineage}.{version}"


def _shapes(tensors: dict[str, torch.Tensor]) -> str:
    return json.dumps({k: list(v.shape) for k, v in sorted(tensors.items())}, separators=(",", ":"))


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
        meta = _quantized_meta("int8", "int8", block, theta)
        return Broadcast(version, payloads.encode_codes(p, codes, meta), LABELS["int8"])
    q_encoding = DELTAS[encoding]
    if prev is not None and prev.held is not None and prev.version == version:
        # a merge that merged nothing: the same S, served again whole (new buffers: the
        # caller retires the old ones)
        meta = {DOWNLOAD_KEY: "float32", TOKEN_KEY: str(prev.token)}
        return prev._replace(whole=payloads.encode(p, prev.held, meta), delta=None, base=None)
    if prev is not None and prev.held is not None and prev.token is not None:
        lineage = prev.token.rsplit(".", 1)[0]
        try:  # a difference that overflows is not finite: quantize refuses it
            deltas = {
                k: quant.quantize(theta[k].to(torch.float32) - prev.held[k], q_encoding, block)
                for k in sorted(theta)
            }
        except ValueError:
            deltas = None
        held = {
            k: apply_delta(prev.held[k], q, torch.empty_like(prev.held[k]))
            for k, q in (deltas or {}).items()
        }
        if deltas is not None and all(bool(torch.isfinite(t).all()) for t in held.values()):
            token = _token(lineage, version)
            meta = _quantized_meta(q_encoding, encoding, block, theta)
            meta |= {TOKEN_KEY: token, BASE_KEY: prev.token}
            delta = payloads.encode_codes(p, deltas, meta)
            whole = payloads.encode(p, held, {DOWNLOAD_KEY: "float32", TOKEN_KEY: token})
            return Broadcast(
                version, whole, "fp32", delta, encoding, token, prev.token, held, _same(token)
            )
    if not all(bool(torch.isfinite(v).all()) for v in theta.values()):
        raise ValueError(f"fragment {p} version {version} is not finite: it is never served")
    held = {k: v.detach().to(torch.float32, copy=True) for k, v in theta.items()}
    token = initial_token(held) if version == 0 else _token(_lineage(), version)
    whole = payloads.encode(p, held, {DOWNLOAD_KEY: "float32", TOKEN_KEY: token})
    return Broadcast(version, whole, "fp32", None, "", token, None, held, _same(token))


def _same(token: str) -> memoryview:
    return memoryview(codec.encode({}, {DOWNLOAD_KEY: UNCHANGED, TOKEN_KEY: token}))


def _quantized_meta(
    q_encoding: str, encoding: str, block: int, tensors: dict[str, torch.Tensor]
) -> dict[str, str]:
    return {
        "encoding": q_encoding,
        encodings.BLOCK_KEY: str(block),
        DOWNLOAD_KEY: encoding,
        SHAPES_KEY: _shapes(tensors),
    }


def dequantize_into(q: quant.Quantized, out: torch.Tensor) -> torch.Tensor:
    """`q`'s values written into `out` (float32, contiguous, `q`'s numel): the same bits
    as `quant.dequantize` (the same elementwise arithmetic), without its padded copy."""
    flat = out.view(-1)
    n, block = flat.numel(), q.block
    full = n // block
    if full:
        quant.dequantize_blocks(q, 0, full, flat[: full * block])
    if n > full * block:  # the last block, padded: through a block of scratch
        tail = quant.dequantize_blocks(q, full, full + 1, torch.empty(block))
        flat[full * block :].copy_(tail[: n - full * block])
    return out


def apply_delta(held: torch.Tensor, q: quant.Quantized, out: torch.Tensor) -> torch.Tensor:
    """S_v = S_{v-1} + D(q), written into `out` (float32, `held`'s shape; may not be
    `held`): the one arithmetic both the synchronizer and the learner run, so both hold the
    same bits."""
    dequantize_into(q, out)
    return out.add_(held)


@dataclass(frozen=True)
class Held:
    """What a learner holds of a fragment served in a delta encoding: S_v and its token."""

    token: str
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Download:
    """A downloaded fragment: the tensors to adopt, and (delta encodings) the token of the S
    they are, to name at the next download."""

    tensors: dict[str, torch.Tensor]
    token: str | None


class StaleBase(PayloadError):
    """A delta for an S the learner does not hold: fetch the fragment whole."""


def read(body: bytes | bytearray | memoryview, held: Held | None = None) -> Download:
    """The tensors a downloaded fragment stands for. A float payload's tensors: views of
    `body` when it is a buffer of the caller's own (bytearray), else decoded copies. A
    quantized one's: float32 tensors of their own, dequantized into (a delta's, plus `held`'s
    tensors). PayloadError if malformed; StaleBase for a delta of an S other than `held`."""
    header = codec.read_header(body, codes=True)
    meta = header.metadata
    kind = meta.get(DOWNLOAD_KEY)
    token = meta.get(TOKEN_KEY)
    if kind == UNCHANGED:
        if held is None or token != held.token:
            raise StaleBase(
                f"told {token!r} is held, by a learner that holds {held and held.token!r}"
            )
        return Download(held.tensors, token)
    if kind is None or kind in ("float32", "bfloat16"):
        if any(t.dtype not in codec.ST_DTYPES for t in header.tensors.values()):
            raise PayloadError("a float fragment holds tensors of a non-float dtype")
        if isinstance(body, bytearray):
            tensors = codec.tensor_views(body, header)
        else:
            tensors = codec.decode(bytes(body), header)
        return Download(tensors, token)
    if kind != "int8" and kind not in DELTAS:
        raise PayloadError(f"unknown download encoding {kind[:32]!r}")
    spec = _spec(meta)
    q_encoding = "int8" if kind == "int8" else DELTAS[kind]
    if meta.get("encoding") != q_encoding:
        raise PayloadError(f"a {kind} download must hold {q_encoding} codes")
    codes = encodings.decode_update(body, header, spec, frozenset({q_encoding}))
    out = {t.name: torch.empty(t.shape, dtype=torch.float32) for t in spec.tensors}
    if kind == "int8":
        for name, q in codes.items():
            dequantize_into(q, out[name])  # type: ignore[arg-type]
        return Download(out, None)
    base = meta.get(BASE_KEY)
    if held is None or base != held.token or token is None:
        raise StaleBase(f"a delta of {base!r} for a learner that holds {held and held.token!r}")
    if set(held.tensors) != set(out) or any(
        tuple(held.tensors[k].shape) != tuple(out[k].shape) for k in out
    ):
        raise StaleBase("a delta whose tensors differ from the held ones")
    for name, q in codes.items():
        apply_delta(held.tensors[name], q, out[name])  # type: ignore[arg-type]
    return Download(out, token)


def _spec(meta: dict[str, str]) -> FragmentSpec:
    """The tensors' names and shapes a quantized download's metadata names."""
    try:
        shapes = json.loads(meta.get(SHAPES_KEY, ""))
        tensors = [TensorSpec(name=k, shape=v) for k, v in shapes.items()]
        spec = FragmentSpec(index=0, tensors=tensors)
    except (ValueError, TypeError, AttributeError):
        raise PayloadError(
            f"a quantized download needs its tensors' shapes ({SHAPES_KEY})"
        ) from None
    if any(d < 0 for t in spec.tensors for d in t.shape) or sum(
        math.prod(t.shape) for t in spec.tensors
    ) > (1 << 40):
        raise PayloadError(f"{SHAPES_KEY} names impossible shapes")
    return spec
