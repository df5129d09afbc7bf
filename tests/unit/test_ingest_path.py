"""The fast update path: decode into pooled float32, merge into pooled buffers.

    pytest tests/unit/test_ingest_path.py

Each fast function must give what the plain one gave: the passes over views of a body in
its own dtype (update_passes.py) what float32 copies give, `encode` a payload safetensors reads back as it was, `step_into` what
`step` does on copies, `finite` what `isfinite(...).all()` says.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load

from ddiloco.synchronizer import update_passes
from ddiloco.synchronizer.buffers import ALIGN, BODIES, BytePool, Float32Pool, aligned
from ddiloco.synchronizer.outer import OuterNesterov, finite
from ddiloco.synchronizer.served_buffers import Served
from ddiloco.wire import codec
from tests.unit.test_contract import A, B, Clock, make, served, start, update


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
def test_passes_over_views_of_the_body_give_the_float32_math(kind: type) -> None:
    """What admission and the merge compute from views of the body in the wire's dtype is
    what they computed from float32 copies: the same sums to the bit, norms within 1e-4."""
    x = tensors()
    payload = kind(codec.encode(x, {"k": "v"}))
    views = codec.tensor_views(payload, codec.read_header(payload))
    assert set(views) == set(x)
    g = torch.Generator().manual_seed(9)
    for name, t in x.items():
        v = views[name]
        assert v.dtype == t.dtype and v.shape == t.shape
        want = float(torch.linalg.vector_norm(t.double()))
        assert update_passes.norm(v) == pytest.approx(want, rel=1e-4, abs=1e-30), name
        acc = torch.randn(t.shape, generator=g)
        expect = acc.clone().add_(t.float(), alpha=0.37)  # the old path: a float32 copy
        update_passes.axpy(acc, v, 0.37)
        assert torch.equal(acc, expect), name
        out = torch.empty(t.shape)
        update_passes.scale_into(out, v, -1.5)
        assert torch.equal(out, t.float() * -1.5), name


@pytest.mark.parametrize(
    "n",
    [
        1,
        4095,
        update_passes.CHUNK + 3,
        2 * update_passes.CHUNK,
        update_passes.BMM_MIN,
        update_passes.BMM_MIN + 4101,
    ],
)
def test_bf16_passes_cross_block_and_chunk_edges(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    t = torch.randn(n, generator=g).to(torch.bfloat16)
    want = float(torch.linalg.vector_norm(t.double()))
    assert update_passes.norm(t) == pytest.approx(want, rel=1e-4)
    acc = torch.randn(n, generator=g)
    expect = acc.clone().add_(t.float(), alpha=0.25)
    update_passes.axpy(acc, t, 0.25)
    assert torch.equal(acc, expect)
    out = torch.full((n,), float("nan"))  # every value written
    update_passes.scale_into(out, t, 2.0)
    assert torch.equal(out, 2.0 * t.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_norm_over_a_non_finite_value_is_not_finite(dtype: torch.dtype, bad: float) -> None:
    t = torch.ones(update_passes.BMM_MIN + 7, dtype=dtype)
    t[5000] = bad
    assert not math.isfinite(update_passes.norm(t))
    t = torch.ones(10, dtype=dtype)  # under a block: the tail's dot
    t[3] = bad
    assert not math.isfinite(update_passes.norm(t))


def test_a_bf16_norm_that_overflows_float32_is_not_finite() -> None:
    for n in (8192, update_passes.BMM_MIN):
        t = torch.full((n,), 3e38).to(torch.bfloat16)
        assert not math.isfinite(update_passes.norm(t))


def test_views_read_a_body_at_any_offset_and_never_write_it() -> None:
    header = json.dumps({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}}).encode()
    header += b" " * (1 - len(header) % 2)  # odd length: the data starts at an odd offset
    raw = torch.tensor([1.0, -2.0, 3.0]).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    body = bytearray(struct.pack("<Q", len(header)) + header + raw)
    before = bytes(body)
    v = codec.tensor_views(body, codec.read_header(body))["w"]
    out = torch.empty(3)
    update_passes.scale_into(out, v, 1.0)
    assert out.tolist() == [1.0, -2.0, 3.0]
    update_passes.axpy(out, v, 1.0)
    assert out.tolist() == [2.0, -4.0, 6.0]
    assert bytes(body) == before


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


def test_a_full_byte_pool_lets_go_of_its_longest_idle_buffer_not_the_one_given_back() -> None:
    """Primed bodies of a size nobody sends must not keep the bodies in use from coming
    back: each would be unmapped when given back, and a fresh one mapped for the next."""
    pool = BytePool(max_bytes=12 << 20, grain=1 << 20)
    assert pool.prime(5 << 20, 2) == 2  # 6 MiB each with the header block: the pool is full
    unused = [buf for bufs in pool.idle.values() for buf in bufs]
    body = pool.take(2 << 20)  # 3 MiB, a fresh buffer: none of that capacity is idle
    pool.give(body)
    assert pool.idle_bytes == 9 << 20  # one primed buffer let go, the oldest
    assert pool.idle[6 << 20] == [unused[1]] and pool.idle[3 << 20] == [body.obj]
    again = pool.take(2 << 20)
    assert again.obj is body.obj  # the buffer in use comes back
    pool.give(again)
    pool.give(pool.take(11 << 20))  # a buffer larger than what is idle lets go of all of it
    assert list(pool.idle) and pool.idle_bytes == 12 << 20
    assert sum(map(len, pool.idle.values())) == 1


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


def test_a_pinned_body_goes_back_to_the_pool_only_after_its_last_unpin() -> None:
    pool = BytePool(grain=1 << 20)
    body = pool.take(2 << 20)
    pool.pin(body)
    pool.pin(body)  # e.g. a round's contribution and a merge's
    pool.give(body)  # the upload port is done with it: the round is not
    assert pool.idle_bytes == 0 and pool.take(2 << 20).obj is not body.obj
    pool.unpin(body)
    assert pool.idle_bytes == 0
    pool.unpin(body)
    assert pool.idle_bytes == 3 << 20  # idle now, once
    pool.unpin(body)
    pool.give(body)
    assert pool.idle_bytes == 3 << 20
    again = pool.take(2 << 20)
    assert again.obj is body.obj
    pool.pin(again)
    pool.unpin(again)  # unpinned before it is given: given back as usual
    pool.give(again)
    assert pool.idle_bytes == 3 << 20
    pool.pin(memoryview(bytearray(10)))  # not the pool's: ignored
    pool.unpin(b"x")
    assert not pool.pins


def test_a_round_reads_bf16_updates_where_they_arrived_and_lets_their_bodies_go_at_the_merge(
    tmp_path: Path,
) -> None:
    """Two learners' bf16 updates held as views of their `BODIES` buffers (pinned while the
    round holds them, whatever the upload port does), a third absorbed (the sum goes to
    float32 of the pool, both bodies let go), merged into what float32 copies give."""
    clock = Clock()
    sync = make(tmp_path, clock, quorum=2, merge="mean")
    start(sync, "abc")
    values = {"a": A * 0.5, "b": B * 0.25, "c": (A + B) * 0.125}
    bodies = {}
    for i, (lid, v) in enumerate(values.items()):
        payload = update(lid, 1, v.to(torch.bfloat16), step=1 + i)
        body = BODIES.take(len(payload))
        body[:] = payload
        assert sync.submit(body, 1).status == "accepted"
        BODIES.give(body)  # as upload_port.py does once submit returns
        bodies[lid] = body
    held = sync.rounds.rounds[1].contributions
    assert all(id(b.obj) in BODIES.pins for b in bodies.values())
    assert held["a"].body is bodies["a"] and held["a"].delta["w"].dtype == torch.bfloat16
    extra = update("a", 1, (B * 0.5).to(torch.bfloat16), step=9)
    body = BODIES.take(len(extra))
    body[:] = extra
    assert sync.submit(body, 1).status == "accepted"
    BODIES.give(body)
    assert held["a"].owned and held["a"].delta["w"].dtype == torch.float32
    assert id(bodies["a"].obj) not in BODIES.pins and id(body.obj) not in BODIES.pins
    assert sync.merge(1) == 1
    assert not {id(b.obj) for b in bodies.values()} & set(BODIES.pins)
    parts = [values["a"].to(torch.bfloat16).float() + (B * 0.5).to(torch.bfloat16).float()]
    parts += [values[k].to(torch.bfloat16).float() for k in "bc"]
    weights = [200 * 200 / 20, 100 * 100 / 10, 100 * 100 / 10]  # tokens^2 / steps
    want = sum(w * d for w, d in zip(weights, parts, strict=True)) / sum(weights)
    assert torch.allclose(served(sync, 1).float(), want.to(torch.bfloat16).float(), atol=1e-3)


def test_served_payloads_are_safetensors_of_the_broadcast_dtype_in_reused_buffers() -> None:
    """Byte for byte what `codec.encode` of the converted tensors gives; a retired buffer
    is written again only once nothing reads it (a download holds its view)."""
    served_ = Served("bfloat16", fragments=2)
    g = torch.Generator().manual_seed(4)
    frag = {"w": torch.randn(300, 7, generator=g), "b": torch.randn(7, generator=g)}
    first = served_.encode(1, frag)
    assert first == codec.encode({k: v.to(torch.bfloat16) for k, v in frag.items()})
    held = first  # a download in flight
    keep = bytes(first)
    served_.retire(1, first)
    del first
    second = served_.encode(1, {k: v * 2 for k, v in frag.items()})
    assert served_.reused == 0 and held == keep  # read by someone: not written
    served_.retire(1, second)
    del second, held
    third = served_.encode(1, {k: v * 3 for k, v in frag.items()})
    assert served_.reused == 1  # the first's, or the second's: nobody reads them now
    want = codec.encode({k: (v * 3).to(torch.bfloat16) for k, v in frag.items()})
    assert third == want
    assert served_.encode(0, frag) == codec.encode(
        {k: v.to(torch.bfloat16) for k, v in frag.items()}
    )  # another fragment's spares are its own
    assert served_.reused == 1
