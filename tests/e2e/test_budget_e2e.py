"""A job with a token budget ends by itself: `ddiloco local --total-tokens N`.

    pytest tests/e2e/test_budget_e2e.py -m e2e

Real synchronizer and learner processes (the tiny model). The synchronizer is told the
budget; every learner hears `finished`, hands over what it holds and exits 0, and the run
ends well before its time cap with at least the budget merged and nothing left unmerged. A
learner SIGKILLed early is replaced, and its replacement resumes the slot's LR schedule
(its logged `slot_step` and `lr`) instead of warming up again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddiloco.local.chaos import ChaosEvent, Schedule
from ddiloco.local.launcher import LocalConfig, LocalRun
from ddiloco.local.report import read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

BUDGET = 1_000_000  # tokens: ~20-30 s of two tiny learners on a shared 2-core machine
CAP_S = 150.0
INNER_LR = 3e-3
WARMUP = 20  # LearnerConfig.warmup_steps' default


def incarnations(records: list[dict]) -> list[list[dict]]:
    """The step log split at each "start" record: one list per process."""
    out: list[list[dict]] = []
    for r in records:
        if r.get("event") == "start":
            out.append([])
        if out:
            out[-1].append(r)
    return out


def test_a_budget_run_ends_by_itself_and_a_replacement_resumes_the_lr_schedule(
    tmp_path: Path,
) -> None:
    schedule = Schedule(kind="test", seed=0, events=[ChaosEvent(3.0, "kill", "learner-1", 0.5)])
    cfg = LocalConfig(
        learners=2,
        total_tokens=BUDGET,
        max_seconds=CAP_S,  # a safety cap only: the budget must end the run long before
        inner_lr=INNER_LR,
        schedule=schedule,
        hot_spares=0,
        out=tmp_path / "run",
    )
    run = LocalRun(cfg)
    report = run.run()
    assert report["budget"]["reached"] and report["budget"]["total_tokens"] == BUDGET
    assert report["tokens_merged"] >= BUDGET
    assert report["wall_seconds"] < CAP_S - 30
    assert report["budget"]["learners_finished"] == ["learner-0", "learner-1"]
    assert report["learner_restarts"] == 1
    for child in run.learners:
        last = child.proc.returncode if child.proc is not None else None
        assert last == 0, (child.name, last)
        stops = [r for r in read_jsonl(run.learner_log(child.name)) if r.get("event") == "stop"]
        assert stops[-1]["stop_reason"] == "finished"
        # whatever the last process computed went out and was answered
        assert all(row["queued_tokens"] == 0 for row in stops[-1]["ledger"])
    lives = incarnations(read_jsonl(run.learner_log("learner-1")))
    assert len(lives) == 2, "learner-1 was killed once and replaced once"
    first = [r for r in lives[0] if "dt" in r]
    second = [r for r in lives[1] if "dt" in r]
    assert first and second, "the replacement never trained: raise BUDGET"
    assert first[0]["slot_step"] == 1 and first[0]["lr"] == pytest.approx(INNER_LR / WARMUP)
    killed_at = first[-1]["slot_step"]
    assert killed_at > WARMUP, "the kill came before the warm-up ended: move it later"
    # the replacement starts at the slot's step as its last heartbeats reported it (at most
    # a heartbeat period behind the last step it took), past the warm-up: full LR at once
    resumed = second[0]["slot_step"]
    assert killed_at - 20 <= resumed - 1 <= killed_at, (killed_at, resumed)
    assert second[0]["step"] == 1
    assert second[0]["lr"] == pytest.approx(INNER_LR)
