"""A round's direction summed as its contributions arrive (synchronizer/stream.py).

    pytest tests/unit/test_stream.py

The sum is used only when it is bit for bit what the merge would have summed from the
contributions (a journal replay sums from them, and must serve the same bits), and only
when its terms are exactly the merged contributions', in order.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ddiloco.synchronizer import parallel_passes, update_passes
from ddiloco.synchronizer.buffers import BODIES
from ddiloco.synchronizer.merge import Contribution, MergePolicy, OuterNesterov
from ddiloco.synchronizer.stream import RoundSum
from ddiloco.wire import codec, quant
from ddiloco.wire.protocol import FragmentSpec, UpdateMeta
from tests.unit.test_contract import Clock, make, start, update

SHAPES = {"a": (64, 33), "b": (500,), "z": (7,)}


def contribution(i: int, dtype: torch.dtype, *, steps: int = 10, zero: bool = True) -> Contribution:
    g = torch.Generator().manual_seed(i)
    delta = {k: torch.randn(s, generator=g).to(dtype) * (i + 1) for k, s in SHAPES.items()}
    if zero:
        delta["z"] = torch.zeros(7, dtype=dtype)  # no direction: counts in the radius only
    meta = UpdateMeta(
        learner_id=f"l{i}", fragment=1, base_version=0, steps=steps, tokens=100 * (i + 1),
        learner_step=i + 1,
    )  # fmt: skip
    norms = {k: float(torch.linalg.vector_norm(v.float())) for k, v in delta.items()}
    # bf16: views of a body, as admission holds them (float32: the pool's, as a sum is)
    return Contribution.of(meta, delta, norms, None if dtype == torch.float32 else b"")


def state() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    params = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    return params, {k: torch.randn(s, generator=g) * 0.1 for k, s in SHAPES.items()}


SPEC = FragmentSpec(index=1, tensors=[])


@pytest.mark.parametrize("rule", ["rda", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("granularity", ["tensor", "fragment"])
def test_a_streamed_merge_is_the_merge_of_the_contributions_bit_for_bit(
    rule: str, dtype: torch.dtype, granularity: str
) -> None:
    """Offered and added one by one (a weightless one among them), then claimed: the merge
    is the same bits as the one that sums the same contributions itself (a replay's), with
    RDA per tensor or over the whole fragment."""
    policy = MergePolicy(
        rule=rule,  # type: ignore[arg-type]
        granularity=granularity,  # type: ignore[arg-type]
        outer=OuterNesterov(lr=0.7, momentum=0.9),
    )
    cs = [contribution(i, dtype, steps=0 if i == 2 else 10) for i in range(5)]
    rs = RoundSum(policy, rule)
    for c in cs:
        rs.offer(c)
        rs.drain()
    per_tensor = rule == "rda" and granularity == "tensor"  # "z" has no direction of its own
    assert not rs.queue and set(rs.sum) == ({"a", "b"} if per_tensor else set(SHAPES))
    assert len(rs.keys) == 4  # the weightless one has no term
    params, momentum = state()
    streamed = policy.merge(SPEC, params, momentum, 3, cs, None, rs)
    assert rs.sum == {}  # claimed: the merge's
    plain = policy.merge(SPEC, params, momentum, 3, cs, None)
    assert streamed is not None and plain is not None
    for k in SHAPES:
        assert torch.equal(streamed.params[k], plain.params[k]), k
        assert torch.equal(streamed.momentum[k], plain.momentum[k]), k


def test_a_sum_that_is_not_the_rounds_terms_is_not_used() -> None:
    policy = MergePolicy()
    cs = [contribution(i, torch.float32) for i in range(3)]
    keys = [tuple(c.ids) for c in cs]

    def summed() -> RoundSum:
        rs = RoundSum(policy, "rda")
        for c in cs:
            rs.offer(c)
        return rs

    assert summed().claim(keys, policy, "rda") is not None
    assert summed().claim(keys[::-1], policy, "rda") is None  # another order
    assert summed().claim(keys[:2], policy, "rda") is None  # a term too many
    assert summed().claim(keys, MergePolicy(weighting="tokens"), "rda") is None
    assert summed().claim(keys, policy, "mean") is None
    spoiled = summed()
    spoiled.spoil()
    assert spoiled.claim(keys, policy, "rda") is None


def test_a_queued_bf16_term_keeps_its_body_until_it_is_added_or_let_go() -> None:
    payload = bytes(4096)
    rs = RoundSum(MergePolicy(), "rda")
    for discard in (False, True):
        body = BODIES.take(len(payload))
        c = contribution(0, torch.bfloat16)
        c.body = body
        rs.offer(c)
        BODIES.give(body)  # the upload port is done with it
        assert id(body.obj) in BODIES.pins  # the queued term still reads it
        if discard:
            rs.discard()
        else:
            rs.drain()
        assert id(body.obj) not in BODIES.pins


def test_the_synchronizer_sums_a_round_at_admission_and_its_merge_takes_the_sum(
    tmp_path: Path,
) -> None:
    """Three learners' updates: summed as they were accepted; the merge takes the sum and
    serves what a synchronizer that sums at the merge serves. A learner's second update
    in the round replaces its term in the sum: the merge still takes the sum (its record
    says so, for a replay), and serves what the merge of the contributions serves, up to
    the order of float32 additions."""
    results = []
    for stream in (True, False):
        sync = make(tmp_path / str(stream), Clock(), quorum=3, merge="rda")
        start(sync, "abc")
        if not stream:
            sync.fragments[1].sum.spoil()
        for i, lid in enumerate("abc"):
            v = torch.tensor([1.0 + i, -2.0 * i + 0.5])
            assert sync.submit(update(lid, 1, v, step=1)).status == "accepted"
        rs = sync.fragments[1].sum
        assert (rs.valid, len(rs.keys), not rs.queue) == (stream, 3 if stream else 0, True)
        assert bool(rs.sum) is stream  # added by the admitting threads, not at the merge
        assert sync.merge(1) == 1
        fresh = sync.fragments[1].sum
        assert fresh is not rs and fresh.valid  # a new round, a new sum
        results.append(codec.decode(sync.fragment(1)[1])["w"])
        if not stream:
            sync.fragments[1].sum.spoil()
        for step, v in ((2, [0.5, 0.5]), (3, [0.25, 1.0])):
            body = update("a", 1, torch.tensor(v), step=step, base=1)
            assert sync.submit(body).status == "accepted"
        rs = sync.fragments[1].sum
        assert rs.valid is stream  # a's second update replaced its term
        if stream:
            assert rs.keys == [("a/1/1/2", "a/1/1/3")] == [tuple(c.ids) for c in
                sync.rounds.rounds[1].contributions.values()]  # fmt: skip
        assert sync.merge(1) == 2
        assert [r.stream for r in sync.fragments[1].journal.records()] == [stream, stream]
        results.append(codec.decode(sync.fragment(1)[1])["w"])
    assert torch.equal(results[0], results[2])
    torch.testing.assert_close(results[1], results[3], rtol=1e-6, atol=0)


@pytest.mark.parametrize("rule", ["rda", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_learner_again_in_the_round_replaces_its_term_in_the_sum(
    rule: str, dtype: torch.dtype
) -> None:
    """Five learners, the first (whose weight the sum's others are relative to) absorbing
    two more updates and another one more, interleaved with the rest, terms added early
    or late: the claimed sum merges to what the merge of the summed contributions gives
    (up to float32 rounding): the old terms are taken out, the weight reference kept."""
    policy = MergePolicy(rule=rule, outer=OuterNesterov(lr=0.7, momentum=0.9))  # type: ignore[arg-type]
    params, momentum = state()
    for drain_each in (True, False):
        cs = [contribution(i, dtype, zero=False) for i in range(5)]
        twins = [contribution(i, dtype, steps=3 + i, zero=False) for i in range(5, 8)]
        plain = [contribution(i, dtype, zero=False) for i in range(5)]
        rs = RoundSum(policy, rule)
        order = [("offer", 0), ("offer", 1), ("absorb", 0), ("offer", 2), ("offer", 3),
                 ("absorb", 2), ("offer", 4), ("absorb", 0)]  # fmt: skip
        extra = iter(twins)
        for op, i in order:
            if op == "offer":
                rs.offer(cs[i])
            else:
                t = next(extra)
                meta = UpdateMeta(
                    learner_id=f"l{i}", fragment=1, base_version=0, steps=t.steps,
                    tokens=t.tokens, learner_step=100 + len(cs[i].ids),
                )  # fmt: skip
                rs.absorb(cs[i], meta, dict(t.delta))
                plain[i].absorb(meta, dict(t.delta))
            if drain_each:
                rs.drain()
        assert rs.valid and rs.keys == [tuple(c.ids) for c in cs]
        assert [len(k) for k in rs.keys] == [3, 1, 2, 1, 1]
        streamed = policy.merge(SPEC, params, momentum, 3, cs, None, rs)
        direct = policy.merge(SPEC, params, momentum, 3, plain, None)
        assert streamed is not None and direct is not None and streamed.streamed
        for k in SHAPES:
            torch.testing.assert_close(streamed.params[k], direct.params[k], rtol=2e-5, atol=1e-5)


def test_an_absorb_queues_the_old_term_out_and_the_new_one_in_and_adds_nothing_itself() -> None:
    """Under the fragment's lock the absorb only queues: the old term times -1 (reading
    the old body, pinned until it is added) and the new sum's term; whoever drains adds
    them, in that order."""
    payload = bytes(4096)
    rs = RoundSum(MergePolicy(), "rda")
    body = BODIES.take(len(payload))
    c = contribution(0, torch.bfloat16)
    c.body = body
    BODIES.pin(body)  # as Contribution.of pins the body it views
    rs.offer(c)
    rs.drain()
    before = {k: t.clone() for k, t in rs.sum.items()}
    BODIES.give(body)  # the upload port is done with it
    more = contribution(1, torch.bfloat16)
    meta = UpdateMeta(learner_id="l0", fragment=1, base_version=0, steps=10, tokens=100,
                      learner_step=9)  # fmt: skip
    rs.absorb(c, meta, dict(more.delta), b"")
    assert len(rs.queue) == 2 and [a["a"] < 0 for _, a, _, _ in rs.queue] == [True, False]
    assert all(torch.equal(rs.sum[k], v) for k, v in before.items())  # nothing added yet
    assert c.owned and c.body is None and id(body.obj) in BODIES.pins  # the queue reads it
    rs.drain()
    assert not rs.queue and id(body.obj) not in BODIES.pins


def test_a_weightless_contribution_absorbing_an_update_spoils_the_sum() -> None:
    rs = RoundSum(MergePolicy(), "rda")
    c = contribution(0, torch.float32, steps=0)
    rs.offer(c)
    assert rs.valid and rs.keys == []
    more = contribution(1, torch.float32)
    meta = UpdateMeta(learner_id="l0", fragment=1, base_version=0, steps=10, tokens=100,
                      learner_step=9)  # fmt: skip
    rs.absorb(c, meta, dict(more.delta))
    assert not rs.valid and c.steps == 10


@pytest.mark.parametrize("slots", [1, 3])
def test_cpu_slots_bound_the_uploads_in_their_passes_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slots: int
) -> None:
    """Six learners' updates submitted at once: no more than `cpu_slots` of them measure
    their norms together (and with 3 slots, more than one does)."""
    from ddiloco.synchronizer import admission

    inside, most = [0], [0]
    guard = threading.Lock()
    real = admission.delta_norms

    def slow_norms(*args: object) -> object:
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.15)
        with guard:
            inside[0] -= 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(admission, "delta_norms", slow_norms)
    sync = make(tmp_path, Clock(), quorum=6, cpu_slots=slots)
    start(sync, "abcdef")
    payloads = [
        update(lid, 1, torch.tensor([1.0, float(i)]), step=1) for i, lid in enumerate("abcdef")
    ]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(sync.submit, payloads))
    assert all(a.status == "accepted" for a in answers)
    assert most[0] == 1 if slots == 1 else 2 <= most[0] <= slots


def test_cpu_slots_default_to_every_core_but_one(tmp_path: Path) -> None:
    sync = make(tmp_path, Clock())
    assert sync.settings.tuning.cpu_slots == 0
    assert sync.cpu._value == max(1, len(os.sched_getaffinity(0)) - 1)  # type: ignore[attr-defined]


@pytest.mark.parametrize("rule", ["rda", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int4"])
def test_terms_still_queued_when_the_merge_claims_are_added_by_it_in_pieces(
    rule: str, dtype: torch.dtype | str
) -> None:
    """The updates admitted just before a round closes are still queued when its merge
    claims the sum: the merge adds them in `threads` pieces (parallel_passes.py), the same bits as
    one term at a time (a replay's), and the sum's first term may be among them. A
    quantized term queues as its codes where a replay holds it (not dequantized)."""
    big = (2 << 20) + 1031  # two pieces of 1 Mi values and more, a vector tail
    shapes = {"big": (big,), "small": (37, 53)}

    def contribution(i: int) -> Contribution:
        g = torch.Generator().manual_seed(i)
        raw = {k: torch.randn(s, generator=g) * (i + 1) for k, s in shapes.items()}
        meta = UpdateMeta(
            learner_id=f"l{i}", fragment=1, base_version=0, steps=10, tokens=100 * (i + 1),
            learner_step=i + 1,
        )  # fmt: skip
        if isinstance(dtype, str):
            codes = {k: quant.quantize(v, dtype) for k, v in raw.items()}  # type: ignore[arg-type]
            norms = {k: update_passes.norm(v) for k, v in codes.items()}
            return Contribution.of(meta, codes, norms)  # type: ignore[arg-type]
        delta = {k: v.to(dtype) for k, v in raw.items()}
        norms = {k: float(torch.linalg.vector_norm(v.float())) for k, v in delta.items()}
        return Contribution.of(meta, delta, norms)

    g = torch.Generator().manual_seed(99)
    params = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    momentum = {k: torch.randn(s, generator=g) * 0.1 for k, s in shapes.items()}
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    cs = [contribution(i) for i in range(4)]
    results = []
    for added, threads in ((4, 1), (1, 2), (0, 2)):  # one by one; the rest at the merge
        policy = MergePolicy(rule=rule, outer=outer, threads=threads)  # type: ignore[arg-type]
        rs = RoundSum(policy, rule)
        for i, c in enumerate(cs):
            rs.offer(c)
            if i < added:
                rs.drain()
        assert len(rs.queue) == len(cs) - added
        before = parallel_passes.stats["pieces"]
        out = policy.merge(SPEC, params, momentum, 3, cs, None, rs)
        assert out is not None and out.streamed
        if added < len(cs):  # the queued terms' pieces, the scaling's and the step's
            assert parallel_passes.stats["pieces"] - before == 3
        results.append(out)
    plain = MergePolicy(rule=rule, outer=outer).merge(SPEC, params, momentum, 3, cs, None)  # type: ignore[arg-type]
    assert plain is not None
    for out in results:
        for k in shapes:
            assert torch.equal(out.params[k], plain.params[k]), k
            assert torch.equal(out.momentum[k], plain.momentum[k]), k


def test_an_uploader_stops_adding_once_a_merge_claims_the_sum() -> None:
    """The merge adds what is left in pieces; an uploader's drain adds nothing then, and
    one that was adding stops after its term."""
    policy = MergePolicy()
    cs = [contribution(i, torch.bfloat16) for i in range(3)]
    rs = RoundSum(policy, "rda")
    for c in cs:
        rs.offer(c)
    rs.claiming = True
    rs.drain()
    assert len(rs.queue) == 3 and not rs.sum
    rs.claiming = False
    added: list[int] = []
    real_add = rs._add_all

    def add_and_claim(items: list, ways: int = 1) -> None:  # type: ignore[type-arg]
        added.append(len(items))
        real_add(items, ways)
        rs.claiming = True  # a merge claims while this uploader adds its first term

    rs._add_all = add_and_claim  # type: ignore[method-assign]
    rs.drain()
    assert added == [1] and len(rs.queue) == 2
    rs._add_all = real_add  # type: ignore[method-assign]
    summed = rs.claim([tuple(c.ids) for c in cs], policy, "rda")
    assert summed is not None and not rs.queue
