"""Hot spares end to end: real synchronizer and learner processes.

    .venv/bin/pytest tests/e2e/test_spares.py

1. A spare learner pod's process (`ddiloco learner` with DDILOCO_SPARE=1, learner/spare.py)
   warms up, waits, and on the assignment the operator sends (operator/spares.put_assignment,
   the client the operator runs) becomes that slot: its log says so and the synchronizer
   sees the slot's learner id train.
2. `ddiloco local` with a hot spare: a SIGKILLed learner's slot comes back through the
   spare at once, although its scheduled restart delay is longer than the run.
Timings are printed, never asserted (beyond generous safety bounds).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddiloco.local.chaos import ChaosEvent, make_schedule
from ddiloco.local.launcher import LocalConfig, LocalRun
from ddiloco.local.processes import Child, ddiloco_command, env_with, terminate_all
from ddiloco.operator.plan import Assignment
from ddiloco.operator.spares import put_assignment
from ddiloco.wire.auth import spare_token

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]
POD = "job-g-spare-0-abcde"


def wait_for(what: str, probe: Callable[[], Any], timeout: float) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if found := probe():
            return found
        time.sleep(0.1)
    raise TimeoutError(f"{what} within {timeout:.0f}s")


def test_a_spare_learner_takes_over_the_slot_it_is_assigned(
    tmp_path: Path, synchronizer_process: Callable[..., Any]
) -> None:
    sync = synchronizer_process(tmp_path, "spare-token")
    spare: Child | None = None
    try:
        sync.start()
        ready = tmp_path / "ready"
        argv = ddiloco_command(
            "learner",
            "--sync-url",
            sync.url,
            "--model",
            "tiny",
            "--max-steps",
            "40",
            "--threads",
            "1",
            "--log-every",
            "10",
            "--log-path",
            str(tmp_path / "steps.jsonl"),
        )
        env = env_with(
            DDILOCO_TOKEN=spare_token(sync.token, POD),  # its own: reads its assignment alone
            DDILOCO_SPARE="1",
            DDILOCO_POD_NAME=POD,
            DDILOCO_SPARE_READY_FILE=str(ready),
            OMP_NUM_THREADS="1",
        )
        for name in ("DDILOCO_LEARNER_ID", "DDILOCO_LEARNER_INDEX", "DDILOCO_NUM_LEARNERS"):
            env.pop(name, None)
        spare = Child("spare", argv, env, tmp_path / "spare.log")
        t0 = time.time()
        spare.start()
        wait_for(
            "the spare warm (its ready file)", lambda: ready.exists() or not spare.alive(), 180
        )
        assert spare.alive(), spare.log_path.read_text()[-3000:]
        print(f"spare warm after {time.time() - t0:.1f}s")
        time.sleep(1.0)  # standing by: its long poll waits
        assert not (tmp_path / "steps.jsonl").exists()  # it has not trained anything yet
        body = {"learner_id": "g-1", "learner_index": 1, "num_learners": 2, "attempt": 1}
        t_assign = time.time()
        assert put_assignment(sync.url, sync.token, None, Assignment(POD, "u", body), 5) is False
        client = sync.client()

        def trains_as_g1() -> Any:
            status = client.status()
            return next((x for x in status.learners if x.learner_id == "g-1" and x.step), None)

        seen = wait_for("learner g-1 training at the synchronizer", trains_as_g1, 60)
        print(
            f"assignment -> g-1's first step seen by the synchronizer: {time.time() - t_assign:.2f}s"
        )
        assert seen.incarnation >= 1
        # the spare fetched it: the operator's next PUT hears so and stops re-sending
        assert put_assignment(sync.url, sync.token, None, Assignment(POD, "u", body), 5) is True
        assert spare.proc is not None and spare.proc.wait(120) == 0
        log = spare.log_path.read_text()
        assert f"Spare {POD} takes over slot g-1 (data part 1 of 2)" in log, log[-3000:]
        assert "learner g-1 INFO: Learner g-1 starting" in log  # the learner proper, as g-1
        assert "learner_index=1, num_learners=2" in log
        steps = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
        assert sum(1 for r in steps if "dt" in r) == 40
        client.close()
    finally:
        terminate_all([c for c in (spare, sync.child) if c is not None])


def test_local_kill_is_taken_over_by_a_hot_spare(tmp_path: Path) -> None:
    schedule = make_schedule("none", learners=2, seconds=60, seed=0)
    cfg = LocalConfig(
        learners=2,
        max_seconds=60,
        seed=0,
        schedule=schedule,
        hot_spares=1,
        spare_takeover="immediate",
        out=tmp_path / "run",
    )
    killed: dict[str, float] = {}

    def kill_once_a_spare_is_warm(run: LocalRun) -> None:
        # a kill whose restart delay outlasts the run: only a hot spare can bring it back
        if not killed and run.spares is not None and run.spares.ready() and run.elapsed() > 3:
            killed["at"] = run.elapsed()
            run.schedule.events.insert(
                0, ChaosEvent(at=run.elapsed(), action="kill", target="learner-1", delay=600.0)
            )

    run = LocalRun(cfg, on_tick=kill_once_a_spare_is_warm)
    report = run.run()
    assert killed, "no spare was warm within the run"
    assert killed["at"] < 45, f"the spare was warm only {killed['at']:.0f}s into the run"
    (applied,) = run.applied
    assert applied["action"] == "kill" and applied["hot_spare"] is True
    (l1,) = [x for x in report["learners"] if x["id"] == "learner-1"]
    assert l1["restarts"] == 1  # back, long before the scheduled 600 s
    print(f"learner-1 killed at {killed['at']:.1f}s, restarted after {l1['restart_delays']}s")
    assert report["spares"]["taken"] == 1 and report["spares"]["hot_takeovers"] == 1
    # the spare is now that slot: a second incarnation of learner-1 joined and trained
    records = [json.loads(x) for x in run.learner_log("learner-1").read_text().splitlines() if x]
    starts = [r for r in records if r.get("event") == "start"]
    assert len(starts) == 2 and starts[1]["incarnation"] > starts[0]["incarnation"]
    assert any("dt" in r and r["t"] > starts[1]["t"] for r in records)
    status = {x.learner_id: x for x in run.status.learners}
    assert status["learner-1"].incarnation == starts[1]["incarnation"]
    assert report["goodput"] > 0
