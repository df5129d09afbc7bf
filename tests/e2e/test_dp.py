"""The data-parallel baselines end to end: real gloo ranks, a kill, a pause, regrouping.

pytest tests/e2e/test_dp.py -m e2e
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddiloco.local.chaos import ChaosEvent, Schedule
from ddiloco.local.dp_run import DPConfig, DPRun
from ddiloco.local.report import read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]


def schedule() -> Schedule:
    return Schedule(
        kind="test",
        seed=0,
        events=[
            ChaosEvent(3.0, "pause", "learner-0", 1.5),
            ChaosEvent(6.0, "kill", "learner-1", 1.0),
        ],
    )


@pytest.mark.parametrize("elastic", [False, True])
def test_group_survives_a_kill_and_keeps_one_model(tmp_path: Path, elastic: bool) -> None:
    run = DPRun(
        DPConfig(
            learners=2,
            elastic=elastic,
            max_seconds=30,
            hot_spares=1,
            schedule=schedule(),
            ckpt_every=5,
            eval_every=3,
            out=tmp_path,
        )
    )
    r = run.run()
    assert r["method"] == ("elastic_dp" if elastic else "sync_dp")
    assert [a["action"] for a in r["chaos_applied"]] == ["pause", "kill"]
    killed = next(s for s in r["learners"] if s["id"] == "learner-1")
    assert killed["restarts"] == 1
    # sync: one regroup when the replacement is back; elastic: shrink, then regrow
    assert r["generations"] == (3 if elastic else 2)
    starts = [
        x
        for x in read_jsonl(tmp_path / "learners" / "learner-0.jsonl")
        if x.get("event") == "start"
    ]
    assert len(starts) == r["generations"]
    assert starts[-1]["resume_step"] > 0  # resumed from the checkpoint, not from scratch
    if elastic:
        assert [s["world"] for s in starts] == [2, 1, 2]
    assert 0.0 < r["goodput"] < 1.0
    assert 0.0 < r["merged_work_ratio"] <= 1.0
    assert r["tokens_computed"] <= r["tokens_all"]
    assert r["eval_loss_final"] < r["eval_loss_initial"]
    # the paused rank's stall is idle time for both ranks, not work
    assert all(s["compute_seconds"] < s["held_seconds"] - 1.0 for s in r["learners"])
