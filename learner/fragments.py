"""Fragments: how the parameters split into P pieces, and when each piece is first due.

    layout = partition(model.named_parameters(), num_fragments=4, embedding={"wte.weight"})
    Schedule(h=24, num_fragments=4).offset(p)   # step of p's first hand-over (0 means H)

Partition (the paper's balanced tensor fragmentation). Embedding tensors form
their own fragment(s), merged by plain averaging; every other tensor, largest first, goes
whole into the fragment with the smallest running size, ties broken by name then index,
so every learner computes the identical layout.

Schedule: fragment p is first due at o_p = p*H/P (H for p = 0), so the fragments are spread
H/P steps apart; after that the learner hands p over H steps after its previous hand-over
of p, or earlier to answer a round's request (learner/diloco.py). Steps count from 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ddiloco.wire.protocol import FragmentSpec, Layout, TensorSpec

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def partition(
    named_params: Iterable[tuple[str, torch.Tensor]],
    num_fragments: int,
    embedding: set[str] | None = None,
) -> Layout:
    """Balanced tensor fragmentation into `num_fragments` fragments (see module docstring)."""
    params = [(n, p) for n, p in named_params if p.requires_grad]
    if num_fragments < 1:
        raise ValueError(f"num_fragments (P) must be >= 1, got {num_fragments}")
    embedding = embedding or set()
    emb = sorted((n, p) for n, p in params if n in embedding)
    rest = [(n, p) for n, p in params if n not in embedding]
    n_emb_frags = 1 if emb and num_fragments > 1 else 0
    n_rest = num_fragments - n_emb_frags
    if len(rest) < n_rest:
        raise ValueError(
            f"P={num_fragments} fragments but only {len(rest)} non-embedding tensors to spread"
        )
    bins: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(n_rest)]
    sizes = [0] * n_rest
    for name, p in sorted(rest, key=lambda np_: (-np_[1].numel(), np_[0])):
        target = min(range(n_rest), key=lambda i: (sizes[i], i))
        bins[target].append((name, p))
        sizes[target] += p.numel()
    frags: list[FragmentSpec] = []
    groups = ([(True, emb)] if n_emb_frags else []) + [(False, b) for b in bins]
    if not n_emb_frags and emb:  # P == 1: everything in one fragment
        groups = [(False, emb + bins[0])]
    for i, (is_embedding, members) in enumerate(groups):
        tensors = [
            TensorSpec(name=n, shape=list(p.shape), dtype=DTYPE_NAMES.get(p.dtype, "float32"))
            for n, p in sorted(members, key=lambda np_: np_[0])
        ]
        frags.append(FragmentSpec(index=i, embedding=is_embedding, tensors=tensors))
    return Layout(fragments=frags)


@dataclass(frozen=True)
class Schedule:
    """Where each fragment's hand-overs start: offsets p*H/P, spread evenly over H."""

    h: int
    num_fragments: int

    def __post_init__(self) -> None:
        if self.h < 1:
            raise ValueError(f"H must be >= 1, got {self.h}")
        if self.num_fragments < 1 or self.num_fragments > self.h:
            raise ValueError(f"P must be in 1..H (H={self.h}), got {self.num_fragments}")

    def offset(self, p: int) -> int:
        return (p * self.h) // self.num_fragments
