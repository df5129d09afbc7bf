"""Replaying a `ddiloco local` report: constants measured from it, a known replay.

.venv/bin/pytest tests/unit/test_sim_calibrate.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddiloco.simulator.calibrate import (
    LearnerScenario,
    Scenario,
    calibrate,
    measure_constants,
    replay,
    replay_steps,
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
    sc = Scenario(wall_s=100.0, learners=[killed, paused], quorum=1, H=24)
    out = replay(sc)
    # a: steps 1-10, the 11th lost, back at 20.5: 79 more. b: 20 steps, the 21st
    # half done, finished at 26, then 74 more.
    assert out["learners"] == {"a": 89.0, "b": 95.0}
    assert out["goodput"] == pytest.approx((89 + 95) / 200)
    # the kill ends a's process (its replacement joins afresh); b's pause only silences it
    a, b = (r.learner() for r in replay_steps(sc))
    assert [(i.join, i.end, len(i.times)) for i in a.incarnations] == [
        (0.0, 10.5, 10),
        (20.5, None, 79),
    ]
    assert len(b.incarnations) == 1 and b.silent == [(20.5, 25.5)]
    # a 10 s outage is a fraction of a round (H = 24 steps of 1 s): nothing is refused
    assert out["refused_updates"] == 0 and out["merges"] > 0
    calm = [LearnerScenario(id="a", step_s=1.0), LearnerScenario(id="b", step_s=1.0)]
    calm_out = replay(Scenario(wall_s=100.0, learners=calm, quorum=1, H=24))
    assert calm_out["merged_work_ratio"] > out["merged_work_ratio"]  # a lost its unsent work


def test_calibrating_the_fixture_lands_near_its_measured_goodput() -> None:
    out = calibrate(REPORT)
    assert out["measured_goodput"] == 0.85
    assert out["deviation_points"] < 2.0
    assert out["learners"]["learner-0"] < out["learners"]["learner-1"]


def test_the_merged_work_ratio_comes_from_the_protocol_replay() -> None:
    twins = [LearnerScenario(id=f"l{i}", step_s=0.1) for i in range(2)]
    rebase = replay(Scenario(wall_s=60.0, learners=twins, quorum=1, H=24))
    # 600 steps each: only the steps not handed over by the end are lost
    assert rebase["merged_work_ratio"] > 0.97
    assert rebase["late_updates"] == rebase["refused_updates"] == 0
    assert rebase["merges"] == pytest.approx(4 * 600 / 24, abs=4)  # one per fragment per H
    overwrite = replay(Scenario(wall_s=60.0, learners=twins, quorum=1, H=24, adoption="overwrite"))
    assert overwrite["merged_work_ratio"] < rebase["merged_work_ratio"]
