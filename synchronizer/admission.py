"""Admission of an update: accept it, call it a duplicate, or refuse it with the reason.

Pure functions of the update and the fragment's durable state; nothing here changes state
or needs history that a restart erases (the order high-water marks and the norm history
live in the fragment file and the pending log, see state.py and pending.py).

    meta = parse_update(codec.read_header(payload), path_fragment, num_fragments)  # header only
    check_tokens(meta, rec.tokens_per_step, settings.max_tokens_per_step)  # declared
    verdict = admit(meta, version=fs.version, high_water=hw, max_staleness=4)  # before decoding
    n = delta_norm(delta, spec)                       # after decoding, before any lock
    check_norm(n, spec, theta_norm=..., recent=fs.norms, ...)  # under the fragment's lock

Order: one learner's updates of a fragment carry increasing (incarnation, learner_step), and
its client re-sends an update only as it was. So an update at or below the highest order
the synchronizer holds for that learner and fragment (merged or pending) is one it already
has: `duplicate`, a no-op, whenever it comes back.

Token claim: an update may claim at most the tokens per step its learner declared at join
(kept in the ledger, so a restart keeps the bound), and never more than the synchronizer's
`max_tokens_per_step`: the merge weights a contribution by tokens^2 / steps, and its steps
are capped, so tokens per step are what one learner could otherwise inflate to outweigh
every other.

Norm guard: an update larger than `max_update_ratio` times the fragment's scale (its own
parameter norm, or sqrt(numel) if larger, i.e. an RMS of 1 per parameter, so a fragment of
zero-initialized biases can still move) is refused whatever came before (a fresh or restarted synchronizer has no history; one
finite update of 3e38 must not turn Theta into Inf). Where there is history, an update more
than `max_norm_ratio` times the median of the recent ones is refused as well.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Literal

import torch

from ddiloco.synchronizer import update_passes
from ddiloco.synchronizer.storage.state import FragmentState, Order
from ddiloco.synchronizer.update_passes import Term
from ddiloco.wire import codec
from ddiloco.wire.errors import PayloadError, Refusal, SyncError
from ddiloco.wire.protocol import FragmentSpec, Layout, UpdateMeta
from ddiloco.wire.quant import Quantized

NORM_HISTORY = 32
"""Recent accepted update norms kept per fragment for the relative guard."""
MIN_HISTORY = 5
"""The relative guard needs this many recent norms."""


def parse_update(header: codec.Header, path_fragment: int | None, num_fragments: int) -> UpdateMeta:
    """The update's metadata, from its checked safetensors header alone, or PayloadError."""
    try:
        meta = UpdateMeta.from_metadata(header.metadata)
    except ValueError as e:
        raise PayloadError(f"update metadata is invalid: {e}") from None
    if path_fragment is not None and meta.fragment != path_fragment:
        raise PayloadError(f"update says fragment {meta.fragment} but was sent to {path_fragment}")
    if meta.fragment >= num_fragments:
        raise PayloadError(f"fragment {meta.fragment} does not exist (0..{num_fragments - 1})")
    if meta.steps == 0 or meta.tokens == 0:
        raise PayloadError("update has no steps or no tokens behind it: it carries no work")
    return meta


def check_tokens(meta: UpdateMeta, declared: int, limit: int) -> None:
    """Refuse (422, naming `tokens`) an update claiming more tokens per step than its
    learner declared at join (`declared`, 0: none declared) or than `limit`."""
    bound = min(declared, limit) if declared > 0 else limit
    if meta.tokens > meta.steps * bound:
        source = (
            f"learner {meta.learner_id!r} declared at join (tokens_per_step)"
            if 0 < declared <= limit
            else "this synchronizer allows (max_tokens_per_step)"
        )
        raise PayloadError(
            f"update tokens {meta.tokens} over steps {meta.steps} is "
            f"{meta.tokens / max(1, meta.steps):.6g} tokens per step, more than the {bound} "
            f"{source}"
        )


def initial_fragments(layout: Layout, tensors: dict[str, torch.Tensor]) -> list[FragmentState]:
    """The version-0 fragments of an init payload, checked against its layout."""
    out = []
    for spec in layout.fragments:
        missing = [t.name for t in spec.tensors if t.name not in tensors]
        if missing:
            raise PayloadError(f"init payload lacks tensors {missing[:5]}")
        params = {t.name: tensors[t.name].float().clone() for t in spec.tensors}
        check_fragment(params, spec)
        out.append(FragmentState(params, {k: torch.zeros_like(v) for k, v in params.items()}))
    return out


