"""Each failure mechanism on a hand-made schedule, against a hand-computed answer.

    .venv/bin/pytest tests/unit/test_sim_failures.py

Job: 100 chips in 10 slices of 10, step 10 s. Non-elastic restart 30 s; elastic shrink 5 s,
regrow 7 s, +2 s re-planning per failure during a pause, repaired slices wait at most 50 s.
"""

from __future__ import annotations

import numpy as np
import pytest

from ddiloco.simulator.config import FailureConfig, RepairConfig, RunConfig
from ddiloco.simulator.engine import EventLoop
from ddiloco.simulator.failures import Job, sample_repair

CFG = FailureConfig(
    slice_chips=10,
    step_s=10.0,
    restart_s=30.0,
    shrink_s=5.0,
    regrow_s=7.0,
    replan_s=2.0,
    regrow_batch_s=50.0,
)


def run(
    failures: list[float], repairs: list[float], *, elastic: bool, horizon: float, chips: int = 100
) -> Job:
    loop = EventLoop()
    job = Job(
        loop,
        chips,
        CFG,
        np.random.default_rng(0),
        elastic=elastic,
        failure_times=failures,
        repair_times=repairs,
    )
    job.start()
    loop.run(until=horizon)
    job.finish(horizon)
    return job


def test_no_failure_means_full_goodput() -> None:
    assert run([], [], elastic=True, horizon=100.0).goodput() == pytest.approx(1.0)


def test_non_elastic_restart() -> None:
    # failure at 25: the step 20-30 completes, restart 30-60, steps 60-100.
    job = run([25.0], [], elastic=False, horizon=100.0)
    assert job.good_chip_s == pytest.approx((30 + 40) * 100)
    assert job.goodput() == pytest.approx(0.70)


def test_failures_in_the_same_step_or_during_the_restart_are_absorbed() -> None:
    job = run([25.0, 27.0, 45.0], [], elastic=False, horizon=100.0)
    assert job.goodput() == pytest.approx(0.70)
    assert job.failures == 3 and job.pauses == 1


def test_elastic_shrink_keeps_going_with_fewer_chips() -> None:
    # step 20-30 completes without the failed slice's share (10 chips x 10 s);
    # shrink 30-35; steps 35-125 on 90 chips.
    job = run([25.0], [1000.0], elastic=True, horizon=130.0)
    assert job.good_chip_s == pytest.approx(3000 - 100 + 9 * 10 * 90)
    assert job.goodput() == pytest.approx(11000 / 13000)


def test_elastic_regrow_after_the_batching_window() -> None:
    # repaired at 45; no reconfiguration within 50 s, so a regrow at the step boundary
    # of 95 (no step lost), pause 95-102, then 100 chips: steps 102-122.
    job = run([25.0], [20.0], elastic=True, horizon=130.0)
    assert job.good_chip_s == pytest.approx(2900 + 6 * 10 * 90 + 2 * 10 * 100)
    assert job.pauses == 2


def test_repaired_slice_rides_along_with_the_next_shrink() -> None:
    # repaired at 45, second failure at 70: shrink 75-80 takes the repaired slice back in,
    # so the job resumes on 9 slices and no separate regrow pause happens.
    job = run([25.0, 70.0], [20.0, 1000.0], elastic=True, horizon=130.0)
    assert job.good_chip_s == pytest.approx(2900 + (4 * 10 * 90 - 100) + 5 * 10 * 90)
    assert job.pauses == 2


def test_failure_during_a_shrink_adds_replanning() -> None:
    # second failure at 32 lands in the 30-35 shrink: resume at 37 on 8 slices.
    job = run([25.0, 32.0], [1000.0, 1000.0], elastic=True, horizon=100.0)
    assert job.good_chip_s == pytest.approx(2900 + 6 * 10 * 80)


def test_a_job_with_no_slice_left_waits_for_the_repair() -> None:
    # one slice: failure at 25 kills it; repair at 125, regrow 125-132, steps 132-192.
    job = run([25.0], [100.0], elastic=True, horizon=200.0, chips=10)
    assert job.good_chip_s == pytest.approx((300 - 100) + 6 * 10 * 10)
    assert job.goodput() == pytest.approx(0.4)


def test_step_spread_makes_a_lock_step_job_wait_for_its_slowest_slice() -> None:
    loop = EventLoop()
    cfg = FailureConfig(slice_chips=10, step_s=10.0, step_cv=0.1, chip_mtbi_s=1e15)
    job = Job(loop, 100, cfg, np.random.default_rng(0), elastic=True)
    job.start()
    loop.run(until=1000.0)
    job.finish(1000.0)
    straggle = 1 + 0.1 * (2 * np.log(10)) ** 0.5  # expected max of 10 slices' jitter
    assert job.step_s == pytest.approx(10.0 * straggle)
    assert job.goodput() == pytest.approx((1000.0 // job.step_s) * 10.0 / 1000.0)


def test_poisson_failure_count_matches_the_rate() -> None:
    loop = EventLoop()
    cfg = FailureConfig(restart_s=0.0)
    job = Job(loop, 1_000_000, cfg, np.random.default_rng(7), elastic=False)
    job.start()
    loop.run(until=86400.0)
    expected = 1_000_000 * 86400.0 / cfg.chip_mtbi_s  # ~2740
    assert abs(job.failures - expected) < 5 * expected**0.5


def test_exponentiated_weibull_reduces_to_exponential() -> None:
    rng = np.random.default_rng(3)
    draws = sample_repair(rng, RepairConfig(scale_s=600.0, shape=1.0, alpha=1.0), 100_000)
    assert draws.mean() == pytest.approx(600.0, rel=0.02)
    assert (draws > 0).all()


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="shrink_s"):
        FailureConfig(shrink_s=-1.0)
    with pytest.raises(ValueError, match="quorum"):
        RunConfig(learners=4, quorum=5)
    with pytest.raises(ValueError, match="scale_s"):
        RepairConfig(scale_s=0.0)
