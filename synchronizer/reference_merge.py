"""The merge of one round written as the method states it: the reference the synchronizer's
fast path (stream.py, merge.py, outer.py) is tested against (tests/unit/test_reference_merge.py).

Whole tensors, float64, no buffer pools, no pre-summed terms, no pieces. The equations are
those of the method's description (algorithm.md of the design notes; Douillard et al.,
arXiv 2604.21428), numbered here as cited in the code:

    (1) Delta_m = -delta_m                           outer gradient: the learner's progress
                                                     since its previous hand-over (§5, §6.3)
    (2) w_m = c_tokens^2 / c_steps                   token weight (§6.3), counters capped at
                                                     `counter_cap_steps`, tokens alike (§7)
    (3) r = sum w ||Delta|| / sum w                  RDA's mean length (§6.3)
    (4) d = sum w u(Delta) / sum w,  u(x) = x/||x||  RDA's mean direction, u(0) = 0 (§6.3)
    (5) RDA = r u(d), or (6) where ||d|| ~ 0         per tensor, or over the fragment (§6.3)
    (6) Delta = sum w Delta_m / sum w                direct average: embedding fragments,
                                                     and the `mean` rule (§6.3)
    (7) Delta *= min(1, tokens / live_tokens)        `merge_scale = live` (docs/design.md,
                                                     "The merge scale"); else 1
    (8) b' = mu b + Delta                            outer Nesterov step (§6.4)
    (9) Theta' = Theta - eta (Delta + mu b')         (heavy ball: Theta - eta b')
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DIRECTIONS_CANCEL", "Update", "reference_merge"]

Tensors = dict[str, torch.Tensor]

DIRECTIONS_CANCEL = 1e-6
"""||d|| at or below which the directions are taken to cancel, and (6) replaces (5)."""


@dataclass(frozen=True)
class Update:
    """One learner's contribution to the round: its progress delta_m (every update it sent
    in the round, summed) and the counters behind it."""

    delta: Tensors
    tokens: int
    steps: int


def weight(u: Update, how: str, cap: int) -> tuple[float, int]:
    """(2), and the capped tokens: (weight, tokens)."""
    tokens, steps = u.tokens, u.steps
    if steps > cap:
        tokens, steps = round(tokens * cap / steps), cap
    if steps <= 0 or tokens <= 0:
        return 0.0, 0
    w = {"tokens2_per_step": tokens * tokens / steps, "tokens": tokens, "uniform": 1}[how]
    return float(w), tokens


def unit(x: torch.Tensor) -> torch.Tensor:
    n = torch.linalg.vector_norm(x)
    return x / n if n > 0 else torch.zeros_like(x)


def average(xs: list[torch.Tensor], w: list[float]) -> torch.Tensor:
    """(6)."""
    return sum(wm * x for wm, x in zip(w, xs, strict=True)) / sum(w)


def rda(xs: list[torch.Tensor], w: list[float]) -> torch.Tensor:
    """(3), (4), (5)."""
    r = sum(wm * torch.linalg.vector_norm(x) for wm, x in zip(w, xs, strict=True)) / sum(w)
    d = average([unit(x) for x in xs], w)
    if torch.linalg.vector_norm(d) <= DIRECTIONS_CANCEL:
        return average(xs, w)
    return r * unit(d)


def reference_merge(
    theta: Tensors,
    momentum: Tensors,
    updates: list[Update],
    *,
    rule: str = "rda",
    embedding: bool = False,
    granularity: str = "tensor",
    weighting: str = "tokens2_per_step",
    counter_cap_steps: int = 96,
    live_tokens: float | None = None,
    lr: float = 0.7,
    mu: float = 0.9,
    nesterov: bool = True,
) -> tuple[Tensors, Tensors] | None:
    """(Theta', b') of a fragment after one round, in float64; None if no update weighs."""
    weighed = [(u, *weight(u, weighting, counter_cap_steps)) for u in updates]
    weighed = [(u, w, tok) for u, w, tok in weighed if w > 0]
    if not weighed:
        return None
    w = [wm for _, wm, _ in weighed]
    outer = [{k: -v.double() for k, v in u.delta.items()} for u, _, _ in weighed]  # (1)
    names = list(theta)
    if rule == "mean" or embedding:
        delta = {k: average([o[k] for o in outer], w) for k in names}
    elif granularity == "tensor":
        delta = {k: rda([o[k] for o in outer], w) for k in names}
    else:  # one RDA over the whole fragment, flat, cut back into its tensors
        flat = rda([torch.cat([o[k].reshape(-1) for k in names]) for o in outer], w)
        sizes = [theta[k].numel() for k in names]
        delta = {k: p.view(theta[k].shape) for k, p in zip(names, flat.split(sizes), strict=True)}
    if live_tokens:  # (7)
        scale = min(1.0, sum(tok for _, _, tok in weighed) / live_tokens)
        delta = {k: scale * v for k, v in delta.items()}
    new_theta, new_b = {}, {}
    for k in names:
        b = mu * momentum[k].double() + delta[k]  # (8)
        step = delta[k] + mu * b if nesterov else b
        new_theta[k], new_b[k] = theta[k].double() - lr * step, b  # (9)
    return new_theta, new_b
