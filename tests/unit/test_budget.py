"""The job's token budget and the slot's LR schedule, against a real synchronizer.

    pytest tests/unit/test_budget.py

The synchronizer reports progress, the time left and `finished` from its durable merged
tokens (so a restart is as finished as before), accepts work that arrives after the
budget, and answers `finished` at join and in heartbeats; shards merge into one view. A
learner that hears `finished` hands over what it holds and stops with nothing unsent, and
a replacement of a slot resumes its LR schedule where its predecessor reported it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.diloco import DecoupledDiLoCo
from ddiloco.learner.schedule import learning_rate
from ddiloco.synchronizer.budget import Budget
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.wire import codec
from ddiloco.wire.job_status import merge_statuses
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    Heartbeat,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

LAYOUT = Layout(fragments=[FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[4])])])
SyncServer = Any  # tests/conftest.py's


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path: Path, clock: Clock, **kw: object) -> Synchronizer:
    base: dict[str, object] = {
        "token": "t",
        "state_dir": tmp_path,
        "grace": False,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "max_update_ratio": 10.0,
    }
    return Synchronizer(SyncSettings(**(base | kw)), clock=clock)  # type: ignore[arg-type]


def beat(sync: Synchronizer, lid: str = "a", slot_step: int = 0) -> Any:
    return sync.heartbeat(
        Heartbeat(
            learner_id=lid,
            step=10,
            steps=[10],
            tokens=[100],
            base_versions=[0],
            step_seconds=1.0,
            slot_step=slot_step,
        )
    )


def merge_one(sync: Synchronizer, step: int) -> None:
    """One accepted update of 100 tokens from learner a, merged."""
    meta = UpdateMeta(
        learner_id="a",
        fragment=0,
        base_version=sync.versions()[0],
        steps=10,
        tokens=100,
        learner_step=step,
    )
    body = codec.encode({"w": torch.full((4,), 0.1)}, meta.to_metadata())
    assert sync.submit(body).status == "accepted"
    assert sync.merge(0) == sync.versions()[0]


def test_progress_time_left_and_finished_also_after_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, total_tokens=250)
    assert sync.join(JoinRequest(learner_id="a")).finished is False
    sync.init(codec.encode({"w": torch.zeros(4)}, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
    st = sync.status()
    assert (st.total_tokens, st.progress, st.finished) == (250, 0.0, False)
    assert st.estimated_remaining_seconds is None  # no rate before merged tokens move
    beat(sync)
    merge_one(sync, 10)
    clock.now += 10.0
    st = sync.status()
    assert st.tokens_merged == 100 and st.progress == pytest.approx(0.4)
    # 100 tokens in the 10 s since the first sample: 150 left at 10/s
    assert st.estimated_remaining_seconds == pytest.approx(15.0)
    assert beat(sync).finished is False
    merge_one(sync, 20)
    clock.now += 10.0
    merge_one(sync, 30)  # 300 >= 250: done
    st = sync.status()
    assert st.finished and st.progress == 1.0 and st.estimated_remaining_seconds == 0.0
    assert beat(sync).finished is True
    # work arriving after the budget is real work: accepted and merged, nothing lost
    merge_one(sync, 40)
    assert sync.status().tokens_merged == 400
    text = sync.metrics.render().decode()
    assert "ddiloco_job_progress_ratio 1.0" in text
    assert "ddiloco_job_remaining_seconds 0.0" in text
    sync.snapshots.abandon()  # killed: the restart reads only what is durable
    again = make(tmp_path, clock, total_tokens=250)
    st = again.status()
    assert st.finished and st.tokens_merged == 400 and st.progress == 1.0
    assert again.join(JoinRequest(learner_id="b")).finished is True


def test_no_budget_reports_none_and_serves_no_budget_gauges(tmp_path: Path) -> None:
    sync = make(tmp_path, Clock())
    sync.join(JoinRequest(learner_id="a"))
    sync.init(codec.encode({"w": torch.zeros(4)}, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
    merge_one(sync, 10)
    st = sync.status()
    assert (st.total_tokens, st.progress, st.estimated_remaining_seconds) == (0, None, None)
    assert not st.finished and not beat(sync).finished
    assert "ddiloco_job_" not in sync.metrics.render().decode()


def test_the_slot_step_is_kept_durably_and_answered_at_join(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock)
    assert sync.join(JoinRequest(learner_id="a")).slot_steps == 0
    sync.init(codec.encode({"w": torch.zeros(4)}, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
    beat(sync, slot_step=37)
    beat(sync, slot_step=12)  # a lower report never moves it back
    assert sync.join(JoinRequest(learner_id="a")).slot_steps == 37  # the replacement's
    sync.snapshots.abandon()
    again = make(tmp_path, clock)
    assert again.join(JoinRequest(learner_id="a")).slot_steps == 37
    assert again.status().learners[0].slot_steps == 37


def test_shards_finish_the_job_when_any_shard_is_finished(tmp_path: Path) -> None:
    clock = Clock()
    a = make(tmp_path / "a", clock, total_tokens=150).status()
    st = [
        a.model_copy(update={"tokens_merged": 100, "progress": 100 / 150, "shard": 0}),
        a.model_copy(update={"finished": True, "progress": 1.0, "shard": 1, "shards": 2}),
    ]
    job = merge_statuses(st)
    assert job.finished and job.progress == 1.0 and job.total_tokens == 150
    assert job.estimated_remaining_seconds == 0.0
    st[1] = st[1].model_copy(
        update={"finished": False, "progress": 0.5, "estimated_remaining_seconds": 7.0}
    )
    job = merge_statuses(st)
    assert not job.finished and job.estimated_remaining_seconds == 7.0


def test_the_rate_counts_a_stall_and_forgets_old_samples() -> None:
    b = Budget(1000, window_s=10.0)
    assert b.remaining_seconds(0, 0.0) is None
    b.observe(0, 0.0)
    b.observe(100, 5.0)
    assert b.rate(5.0) == pytest.approx(20.0)
    assert b.rate(10.0) == pytest.approx(10.0)  # nothing merged since: slower
    b.observe(300, 20.0)
    b.observe(400, 25.0)  # the samples before 15.0 are older than the window now
    assert list(b.samples) == [(20.0, 300), (25.0, 400)]
    assert b.remaining_seconds(400, 25.0) == pytest.approx(600 / 20.0)


# ---- the learner's side ----------------------------------------------------------
TOKENS = 10


def learner(
    server: SyncServer, records: list[dict[str, Any]] | None = None, **kw: Any
) -> tuple[nn.Module, torch.optim.Optimizer, DecoupledDiLoCo]:
    model = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    cfg = LearnerConfig(
        sync_url=server.url,
        token=server.token,
        learner_id="l0",
        h=4,
        num_fragments=1,
        update_encoding="float32",
        poll_s=0.2,
        **kw,
    )
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sink = records.append if records is not None else None
    return model, opt, DecoupledDiLoCo(model, opt, cfg, tokens_per_step=TOKENS, steplog=sink)


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for w in model.parameters():
        w.grad = torch.full_like(w, -1.0)
    opt.step()


def test_a_learner_that_hears_finished_hands_everything_over_and_stops(
    make_sync_server: Callable[..., SyncServer],
) -> None:
    server = make_sync_server(
        quorum=1, grace=False, outer_lr=1.0, outer_momentum=0.0, max_update_ratio=10.0,
        total_tokens=40,
    )  # fmt: skip
    model, opt, diloco = learner(server)
    deadline = time.time() + 20
    with diloco:
        while not diloco.should_stop:
            assert time.time() < deadline, "the learner never heard the job was finished"
            step(model, opt)
            time.sleep(0.02)
        s = diloco.stats()
    assert s["stop_reason"] == "finished"
    assert diloco.streamer is not None and diloco.left_at_close == {}
    row, out = diloco.ledger()[0], diloco.streamer.ledger()[0]
    assert row["not_handed_over_tokens"] == 0 and out["queued_tokens"] == 0
    assert out["accepted_tokens"] == row["computed_tokens"] == s["steps"] * TOKENS
    status = server.client().status()
    assert status.finished and status.tokens_merged >= 40
    # a process that joins the finished job stops before its first step
    _, _, late = learner(server)
    with late:
        assert late.should_stop and late.stats()["stop_reason"] == "finished"


def test_a_replacement_resumes_the_slots_lr_schedule(
    make_sync_server: Callable[..., SyncServer],
) -> None:
    server = make_sync_server(quorum=1, grace=False, max_update_ratio=10.0)
    cfg = LearnerConfig(warmup_steps=20, inner_lr=1e-3)
    first: list[dict[str, Any]] = []
    model, opt, diloco = learner(server, first, max_steps=30)
    with diloco:
        assert diloco.resume_step == 0
        while not diloco.should_stop:
            for g in opt.param_groups:  # as train.py sets it
                g["lr"] = learning_rate(cfg, diloco.slot_step, diloco.progress())
            step(model, opt)
        deadline = time.time() + 10
        while server.client().status().learners[0].slot_steps < 30:  # its last heartbeat
            assert time.time() < deadline
            time.sleep(0.05)
    steps = [r for r in first if "dt" in r]
    assert steps[0]["slot_step"] == 1 and steps[0]["lr"] == pytest.approx(1e-3 / 20)
    second: list[dict[str, Any]] = []
    model, opt, diloco = learner(server, second, max_steps=3)  # the slot's replacement
    with diloco:
        assert diloco.resume_step == 30
        while not diloco.should_stop:
            for g in opt.param_groups:
                g["lr"] = learning_rate(cfg, diloco.slot_step, diloco.progress())
            step(model, opt)
    steps = [r for r in second if "dt" in r]
    assert [r["slot_step"] for r in steps] == [31, 32, 33]
    assert all(r["lr"] == pytest.approx(1e-3) for r in steps)  # no second warm-up
    assert diloco.stats()["incarnation"] == 2


def test_the_status_line_shows_progress_and_the_time_left(tmp_path: Path) -> None:
    from ddiloco.cli.statusview import summary_line

    st = make(tmp_path, Clock(), total_tokens=1_000_000).status()
    assert "budget" not in summary_line(st.model_copy(update={"total_tokens": 0}))
    line = summary_line(
        st.model_copy(update={"progress": 0.425, "estimated_remaining_seconds": 185.0})
    )
    assert "budget 42.5% of 1,000,000 tokens, ~3m05s left" in line
    assert "? left" in summary_line(st.model_copy(update={"progress": 0.1}))
    done = st.model_copy(update={"finished": True, "progress": 1.0, "tokens_merged": 1_000_512})
    assert "budget reached: 1,000,512 of 1,000,000 tokens merged (finished)" in summary_line(done)
