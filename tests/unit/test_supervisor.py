"""The supervisor's shared pieces on real files and real processes: step counts and the
first step from a learner's log, and the chaos loop (inject, record, recover) over `sleep`
children; every runner of a schedule is a ChaosInjector.

pytest tests/unit/test_supervisor.py
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from ddiloco.local.chaos import ChaosEvent, ChaosInjector, Schedule
from ddiloco.local.processes import Child, env_with, terminate_all
from ddiloco.local.supervisor import Supervisor, first_step_time

SLEEP = shutil.which("sleep") or "/bin/sleep"


def write_log(path: Path, *records: dict[str, Any], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write(tail)


class Sleepers(Supervisor):
    """A Supervisor of `sleep` processes: kill restarts after the delay, pause resumes
    after it; anything else does not apply."""

    def __init__(self, out: Path, schedule: Schedule, names: list[str]) -> None:
        super().__init__(out, schedule)
        self.children = {
            n: Child(n, [SLEEP, "30"], env_with(), self.out / "logs" / f"{n}.log") for n in names
        }

    def inject(self, ev: ChaosEvent, now: float) -> dict[str, Any] | None:
        child = self.children[ev.target]
        if ev.action == "kill":
            child.kill()
            child.restart_at = now + ev.delay
        elif ev.action == "pause":
            child.pause()
            child.resume_at = now + ev.delay
        else:
            return None
        return {"pid": child.proc.pid if child.proc else None}

    def recover(self, now: float) -> None:
        for child in self.children.values():
            if child.resume_at is not None and now >= child.resume_at:
                child.resume()
            if child.restart_at is not None and now >= child.restart_at:
                self.start_child(child)


def test_steps_and_first_step_come_from_the_learners_logs(tmp_path: Path) -> None:
    sup = Sleepers(tmp_path, Schedule("none", 0), ["a", "b", "c"])
    assert sup.steps_done("a") == 0 and sup.first_step_time(sup.children.values()) is None
    write_log(
        sup.learner_log("a"),
        {"event": "start", "t": 99.0},
        {"step": 1, "t": 101.0, "dt": 0.5},
        {"step": 2, "t": 102.0, "dt": 0.5},
        tail='{"step": 3, "t": 103.0, "d',  # a line still being written
    )
    write_log(sup.learner_log("b"), {"step": 1, "t": 100.9, "dt": 0.2})
    write_log(sup.learner_log("c"), tail='{"step": 1, "t": 90.0, "d')
    assert first_step_time(sup.learner_log("a")) == 100.5
    assert first_step_time(sup.learner_log("c")) is None  # not a whole record yet
    assert first_step_time(tmp_path / "missing.jsonl") is None
    assert sup.first_step_time(sup.children.values()) == 100.5  # a's first step began first
    assert sup.steps_done("a") == 2
    write_log(sup.learner_log("a"), tail='t": 1.0}\n')  # the cut line completes
    write_log(sup.learner_log("a"), {"step": 1, "t": 200.0, "dt": 1.0})  # a new incarnation
    assert sup.steps_done("a") == 4 and sup.steps_done("b") == 1
    assert sup.elapsed() == 0.0  # no clock before the first step
    sup.wait_first_step(list(sup.children.values()), time.time(), "never")
    assert sup.t0 == 100.5 and sup.elapsed() > 0


def test_the_chaos_loop_injects_records_and_recovers(tmp_path: Path) -> None:
    events = [
        ChaosEvent(0.0, "kill", "a", 0.3),
        ChaosEvent(0.0, "pause", "b", 0.3),
        ChaosEvent(0.1, "add", "a", 0.0),  # means nothing to sleepers: not recorded
        ChaosEvent(5.0, "pause", "a", 1.0),
        ChaosEvent(0.0, "kill", "b", 0.0, at_step=2),
    ]
    sup = Sleepers(tmp_path, Schedule("test", 0, events=list(events)), ["a", "b"])
    a, b = sup.children["a"], sup.children["b"]
    try:
        for child in (a, b):
            sup.start_child(child)
        first_pid = a.proc.pid if a.proc else 0
        sup.apply_chaos(0.2)
        assert [(r["action"], r["target"]) for r in sup.applied] == [("kill", "a"), ("pause", "b")]
        assert sup.applied[0] == {
            "at": 0.0,
            "action": "kill",
            "target": "a",
            "delay": 0.3,
            "at_step": None,
            "applied_at": 0.2,
            "pid": first_pid,
        }
        assert not a.alive() and a.restart_at is not None and b.paused_since is not None
        assert sup.schedule.events == events[3:]  # popped, applied or not
        sup.apply_chaos(0.6)  # nothing new is due: the killed restarts, the paused resumes
        assert len(sup.applied) == 2
        assert a.alive() and len(a.starts) == 2 and a.proc and a.proc.pid != first_pid
        assert b.paused_since is None and len(b.pauses) == 1
        write_log(sup.learner_log("b"), *({"step": i, "t": 1.0, "dt": 0.1} for i in (1, 2)))
        sup.apply_chaos(0.7)  # b reached step 2: its kill is due, and restarts at once
        assert sup.applied[-1]["target"] == "b" and sup.applied[-1]["at_step"] == 2
        assert len(b.kills) == 1 and len(b.starts) == 2 and b.alive()
        assert sup.schedule.events == [events[3]]
    finally:
        terminate_all([a, b])


def test_every_runner_of_a_schedule_is_a_chaos_injector(tmp_path: Path) -> None:
    from ddiloco.local.dp_run import DPConfig, DPRun
    from ddiloco.local.k8s_chaos import PodChaos, plan
    from ddiloco.local.launcher import LocalConfig, LocalRun

    local = LocalRun(LocalConfig(learners=2, out=tmp_path / "local"))
    dp = DPRun(DPConfig(learners=2, out=tmp_path / "dp"))
    pods = PodChaos(None, "ns", job="j")  # a client of no server: a skipped event calls none
    for runner in (local, dp, pods, Sleepers(tmp_path, Schedule("none", 0), [])):
        assert isinstance(runner, ChaosInjector)
    assert local.learner_log("learner-0") == tmp_path / "local" / "learners" / "learner-0.jsonl"
    ev = ChaosEvent(1.0, "pause", "learner-1", 2.0)
    assert pods.inject(ev, 1.0) is None  # no API freezes a container: skipped, with a reason
    assert pods.records == [
        {
            "at": 1.0,
            "verb": "skip",
            "target": "learner-1",
            "reason": plan(Schedule("p", 0, [ev]))[0].reason,
        }
    ]
    pods.recover(10.0)  # no heal pending: nothing called
    assert len(pods.records) == 1 and pods.heals == []
