"""The learner's side of a round against a real synchronizer on loopback.

    pytest tests/unit/test_diloco.py

The wrapper hooks a real optimizer (SGD with lr 1 and a gradient of -1: every weight moves
by +1 per `opt.step()`), so the loop below calls nothing of it. Deltas never overlap (each
hand-over sends the progress since the previous one), a merged fragment is adopted by
rebasing the steps taken since the hand-over on it (or, with `overwrite`, by dropping them),
a round's request is answered only once enough steps stand behind the fragment, after which
the schedule runs from that hand-over; a budget or a preemption notice stops the loop after
the step it came in, and a preempted learner hands every fragment's work over first.
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
from ddiloco.wire.protocol import JoinRequest, UpdateMeta

SyncServer = Any  # tests/conftest.py's, served over h2c on loopback
TOKENS = 10


@pytest.fixture
def server(make_sync_server: Callable[..., SyncServer]) -> SyncServer:
    # pure averaging (eta 1, mu 0), no grace: the global copy is exactly what was sent; the
    # toy steps move each weight by up to 4, past the default norm guard of an RMS of 2
    return make_sync_server(
        quorum=1, grace=False, outer_lr=1.0, outer_momentum=0.0, max_update_ratio=10.0
    )


def learner(
    server: SyncServer, layers: int = 1, records: list[dict[str, Any]] | None = None, **kw: Any
) -> tuple[nn.Module, torch.optim.Optimizer, DecoupledDiLoCo]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(layers)])
    with torch.no_grad():
        for w in model.parameters():
            w.zero_()
    cfg = LearnerConfig(
        sync_url=server.url,
        token=server.token,
        learner_id="l0",
        h=4,
        num_fragments=layers,
        update_encoding="float32",
        poll_s=0.2,
        **kw,
    )
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sink = records.append if records is not None else None
    return model, opt, DecoupledDiLoCo(model, opt, cfg, tokens_per_step=TOKENS, steplog=sink)


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """An inner step: a gradient of -1 everywhere, so SGD moves every weight by +1."""
    for w in model.parameters():
        w.grad = torch.full_like(w, -1.0)
    opt.step()  # the wrapper's hook runs here


def weight(model: nn.Module) -> torch.Tensor:
    return model[0].weight


def wait_arrival(diloco: DecoupledDiLoCo) -> None:
    assert diloco.streamer is not None
    deadline = time.time() + 10
    while diloco.streamer.arrived.empty():
        assert time.time() < deadline, "the merged fragment never arrived"
        time.sleep(0.01)


def global_weight(server: SyncServer, p: int = 0) -> torch.Tensor:
    _, tensors = server.client().fragment(p)
    return next(iter(tensors.values())).float()


@pytest.mark.parametrize("adoption", ["rebase", "overwrite"])
def test_hand_over_merge_and_adoption(server: SyncServer, adoption: str) -> None:
    model, opt, diloco = learner(server, adoption=adoption)
    with diloco:
        for _ in range(4):  # fragment 0 falls due at step H = 4
            step(model, opt)
        assert diloco.stats()["handovers"] == 1
        assert diloco.c_steps == [0]  # the counters went out with the delta
        for _ in range(2):  # the overlap: training goes on while the round merges
            step(model, opt)
        wait_arrival(diloco)
        assert torch.allclose(global_weight(server), torch.full((4, 4), 4.0))
        step(model, opt)  # the 7th step folds in the merged copy
        assert diloco.base_version == [1]
        if adoption == "rebase":  # the 3 steps since the hand-over are kept
            assert torch.allclose(weight(model), torch.full((4, 4), 7.0))
            assert diloco.c_steps == [3]
        else:  # overwritten: they are gone
            assert torch.allclose(weight(model), torch.full((4, 4), 4.0))
            assert diloco.c_steps == [0]
        step(model, opt)  # step 8: due again, H after the previous hand-over
        assert diloco.stats()["handovers"] == 2
        deadline = time.time() + 10
        while server.client().status().fragments[0].version < 2:  # published
            assert time.time() < deadline
            time.sleep(0.01)
        # the second delta holds only what came after the first: nothing is counted twice
        expected = 8.0 if adoption == "rebase" else 5.0
        assert torch.allclose(global_weight(server), torch.full((4, 4), expected))
        assert server.client().status().tokens_merged == (80 if adoption == "rebase" else 50)
        # every token computed is accounted for: handed over (and accepted), or dropped by
        # the overwrite at step 7 (the 3 steps since the first hand-over)
        assert diloco.streamer is not None
        mine, outbox = diloco.ledger()[0], diloco.streamer.ledger()[0]
        dropped = 0 if adoption == "rebase" else 30
        assert mine["computed_tokens"] == 80 and mine["not_handed_over_tokens"] == 0
        assert mine["dropped_by_overwrite_tokens"] == dropped
        assert mine["handed_over_tokens"] == outbox["put_tokens"] == 80 - dropped
        assert outbox["accepted_tokens"] == 80 - dropped and outbox["queued_tokens"] == 0


def test_a_request_is_answered_only_with_enough_steps_behind_it(
    make_sync_server: Callable[..., SyncServer],
) -> None:
    server = make_sync_server(quorum=2, grace=False)
    model, opt, diloco = learner(server)
    with diloco:
        assert diloco.streamer is not None
        other = server.client()
        other.join(JoinRequest(learner_id="l1"))
        meta = UpdateMeta(
            learner_id="l1", fragment=0, base_version=0, steps=4, tokens=40, learner_step=4
        )
        other.upload(meta, {"0.weight": torch.ones(4, 4)})  # a round of 0 is now collecting
        step(model, opt)
        deadline = time.time() + 10
        while 0 not in diloco.streamer.requested:  # the long poll tells l0 about it
            assert time.time() < deadline, "l0 was never asked for fragment 0"
            time.sleep(0.01)
        assert diloco.stats()["handovers"] == 0  # 1 step behind it: not worth a merge yet
        step(model, opt)  # 2 steps = H/2: answered
        assert diloco.stats()["handovers"] == 1
        assert diloco.ledger()[0]["handed_over_tokens"] == 20
        assert diloco.streamer.outbox.wait_empty(10)
        assert diloco.streamer.ledger()[0]["accepted_tokens"] == 20
        assert diloco.next_due == [2 + 4]  # the schedule now runs from this hand-over
        while server.client().status().merges < 1:  # quorum 2 reached
            assert time.time() < deadline
            time.sleep(0.01)


def test_stats_and_step_records_come_from_the_hook(server: SyncServer) -> None:
    records: list[dict[str, Any]] = []
    model, opt, diloco = learner(server, records=records, max_steps=5)
    with diloco:
        steps = 0
        while not diloco.should_stop:
            diloco.report_loss(1.5 - steps / 10)
            time.sleep(0.01)  # the "compute" between two hooks
            step(model, opt)
            steps += 1
        s = diloco.stats()
    assert steps == 5 and s["stop_reason"] == "max_steps"
    assert (s["steps"], s["tokens"], s["handovers"], s["world"]) == (5, 5 * TOKENS, 1, 1)
    assert s["step_seconds"] >= 0.01 and s["compute_seconds"] >= 0.05
    assert s["incarnation"] == 1 and s["bytes_up"] > 0 and s["bytes_down"] > 0
    rows = [r for r in records if "event" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["loss"] == 1.5 and all(r["dt"] >= 0.01 for r in rows)
    events = [(r["event"], r["fragment"], r["step"]) for r in records if "event" in r]
    assert events[:2] == [("adopt", 0, 0), ("handover", 0, 4)]  # join, then due at H
    assert set(events[2:]) <= {("adopt", 0, 5)}  # the merge may come back in time


def test_a_preempted_learner_hands_everything_over_after_its_step(server: SyncServer) -> None:
    model, opt, diloco = learner(server, layers=2)  # P = 2: due at steps 4 and 2, then +H
    with diloco:
        for _ in range(6):  # fragment 1 handed over at steps 2 and 6, fragment 0 at 4
            step(model, opt)
        assert diloco.c_steps == [2, 0] and not diloco.should_stop
        diloco.request_stop()  # SIGTERM arrives during step 7
        step(model, opt)
        assert diloco.should_stop and diloco.stats()["stop_reason"] == "preempted"
        assert diloco.c_steps == [0, 0]  # both went out at once, neither was due
    assert diloco.streamer is not None and diloco.left_at_close == {}
    for p, row in diloco.ledger().items():
        out = diloco.streamer.ledger()[p]
        assert row["not_handed_over_tokens"] == 0 and out["queued_tokens"] == 0
        assert out["accepted_tokens"] == row["computed_tokens"] == 7 * TOKENS
    status = server.client().status()
    assert [f.tokens_merged + f.tokens_pending for f in status.fragments] == [70, 70]


def test_the_hook_is_removed_on_exit(server: SyncServer) -> None:
    model, opt, diloco = learner(server)
    with diloco:
        step(model, opt)
    step(model, opt)  # an optimizer step after the wrapper left is not accounted
    assert diloco.stats()["steps"] == 1
