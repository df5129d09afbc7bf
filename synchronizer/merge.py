"""Merge math of Decoupled DiLoCo (algorithm.md §6.3-§6.4): weights, RDA, outer Nesterov.

Pure tensor functions on fp32 CPU tensors; nothing here knows about HTTP or rounds.

    deltas  = [Theta_p - theta_mp for each contribution]          # outer gradients
    w       = contribution_weight(tokens, steps)                   # tokens^2 / steps
    delta   = rda(deltas, w)  or  weighted_mean(deltas, w)
    OuterNesterov(lr=0.7, momentum=0.9).step(Theta_p, momentum_p, delta)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Tensors = dict[str, torch.Tensor]
Weighting = Literal["tokens2_per_step", "tokens", "uniform"]

_EPS = 1e-12


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
    cannot dominate one merge; algorithm.md §7)."""
    if steps <= max_steps:
        return tokens, steps
    return round(tokens * max_steps / steps), max_steps


def _normalized(weights: Sequence[float]) -> list[float]:
    total = float(sum(weights))
    if total <= 0.0:
        raise ValueError("merge needs at least one contribution with a positive weight")
    return [w / total for w in weights]


def weighted_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_m w_m delta_m / sum_m w_m."""
    out = torch.zeros_like(deltas[0], dtype=torch.float32)
    for d, w in zip(deltas, _normalized(weights), strict=True):
        if w:
            out.add_(d.float(), alpha=w)
    return out


def rda(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Radial-directional averaging: mean length times the direction of the mean direction.

        r = sum w ||d|| / sum w;   u = sum w d/||d|| / sum w;   result = r * u / ||u||

    Equal-norm inputs keep their norm whatever their number; identical directions give
    the weighted mean. If the directions cancel (||u|| ~ 0) it falls back to the mean.
    """
    ws = _normalized(weights)
    radius = 0.0
    direction = torch.zeros_like(deltas[0], dtype=torch.float32)
    for d, w in zip(deltas, ws, strict=True):
        if not w:
            continue
        d32 = d.float()
        n = float(torch.linalg.vector_norm(d32))
        radius += w * n
        if n > _EPS:
            direction.add_(d32, alpha=w / n)
    dn = float(torch.linalg.vector_norm(direction))
    if dn <= 1e-6 * max(radius, _EPS) or dn <= _EPS:
        return weighted_mean(deltas, weights)
    return direction.mul_(radius / dn)


def merge_fragment(
    deltas: Sequence[Tensors],
    weights: Sequence[float],
    method: Literal["rda", "avg"],
    granularity: Literal["tensor", "fragment"] = "tensor",
) -> Tensors:
    """Combine per-learner outer gradients of one fragment into one outer gradient."""
    names = list(deltas[0])
    if method == "avg":
        return {n: weighted_mean([d[n] for d in deltas], weights) for n in names}
    if granularity == "tensor":
        return {n: rda([d[n] for d in deltas], weights) for n in names}
    # Whole-fragment RDA: flatten every contribution, merge once, split back.
    flat = [torch.cat([d[n].float().reshape(-1) for n in names]) for d in deltas]
    merged = rda(flat, weights)
    out: Tensors = {}
    offset = 0
    for n in names:
        numel = deltas[0][n].numel()
        out[n] = merged[offset : offset + numel].view_as(deltas[0][n]).clone()
        offset += numel
    return out


@dataclass(frozen=True, kw_only=True)
class OuterNesterov:
    """SGD with (Nesterov) momentum on the global fragment, one buffer per fragment (§6.4).

        b = mu * b + delta
        Theta = Theta - lr * (delta + mu * b)    (Nesterov)
        Theta = Theta - lr * b                   (heavy ball)

    lr=1, momentum=0 is plain averaging of the learners' fragments.
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def step(self, params: Tensors, buffers: Tensors, delta: Tensors) -> None:
        for name, p in params.items():
            d = delta[name]
            b = buffers[name]
            b.mul_(self.momentum).add_(d)
            if self.nesterov:
                p.sub_(d + self.momentum * b, alpha=self.lr)
            else:
                p.sub_(b, alpha=self.lr)
