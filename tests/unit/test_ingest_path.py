"""The fast update path (issue 15): decode into pooled float32, merge into pooled buffers.

    pytest tests/unit/test_ingest_path.py

Each fast function must give what the plain one gave: `decode_float32` what `decode` then
`.float()` gives, `encode` a payload safetensors reads back as it was, `step_into` what
`step` does on copies, `finite` what `isfinite(...).all()` says.
"""

from __future__ import annotations

import ctypes
import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load

from ddiloco.synchronizer import codec
from ddiloco.synchronizer.buffers import ALIGN, BytePool, Float32Pool, aligned
from ddiloco.synchronizer.errors import PayloadError
from ddiloco.synchronizer.merge import OuterNesterov, finite


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b": torch.randn(7, generator=g),
        "c": torch.randn(2, 2, generator=g).half(),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(1.5),
    }


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_decode_float32_equals_decode_then_float(kind: type) -> None:
    x = tensors()
    payload = codec.encode(x, {"k": "v"})
    got = codec.decode_float32(kind(payload))
    assert set(got) == set(x)
    for name, t in x.items():
        assert got[name].dtype == torch.float32 and got[name].shape == t.shape
        assert torch.equal(got[name], t.float()), name


def test_decode_float32_reads_a_body_at_any_offset_and_never_writes_it() -> None:
    header = json.dumps({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}}).encode()
    header += b" " * (1 - len(header) % 2)  # odd length: the data starts at an odd offset
    raw = torch.tensor([1.0, -2.0, 3.0]).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    body = bytearray(struct.pack("<Q", len(header)) + header + raw)
    before = bytes(body)
    out = codec.decode_float32(body)
    assert out["w"].tolist() == [1.0, -2.0, 3.0]
    out["w"].add_(1.0)  # the result is its own memory, not the body's
    assert bytes(body) == before


def test_decode_float32_refuses_integer_tensors() -> None:
    payload = codec.encode({"q": torch.zeros(4, dtype=torch.int8)})
    with pytest.raises(PayloadError, match="not a float tensor"):
        codec.decode_float32(payload, codec.read_header(payload, codes=True))


def test_encode_is_safetensors_the_library_reads_back() -> None:
    x = {**tensors(), "i": torch.arange(6, dtype=torch.int8), "u": torch.arange(3).to(torch.uint8)}
    back = st_load(codec.encode(x, {"m": "1"}))
    assert set(back) == set(x)
    for name, t in x.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert codec.read_header(codec.encode(x, {"m": "1"}), codes=True).metadata == {"m": "1"}


def test_pool_reuses_what_it_made_and_ignores_the_rest() -> None:
    pool = Float32Pool()
    a = pool.take((4, 4))
    ptr = a.data_ptr()
    pool.give([a])
    b = pool.take((4, 4))
    assert b.data_ptr() == ptr  # the same memory again
    foreign = torch.zeros(4, 4)
    pool.give([foreign, b.to(torch.float64)])  # not the pool's: left alone
    assert pool.take((4, 4)).data_ptr() not in (ptr, foreign.data_ptr())
    pool.give([b, b])  # twice: kept once
    assert pool.idle_bytes == 64


def test_pool_keeps_at_most_max_bytes_idle() -> None:
    pool = Float32Pool(max_bytes=100)
    ts = [pool.take((5,)) for _ in range(10)]
    pool.give(ts)
    assert pool.idle_bytes <= 100


def test_byte_pool_hands_a_given_buffer_to_the_next_body_of_its_capacity() -> None:
    pool = BytePool(max_bytes=8 << 20, grain=1 << 20)
    a = pool.take(3_000_000)
    assert len(a) == 3_000_000 and len(a.obj) == 3 << 20  # whole grains
    a[:4] = b"body"
    pool.give(a)
    b = pool.take(2_200_000)  # another header length, the same capacity: the same buffer
    assert b.obj is a.obj and len(b) == 2_200_000
    c = pool.take(2_200_000)  # the first is out again: a fresh one
    assert c.obj is not b.obj
    pool.give(memoryview(bytearray(3 << 20)))  # not the pool's: left alone
    assert pool.idle_bytes == 0
    small = pool.take(100)  # under a grain: not pooled
    pool.give(small)
    assert pool.idle_bytes == 0
    pool.give(b)
    pool.give(c)
    assert pool.idle_bytes == 6 << 20
    pool.give(b)  # given twice: counted once
    assert pool.idle_bytes == 6 << 20


