"""`ddiloco simulate --calibrate r.json`: replay a `ddiloco local` run in the simulator.

    ddiloco simulate --calibrate /tmp/ddiloco-reports/kill.json [--json]
    .venv/bin/python bench/sim_calibrate.py /tmp/ddiloco-reports/*.json

From the report it takes the scenario: M learners, the run's wall time, each learner's
mean step time (a slow learner's is longer), its kill times and restart delays, its
SIGSTOP pauses, and two overheads measured on the machine: the start-up time before a
learner's first step, and the time a restarted learner needs before it steps again
(process start, imports, fetching every fragment), and the per-step hand-over gap (the
time between steps that is not the step). Where the report has no `timeline`, start-up and
restart overheads read 0; `bench/sim_calibrate.py --constants-from` takes all three from
another run instead.

It then replays that scenario on the event loop, step by step: a learner computes steps
of its mean duration; a kill loses the step in flight; a pause freezes the learner; learners
never wait for each other or for merges (Douillard et al. 2026), whatever K is. The predicted
goodput is what the replay computed over what it held (the paper's failure model, the same formula
as the report); it never reads the measured compute seconds. The merged-work ratio (and
the merges, late and refused updates) is predicted by running the synchronizer's rounds
and the learners' hand-over and adoption rules on the replayed steps (`protocol.py`):
each kill starts a new learner process, each pause silences its heartbeats, merges take
the report's mean merge time, and merges in the 0.3 s the launcher waits after stopping
the learners still count.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.simulator.engine import Event, EventLoop
from ddiloco.simulator.protocol import Incarnation, Learner, ProtocolConfig, run_protocol

DRAIN_S = 0.3
"""`ddiloco local` waits this long after stopping the learners before reading the status."""


@dataclass(frozen=True)
class MachineConstants:
    """Overheads of the machine the run was made on, measured from a report."""

    startup_s: float = 0.0
    """Launch to first inner step."""
    restart_s: float = 0.0
    """Restarted process to its first inner step (imports, fetching every fragment)."""
    step_gap_s: float = 0.0
    """Time between two inner steps that is not the step itself (fragment hand-over,
    metadata, logging)."""
    restarts_seen: int = 0
    """How many restarts `restart_s` was measured on (0: unknown, not measured)."""


def measure_constants(report: dict[str, Any]) -> MachineConstants:
    """Median start-up, restart and per-step overheads over a report's learners."""
    wall = float(report["wall_seconds"])
    startups: list[float] = []
    restarts: list[float] = []
    for lr in report["learners"]:
        spans = (lr.get("timeline") or {}).get("compute") or []
        if spans:
            startups.append(min(a for a, _ in spans))
        kills = list(lr.get("kill_times", []))
        for i, (t_kill, delay) in enumerate(zip(kills, lr.get("restart_delays", []), strict=False)):
            back = t_kill + delay
            first = _first_after(spans, back) if spans else None
            # A restart killed again before its first step tells only a lower bound: skip it.
            if first is not None and not (i + 1 < len(kills) and kills[i + 1] < first):
                restarts.append(first - back)
    startup = statistics.median(startups) if startups else 0.0
    restart = statistics.median(restarts) if restarts else 0.0
    gaps = []
    for lr in report["learners"]:
        steps = int(lr.get("steps") or 0)
        if steps <= 0:
            continue
        idle = lr.get("wait_seconds")
        if idle is None:
            idle = (
                wall
                - lr.get("compute_seconds", 0.0)
                - lr.get("dead_seconds", 0.0)
                - lr.get("paused_seconds", 0.0)
            )
        other = startup + len(lr.get("restart_delays", [])) * restart
        gaps.append(max(0.0, float(idle) - other) / steps)
    return MachineConstants(
        startup, restart, statistics.median(gaps) if gaps else 0.0, len(restarts)
    )


@dataclass
class LearnerScenario:
    """What the replay needs to know of one learner."""

    id: str
    step_s: float
    down: list[tuple[float, float, bool]] = field(default_factory=list)
    """(start, end, killed): stretches without the process computing; a kill loses the
    step in flight, a pause only freezes it."""
    startup_s: float = 0.0
    step_gap_s: float = 0.0


