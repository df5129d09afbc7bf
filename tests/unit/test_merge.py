"""Merge math: RDA, weighted mean, weights, outer Nesterov.

pytest tests/unit/test_merge.py
"""

from __future__ import annotations

import math

import pytest
import torch

from ddiloco.synchronizer.merge import (
    OuterNesterov,
    cap_counters,
    contribution_weight,
    merge_fragment,
    rda,
    weighted_mean,
)


def random_unit_norm(m: int, dim: int, norm: float, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(dim, generator=g) for _ in range(m)]
    return [x * (norm / x.norm()) for x in xs]


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 64])
def test_rda_keeps_the_norm_of_equal_norm_inputs_whatever_m(m: int) -> None:
    deltas = random_unit_norm(m, 4096, norm=3.0, seed=m)
    out = rda(deltas, [1.0] * m)
    assert out.norm().item() == pytest.approx(3.0, rel=1e-5)
    # the plain mean shrinks like 1/sqrt(M) for near-orthogonal inputs: RDA does not
    if m >= 4:
        assert weighted_mean(deltas, [1.0] * m).norm().item() < 3.0 * 2.0 / math.sqrt(m)


@pytest.mark.parametrize("norm", [1e-4, 1.0, 1e7])
def test_rda_keeps_the_norm_whatever_the_scale_of_the_inputs(norm: float) -> None:
    """Whether the directions cancel is read from the mean direction alone (at most 1),
    not from the inputs' scale: large inputs are no more often averaged plainly."""
    deltas = random_unit_norm(4, 4096, norm=norm, seed=5)
    assert rda(deltas, [1.0] * 4).norm().item() == pytest.approx(norm, rel=1e-5)


def test_rda_of_identical_directions_is_the_weighted_mean() -> None:
    u = torch.tensor([3.0, 4.0])
    deltas = [u * 0.5, u * 2.0, u * 1.0]
    weights = [1.0, 2.0, 5.0]
    expected = (0.5 * 1 + 2.0 * 2 + 1.0 * 5) / 8 * u
    assert torch.allclose(rda(deltas, weights), expected, atol=1e-6)
    assert torch.allclose(weighted_mean(deltas, weights), expected, atol=1e-6)


def test_zero_weight_inputs_change_nothing() -> None:
    a, b = random_unit_norm(2, 64, 1.0, seed=3)
    junk = torch.full((64,), 1e6)
    assert torch.allclose(rda([a, b, junk], [1.0, 3.0, 0.0]), rda([a, b], [1.0, 3.0]))
    assert torch.allclose(weighted_mean([a, junk], [2.0, 0.0]), a)


def test_rda_falls_back_to_the_mean_when_directions_cancel() -> None:
    x = torch.tensor([1.0, 0.0])
    out = rda([x, -x], [1.0, 1.0])
    assert torch.allclose(out, torch.zeros(2))


def test_merge_needs_a_positive_weight() -> None:
    with pytest.raises(ValueError, match="positive weight"):
        rda([torch.ones(2)], [0.0])


def test_weights_are_tokens_squared_over_steps() -> None:
    assert contribution_weight(tokens=1000, steps=10) == pytest.approx(100_000.0)
    # same tokens, half the batch per step (lost hardware): half the weight
    assert contribution_weight(1000, 20) == pytest.approx(contribution_weight(1000, 10) / 2)
    assert contribution_weight(1000, 0) == 0.0
    assert contribution_weight(0, 5) == 0.0
    assert contribution_weight(1000, 10, "tokens") == 1000.0
    assert contribution_weight(1000, 10, "uniform") == 1.0


def test_counter_cap_scales_tokens_with_steps() -> None:
    assert cap_counters(tokens=960, steps=120, max_steps=96) == (768, 96)
    assert cap_counters(tokens=80, steps=10, max_steps=96) == (80, 10)


