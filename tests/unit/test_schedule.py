"""The inner LR schedule: warm-up over the slot's steps, decay over the job's budget.

The pure function first (learner/schedule.py), then a learner against a real synchronizer
with a token budget: the decay it applies follows the job's merged tokens, heard at join
and on every heartbeat, and a decaying schedule with no budget is refused at join.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.group import Plan
from ddiloco.learner.schedule import (
    ScheduleError,
    budget_progress,
    check,
    decay_factor,
    learning_rate,
)
from tests.conftest import SyncServer
from tests.unit.test_budget import learner, step


def cfg(**kw: Any) -> LearnerConfig:
    return LearnerConfig(inner_lr=1.0, warmup_steps=10, **kw)


def test_warm_up_is_over_the_slots_steps_then_constant() -> None:
    c = cfg()
    assert learning_rate(c, 0, None) == pytest.approx(0.1)
    assert learning_rate(c, 4, None) == pytest.approx(0.5)
    assert learning_rate(c, 9, None) == learning_rate(c, 10_000, 0.9) == 1.0


def test_cosine_runs_from_the_peak_to_the_floor_over_the_budget() -> None:
    c = cfg(lr_schedule="cosine", min_lr_ratio=0.1)
    assert decay_factor(c, 0.0) == pytest.approx(1.0)
    assert decay_factor(c, 0.5) == pytest.approx(0.55)
    assert decay_factor(c, 1.0) == pytest.approx(0.1)
    assert learning_rate(c, 100, 0.25) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))
    )


def test_wsd_holds_the_peak_then_decays_linearly_over_its_fraction() -> None:
    c = cfg(lr_schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0)
    assert decay_factor(c, 0.5) == decay_factor(c, 0.8) == 1.0
    assert decay_factor(c, 0.9) == pytest.approx(0.5)
    assert decay_factor(c, 1.0) == pytest.approx(0.0)


@given(
    st.sampled_from(["cosine", "wsd"]),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
    st.floats(0.01, 1.0),
)
def test_a_decay_never_rises_and_stays_between_floor_and_peak(
    kind: str, a: float, b: float, fraction: float
) -> None:
    c = cfg(lr_schedule=kind, min_lr_ratio=0.2, decay_fraction=fraction)
    lo, hi = sorted((a, b))
    assert 0.2 - 1e-9 <= decay_factor(c, hi) <= decay_factor(c, lo) <= 1.0 + 1e-9


def test_the_jobs_budget_comes_before_the_learners_own() -> None:
    c = cfg(lr_schedule="cosine", max_steps=100, max_tokens=1000)
    kw = {"steps": 50, "tokens": 100}
    assert budget_progress(c, job_total_tokens=400, job_tokens_merged=100, **kw) == 0.25
    assert budget_progress(c, job_total_tokens=400, job_tokens_merged=900, **kw) == 1.0
    assert budget_progress(c, job_total_tokens=0, job_tokens_merged=0, **kw) == 0.5
    c = cfg(lr_schedule="cosine", max_tokens=1000)
    assert budget_progress(c, job_total_tokens=0, job_tokens_merged=0, **kw) == 0.1
    assert budget_progress(cfg(), job_total_tokens=0, job_tokens_merged=0, **kw) is None


def test_a_decay_without_a_budget_is_refused_by_name() -> None:
    check(cfg(), 0)  # constant needs none
    check(cfg(lr_schedule="wsd"), 10)
    check(cfg(lr_schedule="wsd", max_steps=5), 0)
    with pytest.raises(ScheduleError, match="lr_schedule cosine decays over a budget"):
        check(cfg(lr_schedule="cosine"), 0)


def test_a_groups_plan_carries_the_jobs_merged_tokens() -> None:
    plan = Plan("max_steps", [True, False, True], [0, 7, 0], tokens_merged=123_456_789_012)
    assert Plan.decode(plan.encode()) == plan


def test_a_learner_decays_with_the_jobs_merged_tokens(
    make_sync_server: Callable[..., SyncServer],
) -> None:
    server = make_sync_server(
        quorum=1, grace=False, outer_lr=1.0, outer_momentum=0.0, max_update_ratio=10.0,
        total_tokens=400,
    )  # fmt: skip
    c = LearnerConfig(inner_lr=1.0, warmup_steps=1, lr_schedule="cosine", min_lr_ratio=0.0)
    model, opt, diloco = learner(server)
    seen: list[tuple[float, float]] = []
    deadline = time.time() + 30
    with diloco:
        assert diloco.job_total_tokens == 400 and diloco.progress() == 0.0
        while not diloco.should_stop:
            assert time.time() < deadline, "the budget was never merged"
            progress = diloco.progress()
            assert progress is not None
            seen.append((progress, learning_rate(c, diloco.slot_step, progress)))
            step(model, opt)
            time.sleep(0.02)
    merged = server.client().status().tokens_merged
    assert seen[-1][0] <= min(1.0, diloco.job_tokens_merged / 400)  # the last plan's news
    assert 0 < diloco.job_tokens_merged <= merged
    progresses = [p for p, _ in seen]
    assert progresses == sorted(progresses) and progresses[-1] >= 0.5  # heard as it grew
    rates = [lr for _, lr in seen]
    assert rates == sorted(rates, reverse=True) and rates[-1] < 0.5 * rates[0]


def test_a_decaying_schedule_with_no_budget_stops_at_join(
    make_sync_server: Callable[..., SyncServer], tmp_path: Any
) -> None:
    from ddiloco.learner.train import train

    server = make_sync_server(quorum=1, grace=False)
    c = LearnerConfig(
        sync_url=server.url, token=server.token, learner_id="l0", lr_schedule="wsd",
        log_path=str(tmp_path / "l0.jsonl"), poll_s=0.2, drain_s=1.0,
    )  # fmt: skip
    with pytest.raises(ScheduleError, match=r"spec\.training\.totalTokens"):
        train(c)


def test_a_replacement_resumes_both_the_warm_up_and_the_decay_where_the_job_is(
    make_sync_server: Callable[..., SyncServer],
) -> None:
    server = make_sync_server(
        quorum=1, grace=False, outer_lr=1.0, outer_momentum=0.0, max_update_ratio=10.0,
        total_tokens=10_000,
    )  # fmt: skip
    c = LearnerConfig(inner_lr=1.0, warmup_steps=20, lr_schedule="wsd", decay_fraction=1.0)
    model, opt, diloco = learner(server, max_steps=24)
    with diloco:
        while not diloco.should_stop:
            step(model, opt)
            time.sleep(0.01)
        deadline = time.time() + 10
        while server.client().status().learners[0].slot_steps < 24:  # its last heartbeat
            assert time.time() < deadline
            time.sleep(0.05)
    merged = server.client().status().tokens_merged
    assert merged > 0
    _, _, replacement = learner(server, max_steps=1)  # the same slot, a new process
    with replacement:
        assert replacement.resume_step == 24  # past the warm-up: no second one
        assert replacement.job_tokens_merged == merged  # heard at join, before its first step
        first = learning_rate(c, replacement.slot_step, replacement.progress())
    assert first == pytest.approx(1.0 - 0.9 * merged / 10_000)  # decayed as far as the job
