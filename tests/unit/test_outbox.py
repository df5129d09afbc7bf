"""The learner's outbox (learner/outbox.py) and its upload loop (learner/streaming.py): no hand-over is dropped, none overtakes another.

    pytest tests/unit/test_outbox.py

Updates of a fragment that wait unattempted are summed (float32, counters added); one that
was attempted is frozen and re-sent as is, same metadata and bytes, until a definitive
answer; the queue is strictly FIFO, so each fragment's (incarnation, learner_step) rises;
and the ledger balances: put = accepted + duplicate + refused + queued. The upload thread
runs against a scripted stand-in for the synchronizer client (no network).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import ClassVar

import pytest
import torch

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.outbox import OUTCOMES, Entry, Outbox
from ddiloco.learner.streaming import Streamer
from ddiloco.learner.sync_client import Body, SyncRefused, SyncUnavailable
from ddiloco.wire import codec
from ddiloco.wire.protocol import (
    FragmentSpec,
    Layout,
    TensorSpec,
    UpdateMeta,
    UpdateResponse,
)

LAYOUT = Layout(
    fragments=[
        FragmentSpec(index=p, tensors=[TensorSpec(name=f"w{p}", shape=[8])]) for p in range(2)
    ]
)


def joined(e: Entry) -> bytes:
    """The bytes an entry posts (`encoded` gives them as parts)."""
    body = e.encoded()
    return body if isinstance(body, bytes) else b"".join(body)


def meta(p: int, step: int, *, base: int = 0, steps: int = 4, tokens: int = 40, inc: int = 1):
    return UpdateMeta(
        learner_id="l0",
        fragment=p,
        base_version=base,
        steps=steps,
        tokens=tokens,
        learner_step=step,
        incarnation=inc,
    )


def delta(p: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{p}": (torch.randn(8, generator=g) * 1e-3).to(dtype)}


def assert_balanced(ledger: dict[int, dict[str, int]]) -> None:
    for p, row in ledger.items():
        for unit in ("steps", "tokens"):
            delivered = sum(row[f"{k}_{unit}"] for k in (*OUTCOMES, "queued"))
            assert row[f"put_{unit}"] == delivered, (p, unit, row)
        uploads = sum(row[f"{k}_uploads"] for k in (*OUTCOMES, "queued"))
        assert row["put_handovers"] == row["summed"] + uploads, (p, row)


def test_queued_updates_of_a_fragment_are_summed_in_float32() -> None:
    box = Outbox(2)
    parts = [delta(0, s) for s in range(3)]
    assert box.put(meta(0, 4, base=2, steps=4, tokens=40, inc=1), parts[0]) is False
    assert box.put(meta(1, 6), delta(1, 9)) is False  # another fragment: its own entry
    assert box.put(meta(0, 8, base=1, steps=3, tokens=30, inc=1), parts[1]) is True
    assert box.put(meta(0, 12, base=3, steps=5, tokens=50, inc=2), parts[2]) is True
    queued = box.queued()
    assert [m.fragment for m in queued] == [0, 1]  # the sum keeps the first one's place
    summed = queued[0]
    assert (summed.steps, summed.tokens) == (12, 120)
    assert summed.base_version == 1  # the oldest base among them
    assert (summed.incarnation, summed.learner_step) == (2, 12)  # the newest one's order
    head = box.take(timeout=0)
    assert head is not None and head.handovers == 3
    assert head.delta["w0"].dtype == torch.float32
    expected = sum(d["w0"].float() for d in parts)
    assert torch.equal(head.delta["w0"], expected)  # exact: bf16 values add exactly in fp32
    sent = codec.decode(joined(head))
    assert sent["w0"].dtype == torch.float32 and torch.equal(sent["w0"], expected)
    assert UpdateMeta.from_metadata(codec.read_metadata(joined(head))) == summed
    lone = box.take(timeout=0)  # the head again: fragment 1 waits behind it
    assert lone is head
    box.settle(head, "accepted")
    lone = box.take(timeout=0)
    assert lone is not None and lone.meta.fragment == 1
    assert lone.delta["w1"].dtype == torch.bfloat16  # a lone update goes out as handed over
    ledger = box.ledger()
    assert ledger[0]["put_handovers"] == 3 and ledger[0]["summed"] == 2
    assert ledger[0]["accepted_tokens"] == 120 and ledger[0]["queued_tokens"] == 0
    assert ledger[1]["queued_tokens"] == 40
    assert_balanced(ledger)


def test_an_attempted_entry_is_never_summed_into_and_is_resent_as_is() -> None:
    box = Outbox(1)
    box.put(meta(0, 4), delta(0, 1))
    head = box.take(timeout=0)
    assert head is not None
    first_meta, first_bytes = head.meta, joined(head)
    assert box.put(meta(0, 8), delta(0, 2)) is False  # appended behind, not summed in
    assert box.put(meta(0, 12), delta(0, 3)) is True  # summed into that unattempted one
    again = box.take(timeout=0)  # the outcome was unknown: the same entry goes again
    assert again is head and again.attempts == 2
    assert again.meta == first_meta and joined(again) == first_bytes
    assert again.encoded() is head.encoded()  # encoded once
    assert [m.learner_step for m in box.queued()] == [4, 12]
    box.settle(again, "duplicate")  # its first attempt had landed
    nxt = box.take(timeout=0)
    assert nxt is not None and (nxt.meta.learner_step, nxt.meta.steps) == (12, 8)
    ledger = box.ledger()[0]
    assert (ledger["duplicate_tokens"], ledger["queued_tokens"], ledger["attempts"]) == (40, 80, 3)
    assert_balanced(box.ledger())


def test_out_of_order_puts_and_settling_a_non_head_are_refused() -> None:
    box = Outbox(2)
    box.put(meta(0, 8, inc=1), delta(0, 1))
    with pytest.raises(ValueError, match="increasing order"):
        box.put(meta(0, 8, inc=1), delta(0, 2))
    with pytest.raises(ValueError, match="increasing order"):
        box.put(meta(0, 12, inc=0), delta(0, 2))  # an older incarnation, a later step
    box.put(meta(0, 2, inc=2), delta(0, 3))  # a new incarnation starts its steps again
    box.put(meta(1, 3), delta(1, 4))
    with pytest.raises(ValueError, match="other tensors"):
        box.put(meta(1, 5), delta(0, 5))
    head = box.take(timeout=0)
    assert head is not None
    with pytest.raises(ValueError, match="head"):
        box.settle(Entry(meta(1, 3), {}), "accepted")
    with pytest.raises(ValueError, match="definitive"):
        box.settle(head, "superseded")  # type: ignore[arg-type]
    assert box.take(timeout=0.01) is head  # nothing was settled: the head is still there
    assert_balanced(box.ledger())
    assert box.ledger()[0]["put_handovers"] == 2  # the refused puts were not counted


def test_fifo_keeps_each_fragments_order_and_the_sums_under_concurrency() -> None:
    box, rng = Outbox(3), random.Random(7)
    put_sum = {p: torch.zeros(8) for p in range(3)}
    sent_sum = {p: torch.zeros(8) for p in range(3)}
    sent_order: dict[int, list[tuple[int, int]]] = {p: [] for p in range(3)}
    done = threading.Event()

    def producer() -> None:
        inc = 1
        for step in range(1, 301):
            if step == 150:
                inc = 2  # a re-join mid-run: the order continues in the new incarnation
            p = rng.randrange(3)
            d = delta(p, step)
            put_sum[p] += d[f"w{p}"].float()
            box.put(meta(p, step, steps=1, tokens=10, inc=inc), d)
            if step % 7 == 0:
                time.sleep(0.001)
        done.set()

    def consumer() -> None:
        fate = random.Random(11)
        while not (done.is_set() and not box.queued()):
            e = box.take(timeout=0.05)
            if e is None:
                continue
            if fate.random() < 0.3:
                continue  # outcome unknown: it must come back as the head, unchanged
            got = codec.decode(joined(e))
            p = e.meta.fragment
            sent_order[p].append(e.meta.order())
            sent_sum[p] += got[f"w{p}"].float()
            box.settle(e, "accepted")

    threads = [threading.Thread(target=f) for f in (producer, consumer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    ledger = box.ledger()
    for p in range(3):
        assert sent_order[p] == sorted(set(sent_order[p]))  # strictly increasing
        assert torch.allclose(sent_sum[p], put_sum[p], atol=1e-6)  # nothing lost or doubled
        assert ledger[p]["accepted_tokens"] == ledger[p]["put_tokens"] > 0
    assert sum(r["put_handovers"] for r in ledger.values()) == 300
    assert_balanced(ledger)


class FakeClient:
    """Stands in for SyncClient in the upload thread: answers from a script per call."""

    script: ClassVar[list[Callable[[UpdateMeta], int | str | None]]] = []
    calls: ClassVar[list[bytes]] = []

    def __init__(self, *args: object, **kw: object) -> None:
        self.bytes_up = self.bytes_down = 0
        self.base_url = str(args[0]).rstrip("/")

    def post_update(self, fragment: int, body: Body) -> UpdateResponse:
        body = body if isinstance(body, bytes) else b"".join(body)  # as SyncClient sends it
        FakeClient.calls.append(body)
        m = UpdateMeta.from_metadata(codec.read_metadata(body))
        answer = FakeClient.script.pop(0)(m) if FakeClient.script else "accepted"
        if answer is None:
            raise SyncUnavailable("connection reset")
        if isinstance(answer, int):
            raise SyncRefused(answer, "stale", "too old")
        return UpdateResponse(status=answer, fragment=m.fragment, round_version=1)


@pytest.fixture
def streamer(monkeypatch: pytest.MonkeyPatch) -> Streamer:
    monkeypatch.setattr("ddiloco.learner.streaming.SyncClient", FakeClient)
    FakeClient.script, FakeClient.calls = [], []
    s = Streamer(LearnerConfig(sync_url="http://fake", token="t"), LAYOUT, dict)
    return s


def run_uploads(s: Streamer) -> None:
    t = threading.Thread(target=s._upload_loop, daemon=True)
    t.start()
    s.threads.append(t)


def test_the_upload_thread_resends_the_same_bytes_until_answered(streamer: Streamer) -> None:
    lost, down = (lambda m: None), (lambda m: None)
    FakeClient.script = [lost, down, down, lambda m: "duplicate", lambda m: 409]
    streamer.send(meta(0, 4), delta(0, 1))
    run_uploads(streamer)
    deadline = time.time() + 10
    while len(FakeClient.calls) < 2:  # the first attempt failed: the entry is frozen
        assert time.time() < deadline
        time.sleep(0.005)
    streamer.send(meta(0, 8), delta(0, 2))  # queued behind it ...
    streamer.send(meta(1, 9), delta(1, 3))
    streamer.send(meta(0, 12), delta(0, 4))  # ... and summed into the unattempted one
    assert streamer.outbox.wait_empty(10)
    assert len(set(FakeClient.calls[:4])) == 1  # four attempts, byte for byte the same
    order = [UpdateMeta.from_metadata(codec.read_metadata(b)) for b in FakeClient.calls]
    assert [(m.fragment, m.learner_step) for m in order[3:]] == [(0, 4), (0, 12), (1, 9)]
    assert order[4].steps == 8 and order[4].tokens == 80
    results = streamer.results()
    assert results == [(0, 0, "duplicate"), (0, 0, "stale"), (1, 0, "accepted")]
    ledger = streamer.ledger()
    assert ledger[0]["duplicate_tokens"] == 40 and ledger[0]["refused_tokens"] == 80
    assert ledger[1]["accepted_tokens"] == 40 and ledger[0]["attempts"] == 5
    assert_balanced(ledger)
    assert streamer.close(drain_s=0.1) == {}


def test_close_reports_what_was_left_unanswered(streamer: Streamer) -> None:
    FakeClient.script = [lambda m: None] * 1000  # the synchronizer never answers
    run_uploads(streamer)
    streamer.send(meta(0, 4, tokens=40), delta(0, 1))
    streamer.send(meta(1, 6, tokens=30), delta(1, 2))
    t0 = time.monotonic()
    left = streamer.close(drain_s=0.3)
    assert time.monotonic() - t0 >= 0.3  # it did wait for the drain
    assert left == {
        0: {"uploads": 1, "steps": 4, "tokens": 40},
        1: {"uploads": 1, "steps": 4, "tokens": 30},
    }
    assert streamer.left == left
    assert_balanced(streamer.ledger())


def test_an_entry_posts_its_tensors_own_bytes_without_a_joined_copy() -> None:
    """The body is the safetensors header, then views of the delta tensors themselves (the
    outbox owns them: nothing writes them once encoded); its bytes are the update encoded
    whole."""
    box = Outbox(1)
    d = {"w0": torch.randn(1000).to(torch.bfloat16)}
    box.put(meta(0, 4), d)
    head = box.take(timeout=0)
    assert head is not None
    whole = codec.encode(d, meta(0, 4).to_metadata())
    body = head.encoded()
    assert isinstance(body, list) and len(body) == 2
    view = memoryview(body[1])
    assert torch.frombuffer(view, dtype=torch.uint8).data_ptr() == d["w0"].data_ptr()
    assert b"".join(body) == whole
    assert head.delta == {}  # frozen: the parts hold the tensor
