"""Blockwise absmax int8/int4 quantization and the learner's error feedback (wire/quant.py).

The property: over many hand-overs of one fragment, what the synchronizer received (the sum of
the dequantized updates) converges to what the learner meant to send (the sum of its deltas):
the gap is the last residual alone, at most half a scale per value, however many hand-overs.
Without error feedback the same stream drifts (the test shows both, so it could fail).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddiloco.wire.quant import QMAX, ErrorFeedback, dequantize, quantize

ENCODINGS = ("int8", "int4")


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("shape", [(1,), (7,), (128,), (3, 129), (2, 3, 64)])
def test_round_trip_is_within_half_a_scale(encoding: str, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * 3
    q = quantize(x, encoding, block=16)  # type: ignore[arg-type]
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == torch.float32
    per_value = q.scales.repeat_interleave(16)[: x.numel()].view(shape)
    assert bool(((y - x).abs() <= per_value / 2 + 1e-6).all())
    # each block's largest magnitude is exact: its code is +-qmax
    assert (y.abs().max() - x.abs().max()).abs().item() < 1e-5


def test_sizes_and_packing() -> None:
    x = torch.arange(-7.0, 8.0).repeat(20)[:256]
    q8, q4 = quantize(x, "int8", 128), quantize(x, "int4", 128)
    assert q8.codes.dtype == torch.int8 and q8.codes.numel() == 256
    assert q4.codes.dtype == torch.uint8 and q4.codes.numel() == 128  # two per byte
    assert q4.nbytes == 128 + 2 * 4 and q8.nbytes == 256 + 2 * 4
    assert torch.equal(dequantize(q4), x)  # integers up to qmax with absmax 7: exact


def test_zeros_and_refusals() -> None:
    assert torch.equal(dequantize(quantize(torch.zeros(10), "int4", 4)), torch.zeros(10))
    with pytest.raises(ValueError, match="non-finite"):
        quantize(torch.tensor([1.0, math.inf]), "int8")
    with pytest.raises(ValueError, match="unknown encoding"):
        quantize(torch.ones(2), "int2")  # type: ignore[arg-type]
    q = quantize(torch.ones(8), "int4", 8)
    bad = type(q)(q.encoding, q.shape, q.block, torch.full_like(q.codes, 0xFF), q.scales)
    with pytest.raises(ValueError, match="out of range"):
        dequantize(bad)  # nibble 15 is no code: a forged payload, not a value
    neg = type(q)(q.encoding, q.shape, q.block, q.codes, -q.scales)
    with pytest.raises(ValueError, match="non-negative"):
        dequantize(neg)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    encoding=st.sampled_from(ENCODINGS),
    n=st.integers(1, 300),
    block=st.sampled_from([2, 8, 32, 128]),
    rounds=st.integers(20, 120),
    seed=st.integers(0, 2**31 - 1),
    bias=st.floats(-1.0, 1.0),
)
def test_error_feedback_converges_to_the_full_precision_sum(
    encoding: str, n: int, block: int, rounds: int, seed: int, bias: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    ef = ErrorFeedback(encoding, block)  # type: ignore[arg-type]
    meant = torch.zeros(n, dtype=torch.float64)
    sent = torch.zeros(n, dtype=torch.float64)
    last_scale = torch.zeros(n)
    for _ in range(rounds):
        # small values with a steady bias beside a few large ones: the case where plain
        # quantization rounds the small ones to zero every time and so loses them for good
        delta = torch.randn(n, generator=g) * 1e-3 + bias * 1e-3
        delta[0] = 1.0
        meant += delta.double()
        q = ef.encode("f0", delta)
        sent += dequantize(q).double()
        last_scale = q.scales.repeat_interleave(block)[:n]
    gap = (meant - sent).abs()
    assert bool((gap <= last_scale.double() / 2 + 1e-5).all()), gap.max().item()
    # what is left is one residual, not `rounds` of them
    assert torch.allclose((meant - sent).float(), ef.residual["f0"], atol=1e-4)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_without_error_feedback_small_values_are_lost(encoding: str) -> None:
    """The contrast that makes the property test mean something: plain quantization of the
    same stream rounds a block's small steady values to zero every time, for good."""
    ef = ErrorFeedback(encoding, 8)  # type: ignore[arg-type]
    delta = torch.full((8,), 1e-3)
    delta[0] = 1.0
    meant, sent, plain = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    for _ in range(400):
        meant += delta
        sent += dequantize(ef.encode("f", delta))
        plain += dequantize(quantize(delta, encoding, 8))  # type: ignore[arg-type]
    assert plain[1:].abs().max().item() == 0.0  # every small value rounded away, 400 times
    assert (meant - sent)[1:].abs().max().item() <= 1.0 / QMAX[encoding] / 2 + 1e-5
    assert sent[1:].min().item() > 0.5 * meant[1].item()


def test_error_feedback_keys_are_independent_and_droppable() -> None:
    ef = ErrorFeedback("int4", 4)
    ef.encode("a", torch.tensor([1.0, 0.1, 0.0, 0.0]))
    ef.encode("b", torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert ef.residual["a"][1].abs().item() > 0 and ef.residual["b"].abs().sum().item() == 0
    ef.drop("a")
    assert "a" not in ef.residual
    assert QMAX == {"int8": 127, "int4": 7}