@dataclass
class Scenario:
    wall_s: float
    learners: list[LearnerScenario]
    quorum: int
    H: int
    fragments: int = 4
    tau: int = 2
    grace: bool = True
    sync_s: float = 0.0
    adoption: str = "rebase"
    measured_goodput: float | None = None
    measured_merged: float | None = None
    measured_merges: int | None = None
    measured_contributors: float | None = None
    name: str = ""


def _first_after(spans: list[list[float]], t: float) -> float | None:
    starts = [a for a, _ in spans if a >= t - 1e-6]
    return min(starts) if starts else None


def scenario_from_report(
    report: dict[str, Any], constants: MachineConstants | None = None, name: str = ""
) -> Scenario:
    """The replayable scenario of a `ddiloco local` report (see the module docstring);
    the machine's overheads are measured from the same report unless given."""
    cfg = report["config"]
    wall = float(report["wall_seconds"])
    own = measure_constants(report)
    k = constants or own
    if not k.restarts_seen:  # a run without restarts cannot tell how long one takes
        k = MachineConstants(k.startup_s, own.restart_s, k.step_gap_s, own.restarts_seen)
    learners = []
    for lr in report["learners"]:
        step = float(lr.get("step_seconds_mean") or 0.0)
        if step <= 0:
            step = wall  # never stepped: nothing to replay
        down: list[tuple[float, float, bool]] = []
        delays = list(lr.get("restart_delays", []))
        for i, t_kill in enumerate(lr.get("kill_times", [])):
            end = t_kill + delays[i] + k.restart_s if i < len(delays) else wall
            down.append((float(t_kill), min(float(end), wall), True))
        for a, b in (lr.get("timeline") or {}).get("paused", []):
            down.append((float(a), float(b), False))
        down.sort()
        learners.append(
            LearnerScenario(
                id=str(lr["id"]),
                step_s=step,
                down=down,
                startup_s=k.startup_s,
                step_gap_s=k.step_gap_s,
            )
        )
    return Scenario(
        wall_s=wall,
        learners=learners,
        quorum=int(cfg.get("quorum", 1)),
        H=int(cfg.get("H", 24)),
        fragments=int(cfg.get("P", 4)),
        tau=int(cfg.get("tau", 2)),
        grace=bool(cfg.get("grace", True)),
        sync_s=float(report.get("sync_seconds_mean") or 0.0),
        measured_goodput=report.get("goodput"),
        measured_merged=report.get("merged_work_ratio"),
        measured_merges=report.get("merges"),
        measured_contributors=report.get("mean_contributors"),
        name=name,
    )


class _Replay:
    """One learner on the event loop: steps back to back, except while down. Records the
    completion time of every step, per process (a kill ends one, the restart begins the
    next), for the protocol replay; a pause leaves the process silent, not ended."""

    def __init__(self, loop: EventLoop, sc: LearnerScenario, wall: float) -> None:
        self.loop, self.sc = loop, sc
        self.cycle_s = sc.step_s + sc.step_gap_s
        self.compute_s = 0.0
        self.processes: list[tuple[float, list[float], float | None]] = []
        """(joined at, step completion times, killed at) of each process."""
        self._killed = True  # no process yet: the first joins when the learner starts
        self._step_event: Event | None = None
        self._step_started = 0.0
        self._frozen_s = 0.0
        for a, b, killed in sc.down:
            loop.at(max(a, 0.0), self._down, killed)
            loop.at(max(b, a, 0.0), self._up)
        loop.at(min(sc.startup_s, wall), self._up)
        self._downs = 1  # not started yet

    @property
    def step_times(self) -> list[float]:
        return [t for _, times, _ in self.processes for t in times]

    def _down(self, killed: bool) -> None:
        self._downs += 1
        if killed and not self._killed:  # the process dies; its replacement joins at _up
            self._killed = True
            join, times, _ = self.processes[-1]
            self.processes[-1] = (join, times, self.loop.now)
        if self._downs > 1 or self._step_event is None:
            return
        now = self.loop.now
        EventLoop.cancel(self._step_event)
        self._step_event = None
        done = now - self._step_started
        if killed:
            self._frozen_s = 0.0  # the step in flight is lost
        else:
            self._frozen_s = done  # resumes where it stopped

    def _up(self) -> None:
        self._downs = max(0, self._downs - 1)
        if self._downs == 0 and self._step_event is None:
            if self._killed:
                self._killed = False
                self._frozen_s = 0.0
                self.processes.append((self.loop.now, [], None))
            self._begin_step(self.cycle_s - self._frozen_s)
            self._frozen_s = 0.0

    def _begin_step(self, duration: float) -> None:
        # One cycle: the step, then the hand-over gap; credited when the step completes.
        self._step_started = self.loop.now - (self.cycle_s - duration)
        self._step_event = self.loop.after(duration, self._step_done)

    def _step_done(self) -> None:
        self._step_event = None
        self.compute_s += self.sc.step_s
        self.processes[-1][1].append(self.loop.now)
        self._begin_step(self.cycle_s)

    def finish(self) -> None:
        EventLoop.cancel(self._step_event)  # a step still in flight at the end does not count

    def learner(self) -> Learner:
        """This learner's processes and pauses, as the protocol replay takes them."""
        return Learner(
            self.sc.id,
            self.sc.step_s,
            [Incarnation(join, np.array(times), end=end) for join, times, end in self.processes],
            silent=[(a, b) for a, b, killed in self.sc.down if not killed],
        )


