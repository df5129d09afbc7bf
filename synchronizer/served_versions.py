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
"""

from __future__ import annotations

import secrets
from typing import Final, NamedTuple

import torch

from ddiloco.synchronizer.served_buffers import Served
from ddiloco.wire import broadcast, quant
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
        meta = broadcast.whole_meta(str(prev.token))
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
            k: broadcast.apply_delta(prev.held[k], q, torch.empty_like(prev.held[k]))
            for k, q in (deltas or {}).items()
        }
        if deltas is not None and all(bool(torch.isfinite(t).all()) for t in held.values()):
            token = broadcast.token(lineage, version)
            meta = broadcast.quantized_meta(q_encoding, encoding, block, theta)
            meta |= {TOKEN_KEY: token, BASE_KEY: prev.token}
            delta = payloads.encode_codes(p, deltas, meta)
            whole = payloads.encode(p, held, broadcast.whole_meta(token))
            return Broadcast(
                version, whole, "fp32", delta, encoding, token, prev.token, held, _same(token)
            )
    if not all(bool(torch.isfinite(v).all()) for v in theta.values()):
        raise ValueError(f"fragment {p} version {version} is not finite: it is never served")
    held = {k: v.detach().to(torch.float32, copy=True) for k, v in theta.items()}
    token = broadcast.initial_token(held) if version == 0 else broadcast.token(_lineage(), version)
    whole = payloads.encode(p, held, broadcast.whole_meta(token))
    return Broadcast(version, whole, "fp32", None, "", token, None, held, _same(token))


def _same(token: str) -> memoryview:
    return memoryview(broadcast.unchanged(token))