def admit(
    meta: UpdateMeta, *, version: int, high_water: Order | None, max_staleness: int
) -> Literal["fresh", "late", "duplicate"]:
    """Where an update stands before its tensors are read: `fresh` (based on the current
    version: it may start a round), `late` (within max_staleness: it waits in the next
    round), or `duplicate`. Raises SyncError(STALE) otherwise."""
    if is_duplicate(meta, high_water):
        return "duplicate"
    p = meta.fragment
    if meta.base_version > version:
        raise SyncError(
            Refusal.STALE,
            f"update of fragment {p} is based on version {meta.base_version}, which this "
            f"synchronizer never published (it is at {version}): unknown base",
        )
    if meta.base_version < version - max_staleness:
        raise SyncError(
            Refusal.STALE,
            f"update of fragment {p} is based on version {meta.base_version}, the global "
            f"fragment is at {version}: more than {max_staleness} rounds already merged "
            "since (max_staleness); adopt the new version",
        )
    return "fresh" if meta.base_version == version else "late"


def is_duplicate(meta: UpdateMeta, high_water: Order | None) -> bool:
    """What `admit` says first: an update at or below the learner's high-water mark for its
    fragment is one the synchronizer already holds (marks only grow, so this stays true)."""
    return high_water is not None and meta.order() <= high_water


def delta_norms(delta: dict[str, Term], spec: FragmentSpec) -> dict[str, float]:
    """Refuse a delta of the wrong shape or dtype, or non-finite; return each tensor's norm
    (a pass over the tensors that needs no lock: `check_norm` judges their total against
    the fragment, and the merge's radial-directional average reuses them)."""
    check_fragment(delta, spec, finite=False)
    return finite_norms(delta)  # NaN/Inf and an overflowing norm refused in one pass


def delta_norm(delta: dict[str, Term], spec: FragmentSpec) -> float:
    """`delta_norms`, totalled."""
    return total_norm(delta_norms(delta, spec))


def check_fragment(tensors: dict[str, Term], spec: FragmentSpec, *, finite: bool = True) -> None:
    """Refuse tensors that do not match the fragment's names, shapes, dtypes, or hold NaN/Inf
    (`finite=False` leaves that to the caller: `finite_norms` sees it in the same pass)."""
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
        if isinstance(t, Quantized):
            continue  # codes and scales checked as they were decoded (encodings.py)
        if t.dtype not in codec.WIRE_DTYPES.values():
            allowed = ", ".join(codec.WIRE_DTYPES)
            raise PayloadError(f"tensor {name!r} has dtype {t.dtype}; allowed: {allowed}")
        if finite and not bool(torch.isfinite(t).all()):  # a float tensor
            raise PayloadError(f"tensor {name!r} contains NaN or Inf")


def tensor_norms(tensors: dict[str, Term]) -> dict[str, float]:
    """Each tensor's L2 norm (`update_passes.norm`: one pass each, no float32 copy of a bf16
    tensor)."""
    return {k: update_passes.norm(t) for k, t in tensors.items()}


def total_norm(norms: dict[str, float]) -> float:
    """The norm of all the tensors together from their own norms (in float64)."""
    return math.sqrt(sum(n * n for n in norms.values()))


def norm(tensors: dict[str, Term]) -> float:
    """The L2 norm of all the tensors together, accumulated in float32 per tensor (one pass
    each, no float32 copy of a bf16 tensor) and in float64 across them."""
    return total_norm(tensor_norms(tensors))


def finite_norms(tensors: dict[str, Term]) -> dict[str, float]:
    """`tensor_norms`, refusing NaN or Inf: a non-finite entry makes its tensor's norm
    non-finite (NaN and Inf propagate through the sum of squares), so one pass checks both;
    only then is each tensor searched, to say which one and why."""
    norms = tensor_norms(tensors)
    n = total_norm(norms)
    if math.isfinite(n):
        return norms
    for name, t in tensors.items():
        if not bool(torch.isfinite(update_passes.dense(t)).all()):
            raise PayloadError(f"tensor {name!r} contains NaN or Inf")
    raise PayloadError(f"update norm overflows ({n}): not a plausible update")


def check_norm(
    n: float,
    spec: FragmentSpec,
    *,
    theta_norm: float,
    recent: Sequence[float],
    max_update_ratio: float,
    max_norm_ratio: float,
) -> None:
    """Refuse an update norm `n` implausible for the global fragment as it is now."""
    scale = max(theta_norm, math.sqrt(spec.numel()))
    if n > max_update_ratio * scale:
        raise PayloadError(
            f"update norm {n:.3g} exceeds {max_update_ratio:g}x the scale of global fragment "
            f"{spec.index} ({scale:.3g}: its norm, or an RMS of 1 per parameter if larger; "
            "max_update_ratio)"
        )
    if len(recent) >= MIN_HISTORY:
        median = statistics.median(recent)
        if n > max_norm_ratio * max(median, 1e-12):
            raise PayloadError(
                f"update norm {n:.3g} exceeds {max_norm_ratio:g}x the recent median "
                f"{median:.3g} (max_norm_ratio)"
            )
