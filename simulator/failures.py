"""Chip failures, repairs and the pauses they cause, for one synchronous job on the event loop.

    from ddiloco.simulator.engine import EventLoop
    from ddiloco.simulator.failures import Job
    loop = EventLoop()
    job = Job(loop, chips=150_000, cfg=FailureConfig(), rng=np.random.default_rng(0),
              elastic=True)
    job.start(); loop.run(until=86_400.0); job.finish(86_400.0)
    job.goodput()

A `Job` is anything that steps in lock-step: a whole data-parallel run, or one Decoupled
DiLoCo learner (a learner is itself an elastic data-parallel job, the paper's failure model).

Failure model: each chip in service fails as a Poisson process (rate 1 / chip MTBI). A
failure takes its slice out. The job notices it at the end of the step in flight, which
completes on the surviving slices (an elastic job loses the failed slice's share of it);
failures that land before that boundary or during the pause that follows are handled by
the same reconfiguration.
- non-elastic (`elastic=False`): the job stops for `restart_s` (swap a spare slice in,
  reload, restart) and resumes at full size.
- elastic: the job pauses `shrink_s`, resumes without the slice, and the slice returns after
  an exponentiated-Weibull repair time. A repaired slice joins at the next reconfiguration,
  or, if none comes within `regrow_batch_s`, in a dedicated `regrow_s` pause taken at a
  step boundary (no step lost). A job with no slice left waits for the first repair.

Tests supply their own failure and repair times (`failure_times`, `repair_times`) to check
the accounting against a hand-computed answer: `tests/unit/test_sim_failures.py`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ddiloco.simulator.config import FailureConfig, RepairConfig
from ddiloco.simulator.engine import Event, EventLoop


def sample_repair(rng: np.random.Generator, cfg: RepairConfig, n: int) -> np.ndarray:
    """n repair durations (seconds) from the exponentiated Weibull of `cfg`."""
    u = rng.random(n)
    return cfg.scale_s * (-np.log1p(-(u ** (1.0 / cfg.alpha)))) ** (1.0 / cfg.shape)


def repair_mean(cfg: RepairConfig, rng: np.random.Generator | None = None) -> float:
    """Mean repair time by Monte Carlo (the exponentiated Weibull has no closed form)."""
    rng = rng or np.random.default_rng(12345)
    return float(sample_repair(rng, cfg, 200_000).mean())


class Job:
    """One lock-step job of `chips` accelerators, driven by failures on an EventLoop.

    State: `mode` is "running", "failing" (a failure happened; the step in flight is lost
    at `boundary`), "draining" (a planned regrow waits for the step boundary), "paused"
    (reconfiguring) or "dead" (no slice left). `up` slices are in service, `ready` are
    repaired and waiting to rejoin. Accounting: `good_chip_s` is chip-seconds spent on
    steps that completed; `run_intervals` lists (start, end, chips) of that useful work,
    which the synchronous-DiLoCo and merge models replay.
    """

    def __init__(
        self,
        loop: EventLoop,
        chips: int,
        cfg: FailureConfig,
        rng: np.random.Generator,
        *,
        elastic: bool,
        step_s: float | None = None,
        failure_times: list[float] | None = None,
        repair_times: list[float] | None = None,
    ) -> None:
        self.loop, self.cfg, self.rng, self.elastic = loop, cfg, rng, elastic
        self.chips = chips
        self.slices = max(1, round(chips / cfg.slice_chips))
        self.slice_chips = chips / self.slices
        base = cfg.step_s if step_s is None else step_s
        # Lock-step: every step waits for the slowest of `slices` jittery slices.
        straggle = (
            1.0 + cfg.step_cv * math.sqrt(2.0 * math.log(self.slices)) if self.slices > 1 else 1.0
        )
        self.step_s = base * straggle
        self.useful = 1.0 / straggle
        self.up, self.ready = self.slices, 0
        self.mode = "running"
        self.run_start = 0.0
        self.run_chips = float(chips)
        self.boundary = 0.0
        self.good_chip_s = 0.0
        self.failures = 0
        self.pauses = 0
        self.paused_s = 0.0
        self.run_intervals: list[tuple[float, float, float]] = []
        self._regrow_event: Event | None = None
        self._resume_event: Event | None = None
        self._scripted_failures: Iterator[float] | None = (
            iter(failure_times) if failure_times is not None else None
        )
        self._scripted_repairs: Iterator[float] | None = (
            iter(repair_times) if repair_times is not None else None
        )
        self._pause_started = 0.0
        self.lost_share_chip_s = 0.0

    # -- failure and repair processes -------------------------------------------------------

    def start(self) -> None:
        self.run_start = self.loop.now
        self._schedule_next_failure()

    def _schedule_next_failure(self) -> None:
        if self._scripted_failures is not None:
            t = next(self._scripted_failures, None)
            if t is not None:
                self.loop.at(t, self._on_failure)
            return
        rate = self.chips / self.cfg.chip_mtbi_s
        self.loop.after(float(self.rng.exponential(1.0 / rate)), self._on_failure)

    def _repair_delay(self) -> float:
        if self._scripted_repairs is not None:
            return next(self._scripted_repairs)
        return float(sample_repair(self.rng, self.cfg.repair, 1)[0])

    def _on_failure(self) -> None:
        self._schedule_next_failure()
        if self.elastic:
            # Thinning: the draw was at the whole job's rate; only chips on slices that are
            # not out for repair can fail.
            in_service = self.up + self.ready
            scripted = self._scripted_failures is not None
            if in_service == 0 or (not scripted and self.rng.random() * self.slices >= in_service):
                return
        self.failures += 1
        now = self.loop.now
        if self.elastic:
            if self.ready and self.rng.random() * (self.up + self.ready) < self.ready:
                self.ready -= 1  # a repaired slice waiting to rejoin failed again
                self.loop.after(self._repair_delay(), self._on_repair)
                return
            self.up -= 1
            self.loop.after(self._repair_delay(), self._on_repair)
        if self.mode == "running":
            # The step in flight still completes on the surviving slices; the job
            # reconfigures at its boundary.
            k = math.floor((now - self.run_start) / self.step_s) + 1
            self.boundary = self.run_start + k * self.step_s
            self._credit(k)
            self.mode = "failing"
            self.loop.at(self.boundary, self._on_boundary)
        elif self.mode == "draining":
            self.mode = "failing"  # the planned regrow becomes a shrink (or a restart)
        if self.mode == "failing" and self.elastic:
            self._void_share(now)
        elif self.mode == "paused" and self.elastic and self._resume_event is not None:
            # The reconfiguration under way must re-plan for the smaller mesh.
            t = self._resume_event.time + self.cfg.replan_s
            EventLoop.cancel(self._resume_event)
            self._resume_event = self.loop.at(t, self._on_resume)
        # dead, or a non-elastic restart: absorbed by the reconfiguration under way

    def _on_repair(self) -> None:
        self.ready += 1
        if self.mode == "dead":
            self._pause(self.cfg.regrow_s)
        elif self.mode == "running" and self._regrow_event is None:
            self._regrow_event = self.loop.after(self.cfg.regrow_batch_s, self._on_regrow_due)

    def _on_regrow_due(self) -> None:
        self._regrow_event = None
        if self.mode != "running" or not self.ready:
            return
        now = self.loop.now
        k = math.ceil((now - self.run_start) / self.step_s - 1e-9)
        self.boundary = self.run_start + k * self.step_s
        self._credit(k)
        self.mode = "draining"
        self.loop.at(self.boundary, self._on_boundary)

    # -- reconfiguration ---------------------------------------------------------------------

    def _on_boundary(self) -> None:
        if self.mode == "draining":
            self._pause(self.cfg.regrow_s)
        elif self.mode == "failing":
            self._pause(self.cfg.shrink_s if self.elastic else self.cfg.restart_s)

    def _pause(self, seconds: float) -> None:
        self.mode = "paused"
        self.pauses += 1
        self._pause_started = self.loop.now
        EventLoop.cancel(self._regrow_event)
        self._regrow_event = None
        self._resume_event = self.loop.after(seconds, self._on_resume)

    def _on_resume(self) -> None:
        self._resume_event = None
        now = self.loop.now
        self.paused_s += now - self._pause_started
        if self.elastic:
            self.up += self.ready
            self.ready = 0
        if self.up == 0:
            self.mode = "dead"
            return
        self.mode = "running"
        self.run_start = now
        self.run_chips = self.up * self.slice_chips

    def _credit(self, steps: int) -> None:
        """Book `steps` completed steps since `run_start` as useful work."""
        if steps > 0:
            end = self.run_start + steps * self.step_s
            busy = self.run_chips * self.useful  # chips computing, not waiting on stragglers
            self.good_chip_s += steps * self.step_s * busy
            self.run_intervals.append((self.run_start, end, busy))

    def _void_share(self, now: float) -> None:
        """The failed slice's part of the step in flight is lost (elastic jobs only: a
        non-elastic job's whole step stands, the restart replaces the slice)."""
        if now < self.boundary and self.run_intervals:
            share = self.slice_chips * self.step_s * self.useful
            self.good_chip_s -= share
            self.lost_share_chip_s += share

    # -- results -----------------------------------------------------------------------------

    def finish(self, horizon: float) -> None:
        """Close the books at `horizon`: keep only the steps completed by then."""
        if self.mode == "running":
            self._credit(math.floor((horizon - self.run_start) / self.step_s))
        elif self.mode in ("failing", "draining") and self.boundary > horizon:
            start, end, chips = self.run_intervals.pop()
            self.good_chip_s -= (end - start) * chips
            k = math.floor((horizon - start) / self.step_s)
            if k > 0:
                self.run_intervals.append((start, start + k * self.step_s, chips))
                self.good_chip_s += k * self.step_s * chips
        elif self.mode == "paused":
            self.paused_s += horizon - self._pause_started
        self.horizon = horizon

    def goodput(self) -> float:
        return self.good_chip_s / (self.chips * self.horizon)
