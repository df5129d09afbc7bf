"""Balanced tensor partition and the fragment schedule.

pytest tests/unit/test_fragments.py
"""

from __future__ import annotations

import pytest
import torch

from ddiloco.learner.fragments import Schedule, partition
from ddiloco.learner.model import build_model, is_embedding_param


def params(sizes: dict[str, int]) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in sizes.items()]


def test_partition_is_balanced_and_deterministic() -> None:
    sizes = {"a": 100, "b": 90, "c": 50, "d": 40, "e": 10, "f": 10}
    layout = partition(params(sizes), 2)
    again = partition(reversed(params(sizes)), 2)  # order of the model does not matter
    assert layout == again
    totals = [f.numel() for f in layout.fragments]
    assert sorted(totals) == [150, 150]
    assert sorted(t.name for f in layout.fragments for t in f.tensors) == sorted(sizes)


def test_ties_break_by_name() -> None:
    layout = partition(params({"z": 5, "y": 5, "x": 5, "w": 5}), 2)
    assert [[t.name for t in f.tensors] for f in layout.fragments] == [["w", "y"], ["x", "z"]]


def test_embeddings_get_their_own_averaged_fragment() -> None:
    model = build_model("tiny")
    named = list(model.named_parameters())
    emb = {n for n, _ in named if is_embedding_param(n)}
    layout = partition(named, 4, emb)
    assert layout.fragments[0].embedding
    assert {t.name for t in layout.fragments[0].tensors} == emb
    assert not any(f.embedding for f in layout.fragments[1:])
    assert len(layout.fragments) == 4
    assert layout.digest() == partition(build_model("tiny").named_parameters(), 4, emb).digest()


def test_too_many_fragments_is_refused() -> None:
    with pytest.raises(ValueError, match="P=5"):
        partition(params({"a": 1, "b": 1}), 5)


def test_schedule_spreads_fragments_evenly() -> None:
    s = Schedule(h=24, num_fragments=4)
    assert [s.offset(p) for p in range(4)] == [0, 6, 12, 18]
    with pytest.raises(ValueError, match=r"P must be in 1\.\.H"):
        Schedule(h=4, num_fragments=5)
