"""Replaying a `ddiloco local` report: constants measured from it, a known replay.

.venv/bin/pytest tests/unit/test_sim_calibrate.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ddiloco.simulator.calibrate import (
    LearnerScenario,
    Scenario,
    calibrate,
    measure_constants,
    replay,
)

REPORT = Path(__file__).parent / "data" / "sim_local_report.json"


def test_constants_are_measured_from_the_timeline() -> None:
    k = measure_constants(json.loads(REPORT.read_text()))
    assert k.startup_s == pytest.approx(4.0)
    assert k.restart_s == pytest.approx(2.0)  # back at 23, first step at 25
    # (8.5 - 4 - 2) / 97 and (6.5 - 4) / 107: the median of two is their mean
    assert k.step_gap_s == pytest.approx((2.5 / 97 + 2.5 / 107) / 2)


def test_a_kill_loses_the_step_in_flight_and_a_pause_freezes_it() -> None:
    killed = LearnerScenario(id="a", step_s=1.0, down=[(10.5, 20.5, True)])
    paused = LearnerScenario(id="b", step_s=1.0, down=[(20.5, 25.5, False)])
    out = replay(Scenario(wall_s=100.0, learners=[killed, paused], quorum=1, H=24))
    # a: steps 1-10, the 11th lost, back at 20.5: 79 more. b: 20 steps, the 21st
    # half done, finished at 26, then 74 more.
    assert out["learners"] == {"a": 89.0, "b": 95.0}
    assert out["goodput"] == pytest.approx((89 + 95) / 200)
    assert out["merged_work_ratio"] < 1.0  # a and b missed rounds the other merged


def test_calibrating_the_fixture_lands_near_its_measured_goodput() -> None:
    out = calibrate(REPORT)
    assert out["measured_goodput"] == 0.85
    assert out["deviation_points"] < 2.0
    assert out["learners"]["learner-0"] < out["learners"]["learner-1"]


def test_merge_replay_counts_the_steps_lost_between_hand_over_and_adoption() -> None:
    from ddiloco.simulator.merges import merged_work_ratio

    twins = [np.arange(1.0, 11.0), np.arange(1.0, 11.0)]
    kw = {"fragments": 1, "H": 2, "quorum": 1, "grace_s": 0.0}
    # adopted at once: every step of both learners reaches a merge
    assert merged_work_ratio(twins, deliver_s=0.0, **kw) == pytest.approx(1.0)
    # adopted one step later: merges at 2 (2+2 steps), then 4, 6, 8, 10 carry one step each
    assert merged_work_ratio(twins, deliver_s=0.5, **kw) == pytest.approx(12 / 20)
