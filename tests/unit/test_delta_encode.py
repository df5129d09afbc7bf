"""A delta download encoding's served bytes (synchronizer/served_versions.py) against a
straightforward reference: quantize each difference Theta_v - S_{v-1} whole (`quant.quantize`),
apply it (`broadcast.apply_delta`), check S_v is finite and encode both payloads. The served
version is written a chunk at a time, split between threads; its codes, scales, S_v and
tokens must be the same bytes, and it must refuse (S restarting from Theta) exactly where
the reference does: a difference or an S_v that overflows float32.

    pytest tests/unit/test_delta_encode.py
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.synchronizer import parallel_passes, served_versions
from ddiloco.synchronizer.served_buffers import Served
from ddiloco.synchronizer.served_versions import Broadcast
from ddiloco.wire import broadcast, quant
from ddiloco.wire.broadcast import BASE_KEY, DELTAS, TOKEN_KEY

MAX = torch.finfo(torch.float32).max
BASE_TOKEN = "5eed.3"


def reference(
    encoding: str, theta: dict[str, torch.Tensor], held: dict[str, torch.Tensor], block: int
) -> tuple[bytes, bytes] | None:
    """The delta and whole payloads of version 4 from `held` (S_3, `BASE_TOKEN`), computed
    tensor by tensor in full; None where the encoding must refuse the delta."""
    q_encoding = DELTAS[encoding]
    try:
        deltas = {
            k: quant.quantize(theta[k].to(torch.float32) - held[k], q_encoding, block)
            for k in sorted(theta)
        }
    except ValueError:
        return None
    new = {
        k: broadcast.apply_delta(held[k], q, torch.empty_like(held[k])) for k, q in deltas.items()
    }
    if not all(bool(torch.isfinite(t).all()) for t in new.values()):
        return None
    token = broadcast.token(BASE_TOKEN.split(".")[0], 4)
    meta = broadcast.quantized_meta(q_encoding, encoding, block, theta)
    meta |= {TOKEN_KEY: token, BASE_KEY: BASE_TOKEN}
    served = Served("float32", 1, kinds=2)
    delta = bytes(served.encode_codes(0, deltas, meta))
    return delta, bytes(served.encode(0, new, broadcast.whole_meta(token)))


def check(
    encoding: str,
    theta: dict[str, torch.Tensor],
    held: dict[str, torch.Tensor],
    block: int,
    ways: int = 1,
) -> bool:
    """Encode version 4 after a version 3 that served `held`; assert it matches the
    reference; whether a delta was served."""
    want = reference(encoding, theta, held, block)
    prev = Broadcast(3, memoryview(b""), "fp32", token=BASE_TOKEN, held=held)
    served = Served("float32", 1, ways=ways, kinds=2)
    b = served_versions.encode(served, encoding, 0, 4, theta, prev=prev, block=block)
    assert b.held is not None
    if want is None:  # refused: S restarts from Theta, a new lineage, whole fragments only
        assert b.delta is None and b.token is not None and not b.token.startswith("5eed.")
        for k, t in theta.items():
            assert torch.equal(b.held[k].view(torch.int32), t.to(torch.float32).view(torch.int32))
        return False
    assert b.delta is not None and b.token == "5eed.4" and b.base == BASE_TOKEN
    assert bytes(b.delta) == want[0]
    assert bytes(b.whole) == want[1]
    again = broadcast.read(bytearray(b.whole))  # S_v as served is the S_v held
    for k, t in b.held.items():
        assert torch.equal(t.view(torch.int32), again.tensors[k].view(torch.int32))
    return True


@st.composite
def fragments(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Theta and S_{v-1}: a few tensors of sizes that are and are not multiples of a block,
    values of any scale, signed zeros, subnormal scales, and now and then values near
    float32's limit."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    theta, held = {}, {}
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(0, 40), min_size=1, max_size=2)))
        s = torch.randn(shape, generator=g) * 10.0 ** draw(st.integers(-30, 30))
        step = torch.randn(shape, generator=g) * 10.0 ** draw(st.integers(-35, 5))
        t = s + step
        if draw(st.booleans()) and s.numel():  # signed zeros; tiny moves beside large ones
            s.view(-1)[::3] = -0.0
            t.view(-1)[::3] = -1e-30
            t.view(-1)[0] = 1.0
        if draw(st.integers(0, 4)) == 0:  # moves so small a block's 1 / scale overflows
            s.zero_()
            t = torch.randn(shape, generator=g) * 10.0 ** draw(st.integers(-44, -36))
            t.view(-1)[::3] = 0.0
        if draw(st.integers(0, 4)) == 0 and s.numel():  # near the limit: may overflow
            s.view(-1)[-1] = draw(st.sampled_from([MAX, -MAX, MAX * 0.75]))
            t.view(-1)[-1] = draw(st.sampled_from([MAX, -MAX, MAX * 0.9]))
        theta[f"t{i}"], held[f"t{i}"] = t, s
    return theta, held


@settings(max_examples=300, deadline=None)
@given(
    frag=fragments(),
    encoding=st.sampled_from(sorted(DELTAS)),
    block=st.sampled_from([2, 4, 6, 8, 128, 130]),
    chunk=st.sampled_from([4, 64, served_versions.CHUNK]),
)
def test_delta_bytes_equal_the_reference(
    frag: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    encoding: str,
    block: int,
    chunk: int,
) -> None:
    theta, held = frag
    saved, served_versions.CHUNK = served_versions.CHUNK, chunk  # chunk boundaries
    try:
        check(encoding, theta, held, block)
    finally:
        served_versions.CHUNK = saved


def test_an_s_that_overflows_is_refused_as_the_reference_refuses_it() -> None:
    """A finite difference whose quantization error carries S_v past float32's limit: the
    block's other value sets the scale, and a move of 0.6 of it rounds up to a whole one."""
    for encoding, q_encoding in DELTAS.items():
        scale = 1.27e38 / quant.QMAX[q_encoding]
        held = {"w": torch.tensor([MAX - 0.6 * scale, 0.0])}
        theta = {"w": torch.tensor([MAX, 1.27e38])}
        assert reference(encoding, theta, held, 2) is None
        assert not check(encoding, theta, held, 2)


def test_large_finite_values_are_served_as_a_delta() -> None:
    """S_v near the limit whose values sum past it (each finite): a delta, as the reference
    serves it."""
    held = {"w": torch.full((300,), MAX * 0.75)}
    theta = {"w": held["w"] * (1 - torch.linspace(0, 1e-3, 300))}
    for encoding in DELTAS:
        assert check(encoding, theta, held, 128)


def test_pieces_split_between_threads_serve_the_same_bytes() -> None:
    """Tensors large enough to be split (parallel_passes.py), with blocks that do and do not
    divide a piece's start, and a size that is no multiple of either."""
    g = torch.Generator().manual_seed(7)
    n = 2 * parallel_passes.MIN_PIECE + 77
    held = {"a": torch.randn(n, generator=g), "b": torch.randn(1000, generator=g)}
    theta = {k: v + torch.randn(v.shape, generator=g) * 1e-2 for k, v in held.items()}
    for encoding in DELTAS:
        for block in (128, 6):
            assert check(encoding, theta, held, block, ways=3)
