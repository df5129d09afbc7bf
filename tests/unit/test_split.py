"""A merge's passes in pieces on threads of their own (synchronizer/parallel_passes.py): the same
bits as one call, helpers used when free and never waited for when busy, and the setting
that chooses the pieces (`merge_threads`) reaching the merge and the served copy.

    pytest tests/unit/test_split.py

Real tensors large enough to be split (over 3 x `MIN_PIECE` values, with a tail that is
no multiple of a vector), real threads.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ddiloco.synchronizer import parallel_passes
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.contribution import Contribution
from ddiloco.synchronizer.merge import MergePolicy, NonFiniteMerge
from ddiloco.synchronizer.outer import OuterNesterov
from ddiloco.synchronizer.served_buffers import Served
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.wire import quant
from ddiloco.wire.protocol import FragmentSpec, TensorSpec, UpdateMeta

BIG = 3 * parallel_passes.MIN_PIECE + 777  # three pieces at most, the last with a ragged tail


def tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(BIG, generator=g) * scale,
        "small": torch.randn(37, 53, generator=g) * scale,
    }


@pytest.mark.parametrize(
    "n", [1, 1000, parallel_passes.MIN_PIECE, 2 * parallel_passes.MIN_PIECE, BIG, 10**7]
)
@pytest.mark.parametrize("ways", [1, 2, 3, 8])
def test_pieces_cover_the_range_in_order_from_stride_multiples(n: int, ways: int) -> None:
    pieces = parallel_passes.bounds(n, ways)
    assert pieces[0][0] == 0 and pieces[-1][1] == n
    assert all(a < b for a, b in pieces)
    assert all(b == a2 for (_, b), (a2, _) in itertools.pairwise(pieces))
    assert all(a % parallel_passes.STRIDE == 0 for a, _ in pieces)
    assert len(pieces) <= max(1, min(ways, n // parallel_passes.MIN_PIECE))


@pytest.mark.parametrize("ways", [2, 3])
@pytest.mark.parametrize("nesterov", [True, False])
def test_the_outer_step_in_pieces_gives_the_same_bits_as_one_call(
    ways: int, nesterov: bool
) -> None:
    opt = OuterNesterov(lr=0.7, momentum=0.9, nesterov=nesterov)
    params, momentum, delta = tensors(1), tensors(2, 0.01), tensors(3, 1e-3)
    one_p, one_b, ok1 = opt.step_checked(params, momentum, delta, 1)
    before = dict(parallel_passes.stats)
    got_p, got_b, ok = opt.step_checked(params, momentum, delta, ways)
    assert parallel_passes.stats["pieces"] - before["pieces"] == ways - 1  # the big tensor's only
    assert ok and ok1
    for k in params:
        assert torch.equal(got_p[k], one_p[k]) and torch.equal(got_b[k], one_b[k]), k


@pytest.mark.parametrize("lr", [0.7, 0.0])
def test_a_non_finite_value_in_a_helpers_piece_is_seen(lr: float) -> None:
    opt = OuterNesterov(lr=lr, momentum=0.9)
    params, momentum, delta = tensors(1), tensors(2), tensors(3)
    delta["big"][-5] = float("nan")  # in the last piece: a helper's, or taken back
    assert not opt.step_checked(params, momentum, delta, 3)[2]
    delta["big"][-5] = 0.0
    assert opt.step_checked(params, momentum, delta, 3)[2]


def test_a_free_helper_takes_a_piece() -> None:
    names: list[str] = []

    def piece(s: slice) -> int:
        if s.start == 0:
            time.sleep(0.2)  # the caller's own piece: long enough for a helper to start
        names.append(threading.current_thread().name)
        return s.start

    assert parallel_passes.run(BIG, piece, 2) == [0, parallel_passes.bounds(BIG, 2)[1][0]]
    assert any(n.startswith("ddiloco-split") for n in names)


def test_a_piece_no_helper_started_is_done_by_the_merge_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Helpers busy with other merges' pieces: the merge takes its piece back rather than
    wait for one to be free (without that, this would wait for the blocker, 30 s)."""
    busy = ThreadPoolExecutor(1)
    release = threading.Event()
    busy.submit(release.wait, 30)
    monkeypatch.setattr(parallel_passes, "HELPERS", busy)
    names: list[str] = []
    t0 = time.monotonic()
    parallel_passes.run(BIG, lambda s: names.append(threading.current_thread().name), 2)
    assert time.monotonic() - t0 < 5
    assert names == [threading.current_thread().name] * 2
    release.set()
    busy.shutdown()


