"""Blockwise absmax int8/int4 quantization (wire/quant.py): a round trip is within half a
scale per value and each block's largest value is exact; int4 codes pack two to a byte;
non-finite input and forged codes or scales are refused. The learner's error feedback (its
anchor moves by what the synchronizer decodes) is tested in test_wire.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from ddiloco.wire.quant import dequantize, quantize

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