def replay_steps(sc: Scenario) -> list[_Replay]:
    """Replay the learners of `sc` to its wall time: their compute and step times."""
    loop = EventLoop()
    reps = [_Replay(loop, lr, sc.wall_s) for lr in sc.learners]
    loop.run(until=sc.wall_s)
    for r in reps:
        r.finish()
    return reps


def replay(sc: Scenario) -> dict[str, Any]:
    """Replay `sc`; predicted goodput, merged-work ratio and per-learner compute seconds."""
    reps = replay_steps(sc)
    held = sc.wall_s * len(reps)
    computed = sum(r.compute_s for r in reps)
    cfg = ProtocolConfig(
        fragments=sc.fragments,
        H=sc.H,
        quorum=max(1, min(sc.quorum, len(reps))),
        grace=sc.grace,
        tau=sc.tau,
        adoption="overwrite" if sc.adoption == "overwrite" else "rebase",
        sync_s=sc.sync_s,
        drain_s=DRAIN_S,
    )
    proto = run_protocol([r.learner() for r in reps], cfg, sc.wall_s)
    return {
        "name": sc.name,
        "goodput": computed / held if held else 0.0,
        "merged_work_ratio": proto.merged_work_ratio,
        "merges": proto.merges,
        "late_updates": proto.late_updates,
        "refused_updates": proto.refused_updates,
        "mean_staleness": proto.mean_staleness,
        "mean_contributors": proto.contributions / proto.merges if proto.merges else 0.0,
        "measured_goodput": sc.measured_goodput,
        "measured_merged_work_ratio": sc.measured_merged,
        "measured_merges": sc.measured_merges,
        "measured_mean_contributors": sc.measured_contributors,
        "learners": {r.sc.id: round(r.compute_s, 3) for r in reps},
        "startup_s": sc.learners[0].startup_s if sc.learners else 0.0,
        "step_gap_s": sc.learners[0].step_gap_s if sc.learners else 0.0,
    }


def calibrate(path: str | Path, constants: MachineConstants | None = None) -> dict[str, Any]:
    """Replay the report at `path` (overheads measured from `constants`, or from itself)."""
    report = json.loads(Path(path).read_text())
    result = replay(scenario_from_report(report, constants, name=Path(path).stem))
    if result["measured_goodput"] is not None:
        result["deviation_points"] = abs(result["goodput"] - result["measured_goodput"]) * 100
    return result


def format_calibration(results: list[dict[str, Any]]) -> str:
    lines = [
        f"{'report':<24}{'measured':>10}{'simulated':>11}{'deviation':>11}"
        f"{'merged meas.':>14}{'merged sim.':>13}{'merges meas.':>14}{'merges sim.':>13}"
    ]
    for r in results:
        meas = r["measured_goodput"]
        mm = r["measured_merged_work_ratio"]
        dev = r.get("deviation_points", math.nan)
        merges = r.get("measured_merges")
        lines.append(
            f"{r['name']:<24}{(meas if meas is not None else math.nan):>10.1%}"
            f"{r['goodput']:>11.1%}{dev:>9.1f} pt"
            f"{(mm if mm is not None else math.nan):>14.1%}{r['merged_work_ratio']:>13.1%}"
            f"{merges if merges is not None else '-':>14}{r['merges']:>13}"
        )
    return "\n".join(lines)