def contribution(lid: str, seed: int, dtype: torch.dtype | str = torch.float32) -> Contribution:
    """A learner's contribution in float32, bf16, or quantized (`int8`, `int4`: codes)."""
    meta = UpdateMeta(
        learner_id=lid, fragment=0, base_version=0, learner_step=10, tokens=1000, steps=10
    )
    raw = tensors(seed, 1e-3)
    if isinstance(dtype, str):
        return Contribution.of(meta, {k: quant.quantize(v, dtype) for k, v in raw.items()})  # type: ignore[arg-type]
    return Contribution.of(meta, {k: v.to(dtype) for k, v in raw.items()})


SPEC = FragmentSpec(
    index=0, tensors=[TensorSpec(name="big", shape=[BIG]), TensorSpec(name="small", shape=[37, 53])]
)


@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_a_merge_in_pieces_is_the_merge_in_one(rule: str) -> None:
    """The policy end to end (the sum of float32, bf16, int8 and int4 terms, the rule's final scaling,
    the step, the check): bit-identical whatever `threads`, so replay (which runs with one)
    reproduces a merge's digest."""
    params, momentum = tensors(1), tensors(2, 0.01)
    results = []
    for threads in (1, 2, 3):
        policy = MergePolicy(rule=rule, threads=threads)  # type: ignore[arg-type]
        cs = [
            contribution("a", 4),
            contribution("b", 5, torch.bfloat16),
            contribution("c", 6, "int8"),
            contribution("d", 7, "int4"),
        ]
        before = parallel_passes.stats["pieces"]
        out = policy.merge(SPEC, params, momentum, 0, cs)
        assert out is not None
        handed = len(parallel_passes.bounds(BIG, threads)) - 1
        assert (
            parallel_passes.stats["pieces"] - before == 3 * handed
        )  # the sum, the scaling, the step
        results.append(out)
    for out in results[1:]:
        for k in params:
            assert torch.equal(out.params[k], results[0].params[k])
            assert torch.equal(out.momentum[k], results[0].momentum[k])


def test_a_merge_in_pieces_refuses_what_one_refuses() -> None:
    bad = contribution("a", 4)
    bad.delta["big"][-3] = float("inf")
    with pytest.raises(NonFiniteMerge):
        MergePolicy(threads=3).merge(SPEC, tensors(1), tensors(2), 0, [bad])


def test_the_served_copy_in_pieces_is_the_same_bytes() -> None:
    params = tensors(7)
    one = bytes(Served("bfloat16", 1, ways=1).encode(0, params))
    assert bytes(Served("bfloat16", 1, ways=3).encode(0, params)) == one


def test_merge_threads_reaches_the_merge_and_the_served_copy(tmp_path: Path) -> None:
    """The default is the usable cores over `torch_threads`; 1 hands no piece over."""
    cores = len(os.sched_getaffinity(0))
    default = SyncSettings(token="t", state_dir=tmp_path / "d")
    assert default.tuning.merge_ways() == max(1, cores // default.tuning.op_threads())
    assert SyncSettings(token="t", merge_threads=1).tuning.merge_ways() == 1
    for threads in (1, 3):
        sync = Synchronizer(
            SyncSettings(token="t", state_dir=tmp_path / str(threads), merge_threads=threads)
        )
        assert sync.policy.threads == threads and sync.payloads.ways == threads
        before = parallel_passes.stats["pieces"]
        sync.policy.merge(SPEC, tensors(1), tensors(2), 0, [contribution("a", 4)])
        pieces = parallel_passes.stats["pieces"] - before
        assert pieces == 3 * (threads - 1)  # the sum (not streamed here), the scaling, the step


def test_a_quantized_term_in_pieces_holds_whole_blocks() -> None:
    q = quant.quantize(tensors(9)["big"], "int4")
    whole = quant.dequantize(q)
    for a, b in parallel_passes.bounds(q.numel, 3):
        assert torch.equal(quant.dequantize(quant.values(q, a, b)), whole[a:b])
    with pytest.raises(ValueError, match="blocks"):
        quant.values(q, q.block // 2, q.block)
