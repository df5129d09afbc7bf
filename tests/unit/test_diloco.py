"""The learner's side of a round against a real synchronizer on loopback.

    pytest tests/unit/test_diloco.py

Deltas never overlap (each hand-over sends the progress since the previous one), a merged
fragment is adopted by rebasing the steps taken since the hand-over on it (or, with
`overwrite`, by dropping them), and a round's request is answered only once enough steps
stand behind the fragment, after which the schedule runs from that hand-over.
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
from ddiloco.synchronizer.protocol import JoinRequest, UpdateMeta

SyncServer = Any  # tests/conftest.py's, served over h2c on loopback


@pytest.fixture
def server(make_sync_server: Callable[..., SyncServer]) -> SyncServer:
    # pure averaging (eta 1, mu 0), no grace: the global copy is exactly what was sent; the
    # toy steps move each weight by up to 4, past the default norm guard of an RMS of 2
    return make_sync_server(
        quorum=1, grace=False, outer_lr=1.0, outer_momentum=0.0, max_update_ratio=10.0
    )


def learner(server: SyncServer, **kw: object) -> tuple[nn.Linear, DecoupledDiLoCo]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    cfg = LearnerConfig(
        sync_url=server.url,
        token=server.token,
        learner_id="l0",
        h=4,
        num_fragments=1,
        wire_dtype="float32",
        poll_s=0.2,
        **kw,  # type: ignore[arg-type]
    )
    return model, DecoupledDiLoCo(model, cfg)


def step(model: nn.Linear, diloco: DecoupledDiLoCo) -> None:
    """A stand-in inner step: every weight moves by +1."""
    with torch.no_grad():
        model.weight.add_(1.0)
    diloco.after_step(tokens=10, seconds=0.01)


def wait_arrival(diloco: DecoupledDiLoCo) -> None:
    deadline = time.time() + 10
    while diloco.streamer.arrived.empty():
        assert time.time() < deadline, "the merged fragment never arrived"
        time.sleep(0.01)


def global_weight(server: SyncServer) -> torch.Tensor:
    _, tensors = server.client().fragment(0)
    return tensors["weight"]


@pytest.mark.parametrize("adoption", ["rebase", "overwrite"])
def test_hand_over_merge_and_adoption(server: SyncServer, adoption: str) -> None:
    model, diloco = learner(server, adoption=adoption)
    with diloco:
        for _ in range(4):  # fragment 0 falls due at step H = 4
            step(model, diloco)
        assert diloco.stats["handovers"] == 1
        assert diloco.c_steps == [0]  # the counters went out with the delta
        for _ in range(2):  # the overlap: training goes on while the round merges
            step(model, diloco)
        wait_arrival(diloco)
        assert torch.allclose(global_weight(server), torch.full((4, 4), 4.0))
        step(model, diloco)  # the 7th step folds in the merged copy
        assert diloco.base_version == [1]
        if adoption == "rebase":  # the 3 steps since the hand-over are kept
            assert torch.allclose(model.weight, torch.full((4, 4), 7.0))
            assert diloco.c_steps == [3]
        else:  # overwritten: they are gone
            assert torch.allclose(model.weight, torch.full((4, 4), 4.0))
            assert diloco.c_steps == [0]
        step(model, diloco)  # step 8: due again, H after the previous hand-over
        assert diloco.stats["handovers"] == 2
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
    model, diloco = learner(server)
    with diloco:
        other = server.client()
        other.join(JoinRequest(learner_id="l1"))
        meta = UpdateMeta(
            learner_id="l1", fragment=0, base_version=0, steps=4, tokens=40, learner_step=4
        )
        other.upload(meta, {"weight": torch.ones(4, 4)})  # a round of 0 is now collecting
        step(model, diloco)
        deadline = time.time() + 10
        while 0 not in diloco.streamer.requested:  # the long poll tells l0 about it
            assert time.time() < deadline, "l0 was never asked for fragment 0"
            time.sleep(0.01)
        assert diloco.stats["handovers"] == 0  # 1 step behind it: not worth a merge yet
        step(model, diloco)  # 2 steps = H/2: answered
        assert diloco.stats["handovers"] == 1
        assert diloco.ledger()[0]["handed_over_tokens"] == 20
        assert diloco.streamer.outbox.wait_empty(10)
        assert diloco.streamer.ledger()[0]["accepted_tokens"] == 20
        assert diloco.next_due == [2 + 4]  # the schedule now runs from this hand-over
        while server.client().status().merges < 1:  # quorum 2 reached
            assert time.time() < deadline
            time.sleep(0.01)
