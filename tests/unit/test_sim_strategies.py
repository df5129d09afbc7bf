"""Goodput accounting of the four methods: uptime, barrier, missed merges, whole runs.

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
    lost_to_missed_rounds,
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


def test_missed_rounds_lose_work_only_when_the_quorum_merges_without_you() -> None:
    # a 20 s gap, grace 1 s, at most H = 10 steps of work lost
    assert lost_to_missed_rounds([STEADY, GAPPY], 1, H=10, grace_s=1.0) == pytest.approx(10.0)
    assert lost_to_missed_rounds([STEADY, GAPPY], 1, H=100, grace_s=1.0) == pytest.approx(19.0)
    assert lost_to_missed_rounds([STEADY, GAPPY], 2, H=10, grace_s=1.0) == 0.0


def test_without_failures_every_method_has_full_goodput() -> None:
    calm = FailureConfig(chip_mtbi_s=1e15)
    run = RunConfig(chips=1000, learners=4, horizon_s=3600.0)
    for strategy in ("dp", "elastic_dp", "diloco", "decoupled"):
        r = simulate(strategy, run, calm)
        assert r.goodput == pytest.approx(1.0), strategy
        assert r.uptime == pytest.approx(1.0) and r.merged_work_ratio == 1.0


def test_method_ordering_under_failures() -> None:
    run = RunConfig(chips=600_000, learners=8, horizon_s=6 * 3600.0, seed=1)
    fail = FailureConfig()
    g = {s: simulate(s, run, fail).goodput for s in ("dp", "elastic_dp", "diloco", "decoupled")}
    assert g["dp"] < g["elastic_dp"] < g["decoupled"]
    assert g["diloco"] < g["decoupled"]  # the barrier costs what decoupling saves
    with pytest.raises(ValueError, match="strategy"):
        simulate("allreduce", run, fail)


def test_split_chips_and_paper_table_helpers() -> None:
    assert split_chips(10, 3) == [4, 3, 3]
    exact = {r: dict(c) for r, c in PAPER.items()}
    assert max_deviation(exact)[0] == 0.0
    off = {r: dict(c) for r, c in PAPER.items()}
    off["m8"]["1.2M"] += 0.05
    assert max_deviation(off) == (pytest.approx(5.0), "m8", "1.2M")
    assert "max deviation: 5.00 points" in format_table(off)
    assert set(ROWS) == set(PAPER) and all(set(PAPER[r]) == set(COLUMNS) for r in PAPER)
