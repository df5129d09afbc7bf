"""A learner cut off from a real synchronizer for many hand-overs loses no work.

    pytest tests/e2e/test_outbox_outage.py -m e2e

The synchronizer is served in-process on loopback (tests/conftest.py) behind the partition
relay (local/netcut.py). While the link is cut the learner trains on and hands fragments
over several times; the outbox keeps the unanswered upload and sums the hand-overs queued
behind it. Once the link heals every token handed over is accepted by the synchronizer,
none refused and none dropped, and the learner's ledger balances.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.diloco import DecoupledDiLoCo
from ddiloco.learner.train import ledger_record
from ddiloco.local.netcut import CutProxy
from ddiloco.wire.protocol import UpdateMeta

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
SyncServer = Any  # tests/conftest.py's
H, P, TOKENS = 4, 2, 10


def step(model: nn.Module, opt: torch.optim.Optimizer, n: int, pause: float = 0.0) -> None:
    """Stand-in inner steps: every weight moves a little (the wrapper hooks opt.step)."""
    for _ in range(n):
        for w in model.parameters():
            w.grad = torch.randn_like(w) * 1e-2
        opt.step()
        time.sleep(pause)


def test_no_work_is_dropped_across_an_outage(make_sync_server: Callable[..., SyncServer]) -> None:
    server = make_sync_server(quorum=1, grace=False)
    proxy = CutProxy(int(server.url.rsplit(":", 1)[1]))
    proxy.start()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))  # P = 2
    cfg = LearnerConfig(
        sync_url=proxy.url,
        token=server.token,
        learner_id="l0",
        h=H,
        num_fragments=P,
        update_encoding="bfloat16",
        poll_s=0.2,
    )
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    diloco = DecoupledDiLoCo(model, opt, cfg, tokens_per_step=TOKENS)
    assert diloco.streamer is not None
    sent: list[UpdateMeta] = []
    put = diloco.streamer.outbox.put

    def spy(m: UpdateMeta, d: dict[str, torch.Tensor]) -> bool:
        sent.append(m)
        return put(m, d)

    diloco.streamer.outbox.put = spy  # type: ignore[method-assign]
    try:
        with diloco:
            outbox = diloco.streamer.outbox
            step(model, opt, 2 * H)
            assert outbox.wait_empty(10), outbox.queued()
            before = diloco.streamer.ledger()
            assert all(r["accepted_tokens"] == r["put_tokens"] > 0 for r in before.values())

            proxy.cut()
            step(model, opt, H, pause=0.05)  # the upload thread tries and fails meanwhile
            step(model, opt, 5 * H)  # more hand-overs of each fragment, all unanswered
            during = diloco.streamer.ledger()
            for p, r in during.items():
                assert r["put_handovers"] - before[p]["put_handovers"] >= 5
                assert r["accepted_tokens"] == before[p]["accepted_tokens"]  # cut off
                assert r["summed"] >= 3  # the later hand-overs were summed while waiting
            assert 1 <= len(outbox.queued()) <= P + 1  # bounded: at most one frozen head

            proxy.restore()
            assert outbox.wait_empty(30), outbox.queued()
            step(model, opt, 1)
    finally:
        proxy.close()
    assert diloco.left_at_close == {}
    assert all(m.incarnation == diloco.streamer.incarnation >= 1 for m in sent)
    after = diloco.streamer.ledger()
    for p, r in after.items():
        assert r["refused_tokens"] == r["queued_tokens"] == 0, r
        assert r["accepted_tokens"] + r["duplicate_tokens"] == r["put_tokens"], r
        assert r["put_tokens"] == diloco.ledger()[p]["handed_over_tokens"]
    for row in ledger_record(diloco):
        assert row["balanced"], row
        assert row["computed_tokens"] == (8 * H + 1) * TOKENS
