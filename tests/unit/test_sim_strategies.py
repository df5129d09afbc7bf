"""Goodput accounting of the four methods: uptime, barrier, merged work, whole runs.

.venv/bin/pytest tests/unit/test_sim_strategies.py
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ddiloco.simulator.config import FailureConfig, RunConfig
from ddiloco.simulator.paper import COLUMNS, PAPER, ROWS, format_table, max_deviation
from ddiloco.simulator.strategies import (
    barrier_rounds,
    coverage,
    learner_timelines,
    merged_work,
    simulate,
    split_chips,
)


def fake(intervals: list[tuple[float, float]], step_s: float = 1.0) -> Any:
    return SimpleNamespace(run_intervals=[(a, b, 1.0) for a, b in intervals], step_s=step_s)


STEADY = fake([(0, 100)])
GAPPY = fake([(0, 30), (50, 100)])


def test_coverage_counts_time_with_enough_learners_computing() -> None:
    assert coverage([STEADY, GAPPY], 1, 100.0) == pytest.approx(1.0)
    assert coverage([STEADY, GAPPY], 2, 100.0) == pytest.approx(0.8)


def test_barrier_makes_everyone_wait_for_the_learner_that_is_down() -> None:
    # blocks of 10 s: done at 10, 20, 30, then the gappy learner finishes its 4th at 60,
    # then 70, 80, 90, 100: eight blocks of 10 chip-s on each of two learners.
    assert barrier_rounds([STEADY, GAPPY], H=10, horizon=100.0) == pytest.approx(160.0)
    # a 5 s merge after each block leaves room for fewer blocks.
    assert barrier_rounds([STEADY, GAPPY], H=10, horizon=100.0, sync_s=5.0) < 160.0


def test_a_job_becomes_a_learner_stepping_inside_its_computing_intervals() -> None:
    half = fake([(0, 30), (50, 100)])
    half.run_intervals[1] = (50, 100, 0.5)  # resumed on half its chips
    (tl,) = learner_timelines([half])
    (inc,) = tl.incarnations
    assert inc.times.tolist() == [*range(1, 31), *range(51, 101)]
    assert inc.cum[-1] == 30 * 1.0 + 50 * 0.5  # tokens: the chips behind each step


def test_a_learner_that_misses_rounds_keeps_its_work_unless_it_is_too_stale() -> None:
    # GAPPY is away 20 s (a reconfiguration: it still heartbeats). With H = 10 steps it
    # misses two rounds of each fragment; what it hands over after the gap merges, and the
    # only loss is what nobody handed over by the end.
    r = merged_work([STEADY, GAPPY], quorum=1, H=10, fragments=2, tau=2, horizon=100.0)
    assert r.refused_updates == 0 and r.merged_work_ratio > 0.97
    assert r.unsent == r.computed - r.merged
    # with H = 2 the fragments merge ten times in the gap, more than max_staleness (4):
    # GAPPY's first hand-over after it is refused
    fast = merged_work([STEADY, GAPPY], quorum=1, H=2, fragments=2, tau=2, horizon=100.0)
    assert fast.refused_updates >= 1 and fast.refused > 0


def test_without_failures_every_method_has_full_goodput() -> None:
    calm = FailureConfig(chip_mtbi_s=1e15)
    run = RunConfig(chips=1000, learners=4, horizon_s=3600.0)
    for strategy in ("dp", "elastic_dp", "diloco", "decoupled"):
        r = simulate(strategy, run, calm)
        assert r.goodput == pytest.approx(1.0), strategy
        assert r.uptime == pytest.approx(1.0)
        if strategy != "decoupled":
            assert r.merged_work_ratio == 1.0 and r.protocol is None
    assert r.protocol is not None and r.protocol.late_updates == r.protocol.refused_updates == 0
    # 720 steps per learner: only what is not handed over by the end is not merged
    assert 0.98 < r.merged_work_ratio < 1.0
    assert simulate("decoupled", run, calm, replay=False).merged_work_ratio != 1.0  # nan


def test_method_ordering_under_failures() -> None:
    run = RunConfig(chips=600_000, learners=8, horizon_s=6 * 3600.0, seed=1)
    fail = FailureConfig()
    r = {s: simulate(s, run, fail) for s in ("dp", "elastic_dp", "diloco", "decoupled")}
    g = {s: x.goodput for s, x in r.items()}
    assert g["dp"] < g["elastic_dp"] < g["decoupled"]
    assert g["diloco"] < g["decoupled"]  # the barrier costs what decoupling saves
    # learners paused by reconfigurations miss rounds; their late updates still merge
    proto = r["decoupled"].protocol
    assert proto is not None and proto.late_updates > 0 and proto.refused_updates == 0
    assert r["decoupled"].merged_work_ratio > 0.99
    with pytest.raises(ValueError, match="strategy"):
        simulate("allreduce", run, fail)
    with pytest.raises(ValueError, match="fragments"):
        RunConfig(fragments=48, H=24)


def test_split_chips_and_paper_table_helpers() -> None:
    assert split_chips(10, 3) == [4, 3, 3]
    exact = {r: dict(c) for r, c in PAPER.items()}
    assert max_deviation(exact)[0] == 0.0
    off = {r: dict(c) for r, c in PAPER.items()}
    off["m8"]["1.2M"] += 0.05
    assert max_deviation(off) == (pytest.approx(5.0), "m8", "1.2M")
    assert "max deviation: 5.00 points" in format_table(off)
    assert set(ROWS) == set(PAPER) and all(set(PAPER[r]) == set(COLUMNS) for r in PAPER)
