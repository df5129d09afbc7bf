"""The download format: what `GET /v1/fragments/{p}` answers, and how a learner reads it.

    got = read(body, held=Held(token, tensors))   # the tensors the learner adopts, and a token
    held = Held(got.token, got.tensors)           # named at the next download (?held=<token>)

The synchronizer serves every fragment in its `broadcast_encoding` (`protocol.BROADCAST_ENCODINGS`;
synchronizer/served_versions.py encodes them):
- `float32`, `bfloat16`: Theta_v's tensors in that dtype (no metadata: the plain payload).
- `int8`: Theta_v as blockwise absmax int8 codes with a float32 scale per block, the layout
  updates use (encodings.py: `name` -> codes, flat; `name#scales` -> scales); the learner adopts
  their dequantized values.
- `int8-delta`, `int4-delta`: the synchronizer keeps per fragment S_v, the served
  reconstruction every learner holds, not Theta_v itself:
  S_v = S_{v-1} + D(Q(Theta_v - S_{v-1})) (Q: blockwise int8 or int4, D: its dequantization).
  A learner that holds S_{v-1} names its token (`held`, the query parameter
  `protocol.HELD_QUERY`) and gets Q(Theta_v - S_{v-1}); any other gets S_v whole, in float32,
  so that it ends with the same bits. Both sides compute S_v with `apply_delta`, elementwise
  float32 arithmetic (one multiply, one add, each rounded once), so a learner that followed
  every delta holds S_v bit for bit.

Tokens name an S: "<lineage>.<version>" (`token`). A lineage that starts at version 0 is named
by S_0's content (`initial_token`): a joiner holding the same initial values names them by the
same token and downloads nothing of version 0. A learner asking with the token of the copy
served gets a payload of no tensors (`unchanged`).

Quantized payloads carry metadata (`quantized_meta`): `encoding` (int8 / int4) and
`ddiloco.block` as updates do (so encodings.decode_update checks them), `ddiloco.download`
(the body's encoding), `ddiloco.shapes` (the tensors' shapes, JSON: the codes are flat), and
for a delta `ddiloco.served` (the token of S_v) and `ddiloco.base` (of the S it applies to).
A float32 whole payload of a delta encoding carries `ddiloco.download` and `ddiloco.served`
(`whole_meta`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Final

import torch

from ddiloco.wire import codec, encodings, quant
from ddiloco.wire.errors import PayloadError
from ddiloco.wire.protocol import BROADCAST_ENCODINGS, FragmentSpec, TensorSpec

__all__ = [
    "DELTAS",
    "Download",
    "Held",
    "StaleBase",
    "apply_delta",
    "dequantize_into",
    "initial_token",
    "quantized_meta",
    "read",
    "token",
    "unchanged",
    "whole_dtype",
    "whole_meta",
]

DELTAS: Final[dict[str, quant.Encoding]] = {"int8-delta": "int8", "int4-delta": "int4"}
"""The delta encodings and the quantization of their deltas."""
DOWNLOAD_KEY: Final = "ddiloco.download"
TOKEN_KEY: Final = "ddiloco.served"
BASE_KEY: Final = "ddiloco.base"
SHAPES_KEY: Final = "ddiloco.shapes"
UNCHANGED: Final = "unchanged"
"""The download kind of an answer to a learner that holds the served copy already: no
tensors."""
MAX_TOKEN: Final = 64
"""The longest `held` token looked at; a longer one is no token the synchronizer issued."""


def whole_dtype(encoding: str) -> str:
    """The float dtype of `encoding`'s whole payloads: float32 for the quantized ones (a
    delta encoding's whole S_v must keep its every bit)."""
    if encoding not in BROADCAST_ENCODINGS:
        raise ValueError(f"unknown broadcast encoding {encoding!r}; one of {BROADCAST_ENCODINGS}")
    return "bfloat16" if encoding == "bfloat16" else "float32"


def token(lineage: str, version: int) -> str:
    """The token of a lineage's S at `version`."""
    return f"{lineage}.{version}"


def initial_token(tensors: dict[str, torch.Tensor]) -> str:
    """The token of S_0 when it is `tensors` (float32): a lineage that starts at version 0
    is named by its content, so a learner holding the same initial values (it built the
    model from the job's seed, or initialized the job) names them without a download."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode() + b"\0")
        h.update(tensors[name].detach().to(torch.float32).contiguous().view(torch.uint8).numpy())
    return token(h.hexdigest()[:32], 0)


def quantized_meta(
    q_encoding: str, encoding: str, block: int, tensors: dict[str, torch.Tensor]
) -> dict[str, str]:
    """The metadata of a quantized download in broadcast `encoding` (codes `q_encoding`) of
    tensors of these names and shapes; a delta's adds `TOKEN_KEY` and `BASE_KEY`."""
    shapes = {k: list(v.shape) for k, v in sorted(tensors.items())}
    return {
        "encoding": q_encoding,
        encodings.BLOCK_KEY: str(block),
        DOWNLOAD_KEY: encoding,
        SHAPES_KEY: json.dumps(shapes, separators=(",", ":")),
    }


def whole_meta(served: str) -> dict[str, str]:
    """The metadata of a delta encoding's whole S (float32) named `served`."""
    return {DOWNLOAD_KEY: "float32", TOKEN_KEY: served}


def unchanged(served: str) -> bytes:
    """The answer to a learner that holds `served` already: a payload of no tensors."""
    return codec.encode({}, {DOWNLOAD_KEY: UNCHANGED, TOKEN_KEY: served})


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
    served = meta.get(TOKEN_KEY)
    if kind == UNCHANGED:
        if held is None or served != held.token:
            raise StaleBase(
                f"told {served!r} is held, by a learner that holds {held and held.token!r}"
            )
        return Download(held.tensors, served)
    if kind is None or kind in ("float32", "bfloat16"):
        if any(t.dtype not in codec.ST_DTYPES for t in header.tensors.values()):
            raise PayloadError("a float fragment holds tensors of a non-float dtype")
        if isinstance(body, bytearray):
            tensors = codec.tensor_views(body, header)
        else:
            tensors = codec.decode(bytes(body), header)
        return Download(tensors, served)
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
    if held is None or base != held.token or served is None:
        raise StaleBase(f"a delta of {base!r} for a learner that holds {held and held.token!r}")
    if set(held.tensors) != set(out) or any(
        tuple(held.tensors[k].shape) != tuple(out[k].shape) for k in out
    ):
        raise StaleBase("a delta whose tensors differ from the held ones")
    for name, q in codes.items():
        apply_delta(held.tensors[name], q, out[name])  # type: ignore[arg-type]
    return Download(out, served)


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
