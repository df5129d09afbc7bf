"""The download encodings (wire/broadcast.py, synchronizer/served_versions.py), in process:
what the synchronizer encodes per version and what a learner reads back from the bytes.

    pytest tests/unit/test_broadcast.py

The delta encodings: the served copy S_v stays within half a quantization step of Theta_v
however many versions go by (each delta carries the last one's error); a learner that follows
every delta and one that fetches the whole fragment hold the same bits, S_v's; a learner that
missed a version (or holds a copy of another lineage) gets the whole fragment, and a delta
read against a copy it does not apply to is refused; nothing non-finite is served.
"""

from __future__ import annotations

import pytest
import torch

from ddiloco.synchronizer import served_versions
from ddiloco.synchronizer.served_buffers import Served
from ddiloco.wire import broadcast, codec, quant
from ddiloco.wire.broadcast import Held
from ddiloco.wire.errors import PayloadError

SHAPES = {"a.weight": (37, 11), "b.bias": (5,), "c.empty": (0,), "d.big": (300,)}


def theta0(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def walk(theta: dict[str, torch.Tensor], g: torch.Generator) -> dict[str, torch.Tensor]:
    """The next Theta: a merge's step of mixed sizes (some values move a lot, most a little)."""
    out = {}
    for k, v in theta.items():
        step = torch.randn(v.shape, generator=g) * 1e-2
        step[..., :1] *= 50.0  # a few large moves: absmax blocks with small values beside them
        out[k] = v + step
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


@pytest.mark.parametrize("encoding", ["int8-delta", "int4-delta"])
def test_served_copy_follows_theta_within_half_a_step_and_learners_hold_it_bit_for_bit(
    encoding: str,
) -> None:
    served = Served("float32", fragments=1, kinds=2)
    g = torch.Generator().manual_seed(1)
    theta = theta0()
    b = served_versions.encode(served, encoding, 0, 0, theta)
    follower = broadcast.read(bytes(b.whole))  # joined at version 0: the whole copy
    assert follower.token == b.token and same_bits(follower.tensors, theta)
    worst = 0.0
    for version in range(1, 61):
        theta = walk(theta, g)
        prev, b = b, served_versions.encode(served, encoding, 0, version, theta, prev=b)
        assert b.base == prev.token and b.delta is not None
        body, label = b.body(follower.token)
        assert body is b.delta and label == encoding
        follower = broadcast.read(bytearray(body), Held(str(follower.token), follower.tensors))
        assert follower.token == b.token
        assert b.held is not None and same_bits(follower.tensors, b.held)
        whole = broadcast.read(bytes(b.body(None)[0]))  # a joiner now: the same bits
        assert whole.token == b.token and same_bits(whole.tensors, b.held)
        # within half a step of the last delta's quantization, however many versions went by
        q_delta = codec.tensor_views(bytes(b.delta), codec.read_header(bytes(b.delta), codes=True))
        for k, t in theta.items():
            if not t.numel():
                continue
            scales = q_delta[k + "#scales"]
            step = scales.repeat_interleave(quant.DEFAULT_BLOCK)[: t.numel()].view(t.shape)
            err = (b.held[k] - t).abs()
            assert bool((err <= step / 2 + 1e-6 * t.abs() + 1e-30).all()), (version, k)
            worst = max(worst, float((err / t.abs().clamp_min(1e-3)).max()))
    assert worst > 0  # quantized: not exact, only bounded


@pytest.mark.parametrize(("encoding", "most"), [("int8-delta", 0.26), ("int4-delta", 0.135)])
def test_a_delta_is_a_fraction_of_the_whole(encoding: str, most: float) -> None:
    served = Served("float32", fragments=1, kinds=2)
    theta = {"w": torch.randn(1 << 18)}
    b = served_versions.encode(served, encoding, 0, 0, theta)
    b = served_versions.encode(served, encoding, 0, 1, {"w": theta["w"] + 1e-3}, prev=b)
    assert b.delta is not None and len(b.delta) < most * len(b.whole)


def test_a_learner_that_missed_a_version_gets_the_whole_fragment_and_a_stale_delta_is_refused() -> (
    None
):
    served = Served("float32", fragments=1, kinds=2)
    g = torch.Generator().manual_seed(2)
    theta = theta0()
    b0 = served_versions.encode(served, "int8-delta", 0, 0, theta)
    b1 = served_versions.encode(served, "int8-delta", 0, 1, walk(theta, g), prev=b0)
    b2 = served_versions.encode(served, "int8-delta", 0, 2, walk(theta, g), prev=b1)
    for held in (b0.token, None, "nonsense", "x" * 10_000):
        body, label = b2.body(held)
        assert body is b2.whole and label == "fp32"
    assert b2.body(b1.token)[0] is b2.delta
    assert b2.body(b2.token) == (b2.same, "unchanged")  # holds it: no tensors
    old = broadcast.read(bytes(b0.whole))
    with pytest.raises(broadcast.StaleBase):  # v2's delta on a copy of v0: never applied
        broadcast.read(bytes(b2.delta), Held(str(old.token), old.tensors))
    with pytest.raises(broadcast.StaleBase):
        broadcast.read(bytes(b2.delta))
    # a new lineage (a restart: S from Theta) shares no token with the old one
    again = served_versions.encode(served, "int8-delta", 0, 2, walk(theta, g))
    assert again.token != b2.token and again.delta is None


def test_nothing_non_finite_is_served() -> None:
    served = Served("float32", fragments=1, kinds=2)
    theta = theta0()
    b0 = served_versions.encode(served, "int8-delta", 0, 0, theta)
    bad = {k: v.clone() for k, v in theta.items()}
    bad["a.weight"][3, 4] = float("inf")
    for encoding in ("int8", "int8-delta", "int4-delta"):
        with pytest.raises(ValueError):
            served_versions.encode(served, encoding, 0, 1, bad)
    with pytest.raises(ValueError):
        served_versions.encode(served, "int8-delta", 0, 1, bad, prev=b0)
    # a difference that overflows float32 (Theta finite): S restarts from Theta instead
    huge = {k: v.clone() for k, v in theta.items()}
    huge["a.weight"][0, 0] = 3e38
    b1 = served_versions.encode(served, "int8-delta", 0, 1, huge, prev=b0)
    b2 = served_versions.encode(
        served, "int8-delta", 0, 2, {k: -v if k == "a.weight" else v for k, v in huge.items()},
        prev=b1,
    )  # fmt: skip
    assert b2.delta is None and b2.token != b1.token
    assert b2.held is not None and all(bool(torch.isfinite(t).all()) for t in b2.held.values())


def test_int8_and_float_downloads_read_back() -> None:
    served = Served("float32", fragments=1)
    theta = theta0()
    b = served_versions.encode(served, "int8", 0, 3, theta)
    got = broadcast.read(bytearray(b.whole))
    assert got.token is None and b.label == "int8"
    for k, t in theta.items():
        assert torch.equal(got.tensors[k], quant.dequantize(quant.quantize(t, "int8")))
    big = {"w": torch.randn(1 << 18)}
    assert len(served_versions.encode(served, "int8", 0, 3, big).whole) < 0.26 * 4 * (1 << 18)
    half = served_versions.encode(Served("bfloat16", 1), "bfloat16", 0, 3, theta)
    got = broadcast.read(bytes(half.whole))
    assert got.tensors["d.big"].dtype == torch.bfloat16 and half.label == "bf16"


def test_malformed_quantized_downloads_are_refused() -> None:
    served = Served("float32", fragments=1)
    b = served_versions.encode(served, "int8", 0, 0, theta0())
    header = codec.read_header(bytes(b.whole), codes=True)
    tensors = codec.tensor_views(bytes(b.whole), header)
    for meta, why in [
        ({**header.metadata, "ddiloco.shapes": "[1"}, "shapes"),
        ({**header.metadata, "ddiloco.shapes": '{"a.weight":[37,12]}'}, "match"),
        ({**header.metadata, "ddiloco.download": "int2"}, "unknown"),
        ({**header.metadata, "encoding": "int4"}, "int8 codes"),
    ]:
        with pytest.raises(PayloadError, match=why):
            broadcast.read(codec.encode(tensors, meta))


def test_delta_is_applied_with_the_same_bits_as_dequantize() -> None:
    g = torch.Generator().manual_seed(3)
    for n in (1, 127, 128, 129, 1000):
        held, d = torch.randn(n, generator=g), torch.randn(n, generator=g)
        for encoding in ("int8", "int4"):
            q = quant.quantize(d, encoding)  # type: ignore[arg-type]
            out = broadcast.apply_delta(held, q, torch.empty(n))
            assert torch.equal(bits(out), bits(held + quant.dequantize(q)))


def test_a_synchronizer_serves_deltas_merges_theta_and_restarts_whole(tmp_path) -> None:
    """On a real `Synchronizer` (real files, test_journal's rounds): a follower of the deltas
    holds the served copy bit for bit while merges and checkpoints read Theta, exact; after a
    restart (a crash: the writer stopped) the copy starts again from Theta, a new lineage,
    and the follower's token gets the whole fragment, then deltas again after the next merge."""
    from ddiloco.synchronizer import checkpoints
    from tests.unit import test_journal as tj
    from tests.unit.test_contract import Clock

    clock = Clock()
    sync = tj.make(tmp_path, clock, broadcast_encoding="int8-delta")
    tj.start(sync)
    tj.stop_writer(sync)
    follower = broadcast.read(bytes(sync.fragment(0)[1]))
    assert same_bits(follower.tensors, sync.fragments[0].state.params)  # version 0: S_0 = Theta_0
    for v in range(1, 4):
        assert sync.submit(tj.update("a", 10 * v, v - 1, v)).status == "accepted"
        assert sync.merge(0) == v
        version, body = sync.fragment(0, follower.token)
        served = sync.fragments[0].served
        assert version == v and body is served.delta
        follower = broadcast.read(bytes(body), Held(str(follower.token), follower.tensors))
        assert follower.token == served.token and same_bits(follower.tensors, served.held)
        theta = sync.fragments[0].state.params
        assert not same_bits(follower.tensors, theta)  # served is S, merged is Theta
        snap = checkpoints.take_snapshot(sync)
        assert snap is not None and same_bits(snap.fragments[0].params, theta)
    assert sync.learners.totals["bytes_down"] > 0
    again = tj.make(tmp_path, clock, broadcast_encoding="int8-delta")
    assert again.versions() == [3]
    version, body = again.fragment(0, follower.token)
    assert version == 3 and body is again.fragments[0].served.whole
    whole = broadcast.read(bytes(body))
    assert whole.token != follower.token
    assert same_bits(whole.tensors, again.fragments[0].state.params)  # from Theta again
    assert again.submit(tj.update("b", 50, 3, 9)).status == "accepted"
    assert again.merge(0) == 4
    version, body = again.fragment(0, whole.token)
    assert body is again.fragments[0].served.delta
    got = broadcast.read(bytes(body), Held(str(whole.token), whole.tensors))
    assert same_bits(got.tensors, again.fragments[0].served.held)


def test_a_joiner_holding_the_initial_values_downloads_nothing_of_version_0() -> None:
    """S_0's token is its content's: a learner that built the same initial values names
    them, gets an answer of no tensors at version 0 and the delta at version 1; one whose
    values differ by a bit gets the whole fragment."""
    served = Served("float32", fragments=1, kinds=2)
    theta = theta0()
    b0 = served_versions.encode(served, "int8-delta", 0, 0, theta)
    mine = {k: v.clone() for k, v in theta.items()}
    token = broadcast.initial_token(mine)
    assert token == b0.token
    body, label = b0.body(token)
    assert label == "unchanged" and len(body) < 200
    got = broadcast.read(bytes(body), Held(token, mine))
    assert got.tensors is mine and got.token == token
    with pytest.raises(broadcast.StaleBase):
        broadcast.read(bytes(body), Held("other.0", mine))
    b1 = served_versions.encode(served, "int8-delta", 0, 1, walk(theta, torch.Generator()), prev=b0)
    body, label = b1.body(token)
    assert label == "int8-delta"
    got = broadcast.read(bytes(body), Held(token, mine))
    assert b1.held is not None and same_bits(got.tensors, b1.held)
    other = {k: v.clone() for k, v in theta.items()}
    other["b.bias"].view(torch.int32)[0] ^= 1  # one bit
    assert broadcast.initial_token(other) != token
    assert b0.body(broadcast.initial_token(other))[0] is b0.whole