def test_byte_pool_keeps_at_most_max_bytes_idle() -> None:
    pool = BytePool(max_bytes=4 << 20, grain=1 << 20)
    views = [pool.take(3 << 20) for _ in range(2)]  # 3 MiB and the header block: 4 MiB each
    for v in views:
        pool.give(v)
    assert pool.idle_bytes == 4 << 20


@pytest.mark.parametrize("size", [1, 100, 4096, 5000, (1 << 20) - 1, 3_000_000])
def test_a_body_sits_one_block_into_a_page_aligned_buffer_with_room_for_its_frame(
    size: int,
) -> None:
    pool = BytePool(grain=1 << 20)
    body = pool.take(size)
    body[:] = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    frame = pool.frame(body)
    assert frame is not None
    address = ctypes.addressof(ctypes.c_char.from_buffer(frame))
    assert address % ALIGN == 0 and len(frame) % ALIGN == 0  # what O_DIRECT needs
    assert len(frame) == ALIGN + aligned(size)
    assert frame[ALIGN : ALIGN + size] == body  # the body itself, not a copy
    body[0] ^= 0xFF
    assert frame[ALIGN] == body[0]
    assert pool.frame(memoryview(bytearray(size))) is None  # not the pool's
    assert pool.frame(bytes(size)) is None
    pool.give(body)
    assert pool.frame(body) is None  # given back: no longer the caller's to frame


@pytest.mark.parametrize("nesterov", [True, False])
def test_step_into_is_step_on_copies(nesterov: bool) -> None:
    g = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(64, generator=g), "v": torch.randn(3, 3, generator=g)}
    momentum = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    delta = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    opt = OuterNesterov(lr=0.7, momentum=0.9, nesterov=nesterov)
    want_p = {k: v.clone() for k, v in params.items()}
    want_b = {k: v.clone() for k, v in momentum.items()}
    opt.step(want_p, want_b, delta)
    keep = [{k: v.clone() for k, v in x.items()} for x in (params, momentum, delta)]
    got_p, got_b = opt.step_into(params, momentum, delta)
    for k in params:
        assert torch.allclose(got_p[k], want_p[k], atol=1e-6)
        assert torch.allclose(got_b[k], want_b[k], atol=1e-6)
        for before, now in zip(keep, (params, momentum, delta), strict=True):
            assert torch.equal(now[k], before[k])  # inputs are only read


@pytest.mark.parametrize("lr", [0.7, 0.0])
def test_finite_after_sees_a_non_finite_momentum(lr: float) -> None:
    """With lr > 0 a non-finite b' always reaches Theta' (one pass checks both); with lr = 0
    Theta' stays as it was, so b' is checked on its own."""
    opt = OuterNesterov(lr=lr, momentum=0.9)
    params = {"w": torch.ones(8)}
    for bad in (float("nan"), float("inf")):
        delta = {"w": torch.zeros(8)}
        delta["w"][3] = bad
        got_p, got_b = opt.step_into(params, {"w": torch.zeros(8)}, delta)
        assert not finite(got_b["w"])
        assert not opt.finite_after(got_p, got_b)
    fine_p, fine_b = opt.step_into(params, {"w": torch.zeros(8)}, {"w": torch.ones(8)})
    assert opt.finite_after(fine_p, fine_b)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_finite_sees_any_nan_or_inf(bad: float) -> None:
    t = torch.randn(1000)
    assert finite(t) and finite(torch.zeros(0))
    t[617] = bad
    assert not finite(t)
