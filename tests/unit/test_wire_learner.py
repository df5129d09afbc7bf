"""The learner's int4 / int8 hand-overs against a real synchronizer on loopback (learner/diloco.py).

    .venv/bin/pytest -q tests/unit/test_wire_learner.py

Error feedback as the learner runs it: after each quantized hand-over the anchor has moved by
exactly what the synchronizer decodes, so theta - anchor is what quantization dropped (and
goes out next time); with eta 1 and no momentum the global fragment is the sum of what was
sent, which stays within half a block scale of the learner's own parameters, however many
hand-overs. A learner whose encoding the synchronizer does not accept stops at join.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from ddiloco.cli.errors import UsageError
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.diloco import DecoupledDiLoCo

SyncServer = Any  # tests/conftest.py's, served over h2c on loopback


def learner(
    server: SyncServer, encoding: str, **kw: Any
) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = nn.Sequential(nn.Linear(64, 8, bias=False))
    with torch.no_grad():
        model[0].weight.zero_()
    cfg = LearnerConfig(
        sync_url=server.url,
        token=server.token,
        learner_id="l0",
        h=2,
        num_fragments=1,
        update_encoding=encoding,  # type: ignore[arg-type]
        update_block=32,
        poll_s=0.2,
        **kw,
    )
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    return model, opt, DecoupledDiLoCo(model, opt, cfg, tokens_per_step=10)


def wait_version(server: SyncServer, version: int) -> None:
    deadline = time.time() + 10
    while server.client().status().fragments[0].version < version:
        assert time.time() < deadline, "the merge never came"
        time.sleep(0.01)


@pytest.mark.parametrize("encoding", ["int4", "int8"])
def test_quantized_hand_overs_carry_what_was_dropped(
    make_sync_server: Callable[..., SyncServer], encoding: str
) -> None:
    server = make_sync_server(
        quorum=1,
        grace=False,
        outer_lr=1.0,
        outer_momentum=0.0,
        merge="mean",
        max_update_ratio=100.0,
        update_encodings=[encoding],
        broadcast_encoding="float32",  # the global copy is read back exactly: the anchor
    )
    model, opt, diloco = learner(server, encoding)
    g = torch.Generator().manual_seed(3)
    w = model[0].weight
    qmax = 7 if encoding == "int4" else 127
    with diloco:
        for k in range(1, 9):
            before = diloco.base[0]["0.weight"].clone()  # the anchor the delta starts from
            for _ in range(2):  # H = 2: a hand-over every other step (the first folds in)
                w.grad = torch.randn(w.shape, generator=g) * 0.1
                opt.step()
            assert diloco.stats()["handovers"] == k and diloco.base_version == [k - 1]
            anchor = diloco.base[0]["0.weight"]
            target = (w.detach() - before).abs()  # what this hand-over had to send
            residual = (w.detach() - anchor).abs()  # what it dropped, kept for the next
            # a block's scale is at most the target's absmax / qmax: half of it is dropped
            assert 0 < float(residual.max()) <= float(target.max()) / (2 * qmax) + 1e-7
            wait_version(server, k)
            _, tensors = server.client().fragment(0)
            glob = tensors["0.weight"]
            # the global copy is exactly the sum of what was sent: the anchor
            assert torch.allclose(glob, anchor, atol=1e-6)
            # and within the last residual of the learner's own parameters (not growing)
            assert float((glob - w.detach()).abs().max()) <= float(residual.max()) + 1e-6
            deadline = time.time() + 10
            while diloco.streamer.arrived.empty():  # folded in by the next step
                assert time.time() < deadline, "the merged fragment never arrived"
                time.sleep(0.01)
    assert server.client().status().refusals == {}


def test_a_learner_refused_its_encoding_stops_at_join(
    make_sync_server: Callable[..., SyncServer],
) -> None:
    server = make_sync_server(update_encodings=["bfloat16"])
    _, _, diloco = learner(server, "int4")
    with pytest.raises(UsageError, match=r"accepts update encodings bfloat16.*is int4"), diloco:
        pass


def test_quantized_hand_overs_behind_an_outage_stay_bounded_and_lose_nothing(
    make_sync_server: Callable[..., SyncServer],
) -> None:
    """The synchronizer goes away: a quantized update cannot be summed in the outbox, so the
    learner defers the fragment's hand-overs while one is queued unsent. The outbox holds at
    most two (the one retried, one queued), and every step computed is in what was accepted,
    what is queued, or what the parameters still hold for the next hand-over."""
    from tests.conftest import stop_sync_server

    server = make_sync_server(
        quorum=1, grace=False, max_update_ratio=100.0, update_encodings=["int8"]
    )
    model, opt, diloco = learner(server, "int8", drain_s=0.5)  # the close cannot deliver
    w = model[0].weight
    g = torch.Generator().manual_seed(5)

    def step() -> None:
        w.grad = torch.randn(w.shape, generator=g) * 0.1
        opt.step()

    with diloco:
        for _ in range(2):
            step()
        wait_version(server, 1)
        stop_sync_server(server)
        for _ in range(40):  # 20 hand-overs due at H = 2
            step()
            assert diloco.streamer.outbox.depth() <= 2
            time.sleep(0.01)
        assert diloco.stats()["deferred"] > 0
        (row,) = diloco.streamer.ledger().values()
        # put = accepted + queued; what is not put is still in the parameters (c_steps)
        assert row["put_steps"] == row["accepted_steps"] + row["queued_steps"]
        assert row["put_steps"] + diloco.c_steps[0] == diloco.step
        assert diloco.c_steps[0] > 2  # deferred work, carried by the next hand-over
