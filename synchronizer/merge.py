"""Merge math of Decoupled DiLoCo (paper §3): weights, RDA, the policy (the outer Nesterov
step: outer.py).

Pure tensor functions on fp32 CPU tensors; nothing here knows about HTTP, rounds or files.

    policy  = MergePolicy.from_settings(settings)   # rule, weighting, caps, outer optimizer
    outcome = policy.merge(spec, params, momentum, version, contributions)

which, per contribution m with progress delta_m, computes

    Delta_m = -delta_m                                   # outer gradient
    w_m     = contribution_weight(tokens, steps)         # tokens^2 / steps
    Delta   = rda(Delta, w)  or  weighted_mean(Delta, w) # embedding fragments: always the mean
    Delta  *= min(1, tokens / live_tokens)               # merge_scale = live only
    OuterNesterov(lr, momentum).step(Theta_p, b_p, Delta)   # outer.py

into new tensors (the inputs stay as they were), and refuses (raises `NonFiniteMerge`) a
result that is not finite everywhere.

The sums inside the rule (RDA's direction, the mean's sum) are formed in stream.py only, as a
round's contributions arrive or at once (`stream.sum_terms`). synchronizer/reference_merge.py is
the same method written plainly, and the test that the two agree.

Speed (the synchronizer's bound is memory traffic, not arithmetic): one pass per operation over each
tensor, in place where the inputs allow, the average summed with weights relative to the first
contribution's (so it can be summed as contributions arrive: stream.py) and the outer gradient's
sign, `merge_scale` and the weights' normalization applied by the one final multiplication (no
negated or scaled copy of anything), an outer step of three `torch.add`s, the results written into
buffers of `buffers.POOL` (no page faults per merge), and finiteness read from one reduction over
Theta' (`torch.aminmax`: NaN and Inf survive it; b' reaches Theta' when lr > 0) instead of a boolean
tensor the size of the fragment; the final multiplication and the step of a large tensor in pieces
on threads of their own (parallel_passes.py, the same bits).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from ddiloco.synchronizer import parallel_passes, stream, update_passes
from ddiloco.synchronizer.buffers import POOL
from ddiloco.synchronizer.contribution import Contribution
from ddiloco.synchronizer.outer import OuterNesterov
from ddiloco.synchronizer.update_passes import Term
from ddiloco.wire.protocol import FragmentSpec, MergeRule

if TYPE_CHECKING:
    from ddiloco.synchronizer.config import SyncSettings
    from ddiloco.synchronizer.stream import RoundSum

Tensors = dict[str, torch.Tensor]
Weighting = Literal["tokens2_per_step", "tokens", "uniform"]

DIRECTIONS_CANCEL = 1e-6
"""||u|| (the weighted mean of unit directions, at most 1) at or below which RDA's directions
are taken to cancel and the weighted mean is used instead."""


def contribution_weight(tokens: int, steps: int, how: Weighting = "tokens2_per_step") -> float:
    """w_m = c_tokens * (c_tokens / c_steps): data behind the update times its batch size.

    A contribution with no steps weighs nothing, whatever the scheme.
    """
    if steps <= 0 or tokens <= 0:
        return 0.0
    if how == "tokens2_per_step":
        return tokens * (tokens / steps)
    if how == "tokens":
        return float(tokens)
    return 1.0


def cap_counters(tokens: int, steps: int, max_steps: int) -> tuple[int, int]:
    """Cap the steps a contribution may claim, scaling tokens alike (a partitioned learner
    cannot dominate one merge)."""
    if steps <= max_steps:
        return tokens, steps
    return round(tokens * max_steps / steps), max_steps


def relative(weights: Sequence[float], ref: float | None = None) -> tuple[list[float], float]:
    """Each weight over the first positive one (or `ref`: the one a round's sum took, which
    a learner's later update may have changed since), and their sum: the terms of a sum that
    can start before the last weight is known (stream.py sums a round's direction as its
    contributions arrive, with the same numbers in the same order)."""
    if ref is None:
        ref = next((w for w in weights if w > 0), 0.0)
    if ref <= 0.0:
        raise ValueError("merge needs at least one contribution with a positive weight")
    rel = [w / ref for w in weights]
    return rel, float(sum(rel))


def merge_fragment(
    deltas: Sequence[dict[str, Term]],
    weights: Sequence[float],
    method: MergeRule,
    granularity: Literal["tensor", "fragment"] = "tensor",
    norms: Sequence[dict[str, float] | None] | None = None,
    scale: float = 1.0,
    summed: Tensors | None = None,
    ways: int = 1,
    ref: float | None = None,
) -> Tensors:
    """Combine per-learner outer gradients of one fragment into one outer gradient, times
    `scale`: the weighted mean, or radial-directional averaging per tensor or over the
    fragment (`granularity`):

        r = sum w ||d|| / sum w;   u = sum w d/||d|| / sum w;   result = scale * r * u / ||u||

    Equal-norm inputs keep their norm whatever their number; identical directions give the
    weighted mean; where the directions cancel (||u|| ~ 0) it falls back to the mean.

    The sums (u, or the mean's) are stream.py's: `summed`, formed as the round's
    contributions arrived (consumed), its terms relative to the weight `ref`; else summed
    here by `stream.sum_terms`. `norms[i]`: the per-tensor norms of `deltas[i]` when known
    (admission's; measured here otherwise). `ways`: pieces of each pass (parallel_passes.py)."""
    names = list(deltas[0])
    known = list(norms) if norms is not None else [None] * len(deltas)
    if method != "mean":
        known = [
            k if k is not None else {n: update_passes.norm(d[n]) for n in names}
            for d, k in zip(deltas, known, strict=True)
        ]
    if summed is None:
        summed, ref = stream.sum_terms(deltas, weights, known, method, granularity, ways)
    rel, total = relative(weights, ref)
    if method == "mean":
        return {n: parallel_passes.scale_(summed[n], scale / total, ways) for n in names}
    out: Tensors = {}
    for group in [[n] for n in names] if granularity == "tensor" else [names]:
        radius = (
            sum(
                r * math.hypot(*(k[n] for n in group))  # type: ignore[index]
                for r, k in zip(rel, known, strict=True)
            )
            / total
        )
        parts = [summed[n] for n in group if n in summed]  # none: no input had a direction
        dn = math.hypot(*(float(torch.linalg.vector_norm(t)) for t in parts))  # of sum w u / w_ref
        if dn / total <= DIRECTIONS_CANCEL or dn <= stream.EPS:
            POOL.give(parts)
            some = [{n: d[n] for n in group} for d in deltas]
            out.update(merge_fragment(some, weights, "mean", scale=scale, ways=ways))
            continue
        out.update({n: parallel_passes.scale_(summed[n], scale * radius / dn, ways) for n in group})
    return out


def rda(
    deltas: Sequence[Term],
    weights: Sequence[float],
    norms: Sequence[float | None] | None = None,
    scale: float = 1.0,
    ways: int = 1,
) -> torch.Tensor:
    """Radial-directional averaging of one tensor's outer gradients (`merge_fragment`)."""
    known = [None if n is None else {"": n} for n in norms] if norms is not None else None
    return merge_fragment(
        [{"": d} for d in deltas], weights, "rda", "tensor", known, scale, ways=ways
    )[""]


def weighted_mean(
    deltas: Sequence[Term], weights: Sequence[float], scale: float = 1.0, ways: int = 1
) -> torch.Tensor:
    """scale * sum_m w_m delta_m / sum_m w_m (`merge_fragment`)."""
    return merge_fragment([{"": d} for d in deltas], weights, "mean", scale=scale, ways=ways)[""]


class NonFiniteMerge(ArithmeticError):
    """A merge whose result is not finite: it is never persisted nor served."""


@dataclass(frozen=True)
class MergeOutcome:
    params: Tensors
    momentum: Tensors
    rule: MergeRule
    contributors: int
    tokens: int
    """Tokens behind the merged contributions (uncapped: every one of them is now in Theta)."""
    staleness: int
    """Sum over contributors of (current version - base version)."""
    included: tuple[int, ...] = ()
    """Indices (into the contributions given) of those merged: the ones that weighed."""
    scale: float = 1.0
    """The factor the merged progress was multiplied by (`merge_scale = live`; else 1)."""
    streamed: bool = False
    """Whether the round's sum formed as it arrived was used (stream.py); else the merge
    summed the contributions itself (a refused merge's put back). A journal record says
    which: a replay sums the same way."""


@dataclass(frozen=True, kw_only=True)
class MergePolicy:
    """How a fragment's round becomes its next version, built from the settings."""

    rule: MergeRule = "rda"
    """The rule of every non-embedding fragment; embedding fragments take the weighted mean."""
    granularity: Literal["tensor", "fragment"] = "tensor"
    weighting: Weighting = "tokens2_per_step"
    counter_cap_steps: int = 96
    scale: Literal["contributors", "live"] = "contributors"
    outer: OuterNesterov = field(default_factory=OuterNesterov)  # outer.py
    threads: int = 1
    """Pieces a large tensor's passes are split into (parallel_passes.py; `TuningSettings.merge_threads`):
    how the merge runs, not what it computes (the same bits), so no journal record names it."""

    @classmethod
    def from_settings(cls, s: SyncSettings) -> MergePolicy:
        return cls(
            rule=s.merge,
            granularity=s.rda_granularity,
            weighting=s.weighting,
            counter_cap_steps=s.counter_cap_steps,
            scale=s.merge_scale,
            outer=OuterNesterov(lr=s.outer_lr, momentum=s.outer_momentum, nesterov=s.nesterov),
            threads=s.tuning.merge_ways(),
        )

    def weight(self, c: Contribution) -> tuple[float, int]:
        """A contribution's weight and the tokens it counts for, its counters capped."""
        tokens, steps = cap_counters(c.tokens, c.steps, self.counter_cap_steps)
        return contribution_weight(tokens, steps, self.weighting), tokens

    def rule_for(self, spec: FragmentSpec) -> MergeRule:
        return "mean" if spec.embedding else self.rule

    def merge(
        self,
        spec: FragmentSpec,
        params: Tensors,
        momentum: Tensors,
        version: int,
        contributions: Sequence[Contribution],
        live_tokens: float | None = None,
        summed: RoundSum | None = None,
    ) -> MergeOutcome | None:
        """The fragment after merging `contributions` (inputs untouched), or None when no
        contribution weighs anything. Raises `NonFiniteMerge` rather than return a result
        that is not finite everywhere.

        `live_tokens`: the (capped) tokens the whole live set hands over per period, used
        when `scale == "live"`: the merged progress is multiplied by min(1, the merged
        contributions' capped tokens / live_tokens). None or 0: no scaling.

        `summed`: the round's terms summed as they arrived (stream.py), used if they are
        exactly the terms of the contributions merged here, in order (the same bits as the
        merge's own sum unless a learner's term in it was replaced: `RoundSum.absorb`)."""
        deltas, weights, tokens, staleness, included = [], [], 0, 0, []
        norms: list[dict[str, float] | None] = []
        capped_tokens = 0
        for i, c in enumerate(contributions):
            w, tok = self.weight(c)
            if w <= 0:
                continue
            # Outer gradient Delta_m = -delta_m: the learner's own progress. For an update
            # based on the current version this is Theta_p - theta_mp exactly; for one based
            # on an older version it is the delayed pseudo-gradient (async Local-SGD), which
            # keeps the rounds merged since instead of pulling Theta back towards its base.
            # (negated in the outer step: no copy of any contribution here)
            deltas.append(c.delta)  # float32, or bf16 views of the body (update_passes.py)
            norms.append(c.norms)
            weights.append(w)
            tokens += c.tokens
            capped_tokens += tok
            staleness += version - c.base_version
            included.append(i)
        rule = self.rule_for(spec)
        given, ref = None, None
        if summed is not None:
            keys = [tuple(contributions[i].ids) for i in included]
            given = summed.claim(keys, self, rule)
            ref = summed.w_ref if given is not None else None
        if not deltas:
            return None
        scale = 1.0
        if self.scale == "live" and live_tokens:
            scale = min(1.0, capped_tokens / live_tokens)
        # The outer gradient, -scale x the merged progress: sign and scale ride on the
        # average's final multiplication (no pass over the fragment for either).
        delta = merge_fragment(
            deltas, weights, rule, self.granularity, norms, -scale, given, self.threads, ref
        )
        new_params, new_momentum, ok = self.outer.step_checked(
            params, momentum, delta, self.threads
        )
        POOL.give(delta.values())
        if not ok:
            POOL.give([*new_params.values(), *new_momentum.values()])
            raise NonFiniteMerge(f"merging fragment {spec.index} would make it non-finite")
        return MergeOutcome(
            new_params,
            new_momentum,
            rule,
            len(deltas),
            tokens,
            staleness,
            tuple(included),
            scale,
            streamed=given is not None,
        )