def test_outer_nesterov_matches_hand_computed_values() -> None:
    theta = {"w": torch.tensor([1.0, 2.0])}
    buf = {"w": torch.zeros(2)}
    opt = OuterNesterov(lr=0.5, momentum=0.9, nesterov=True)
    opt.step(theta, buf, {"w": torch.tensor([0.2, -0.4])})
    # b = 0.2,-0.4 ; theta = theta - 0.5*(delta + 0.9*b) = 1 - 0.5*0.38, 2 - 0.5*(-0.76)
    assert torch.allclose(buf["w"], torch.tensor([0.2, -0.4]))
    assert torch.allclose(theta["w"], torch.tensor([0.81, 2.38]))
    opt.step(theta, buf, {"w": torch.tensor([0.1, 0.1])})
    # b = 0.9*[0.2,-0.4] + 0.1 = [0.28, -0.26]; step = 0.5*([0.1,0.1] + 0.9*b)
    assert torch.allclose(buf["w"], torch.tensor([0.28, -0.26]))
    assert torch.allclose(
        theta["w"], torch.tensor([0.81 - 0.5 * (0.1 + 0.252), 2.38 - 0.5 * (0.1 - 0.234)])
    )


def test_heavy_ball_and_pure_averaging_controls() -> None:
    theta = {"w": torch.tensor([1.0])}
    buf = {"w": torch.tensor([1.0])}
    OuterNesterov(lr=0.1, momentum=0.5, nesterov=False).step(theta, buf, {"w": torch.tensor([2.0])})
    assert buf["w"].item() == pytest.approx(2.5)
    assert theta["w"].item() == pytest.approx(0.75)
    # lr 1, momentum 0: the new global value is the learners' weighted average
    glob = torch.tensor([1.0, 1.0])
    locals_ = [torch.tensor([0.0, 2.0]), torch.tensor([2.0, 4.0])]
    deltas = [{"w": glob - x} for x in locals_]
    merged = merge_fragment(deltas, [1.0, 3.0], "mean")
    theta = {"w": glob.clone()}
    OuterNesterov(lr=1.0, momentum=0.0).step(theta, {"w": torch.zeros(2)}, merged)
    assert torch.allclose(theta["w"], (locals_[0] * 1 + locals_[1] * 3) / 4)


def test_fragment_granularity_switch() -> None:
    d1 = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.0])}
    d2 = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([1.0])}
    per_tensor = merge_fragment([d1, d2], [1.0, 1.0], "rda", "tensor")
    whole = merge_fragment([d1, d2], [1.0, 1.0], "rda", "fragment")
    # per tensor, "a" keeps the mean length of its inputs (0.5); over the fragment both
    # inputs have norm 1 and orthogonal directions: the result has norm 1
    assert per_tensor["a"].norm().item() == pytest.approx(0.5)
    flat = torch.cat([whole["a"], whole["b"]])
    assert flat.norm().item() == pytest.approx(1.0, rel=1e-6)
    assert whole["a"].shape == (2,) and whole["b"].shape == (1,)


def test_rda_uses_the_norms_admission_measured() -> None:
    """The merge reuses each single-update contribution's norms (no second pass): the result
    is the same bits as measuring them again, and a norm given is really the one used."""
    g = torch.Generator().manual_seed(3)
    deltas = [torch.randn(1000, generator=g) * s for s in (1.0, 2.0, 0.5)]
    measured = [float(torch.linalg.vector_norm(d)) for d in deltas]
    assert torch.equal(rda(deltas, [1.0, 2.0, 3.0], measured), rda(deltas, [1.0, 2.0, 3.0]))
    assert torch.equal(
        rda(deltas, [1.0, 2.0, 3.0], [None, *measured[1:]]), rda(deltas, [1.0, 2.0, 3.0])
    )
    doubled = rda(deltas, [1.0, 2.0, 3.0], [2 * n for n in measured])
    assert not torch.allclose(doubled, rda(deltas, [1.0, 2.0, 3.0]))
    d = {"a": deltas[0], "b": deltas[1]}
    norms = {"a": measured[0], "b": measured[1]}
    once = merge_fragment([d, d], [1.0, 1.0], "rda", "tensor", [norms, None])
    again = merge_fragment([d, d], [1.0, 1.0], "rda", "tensor")
    assert all(torch.equal(once[k], again[k]) for k in d)
