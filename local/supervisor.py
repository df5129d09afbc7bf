"""What a local run's supervisor does whatever it supervises: the clock, the learner slots'
logs, starting a child through the hot spare pool, and the chaos loop.

    class Run(Supervisor):
        def inject(self, ev, now):   # apply one due event; None: it did not apply
            self.children[ev.target].kill()
            return {}
        def recover(self, now): ...  # restart, resume, reconnect what is due

    run = Run(out, schedule)
    run.apply_chaos(run.elapsed())   # every tick: inject what is due, record it, recover
    run.applied                      # [{**event, "applied_at": 7.301, ...}]

`ddiloco local` (local/launcher.py, learner and synchronizer processes) and the
data-parallel baselines (local/dp_run.py, rank processes) are Supervisors: a
`chaos.ChaosInjector` over processes. local/k8s_chaos.py's PodChaos is the same interface
over pods. A slot's log is <out>/learners/<id>.jsonl, its JSON-lines step records (`t` the
end of a step, `dt` its duration), appended to by every incarnation.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ddiloco.local.chaos import ChaosEvent, Schedule, StepCounter, inject_due
from ddiloco.local.processes import Child

FIRST_STEP_TIMEOUT_S = 300.0
"""How long a run waits for the first step of any of its children."""


def first_step_time(path: Path) -> float | None:
    """When the first step logged in `path` began (`t - dt` of its first step record);
    None before one is written."""
    try:
        with open(path) as f:
            for line in f:
                if '"dt"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line still being written
                    return None
                if "dt" in rec and "t" in rec:
                    return float(rec["t"]) - float(rec["dt"])
    except FileNotFoundError:
        pass
    return None


class Supervisor:
    """A run's children under one clock and one chaos schedule. Subclasses implement
    `inject` and `recover` (chaos.ChaosInjector); `apply_chaos` drives them."""

    def __init__(self, out: Path, schedule: Schedule) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.schedule = schedule
        self._steps = StepCounter(self.learner_log)
        self.spares: Any = None
        """local/spare.py's SparePool, when the run keeps hot spares."""
        self.applied: list[dict[str, Any]] = []
        """The chaos events applied, in order (the report's `chaos_applied`)."""
        self.t0 = 0.0
        """When training began (the first step of any child); the run's clock counts from it."""
        self.t_end = 0.0

    def learner_log(self, lid: str) -> Path:
        return self.out / "learners" / f"{lid}.jsonl"

    def steps_done(self, lid: str) -> int:
        """Steps the slot trained, every incarnation (its log, read incrementally; a step
        redone after a restore counts again: a step schedule counts work done)."""
        return self._steps(lid)

    def elapsed(self) -> float:
        return time.time() - self.t0 if self.t0 else 0.0

    def first_step_time(self, children: Iterable[Child]) -> float | None:
        """The earliest first step of `children` (their logs); None before any."""
        found = (first_step_time(self.learner_log(c.name)) for c in children)
        times = [t for t in found if t is not None]
        return min(times) if times else None

    def wait_first_step(
        self,
        children: list[Child],
        since: float,
        error: str,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Set `t0` once any of `children` took a step; RuntimeError(`error`) after
        FIRST_STEP_TIMEOUT_S from `since`. `check` runs every poll (it may raise)."""
        while not self.t0:
            if time.time() - since > FIRST_STEP_TIMEOUT_S:
                raise RuntimeError(error)
            if check is not None:
                check()
            self.t0 = self.first_step_time(children) or 0.0
            time.sleep(0.05)

    def start_child(self, child: Child, argv: list[str] | None = None, spare: bool = True) -> None:
        """Start `child` (with `argv`, else its own), as a hot spare when the pool has one
        ready and `spare`, else as a fresh process."""
        argv = argv or child.argv
        proc = None
        if self.spares and spare:
            own = {k: v for k, v in child.env.items() if self.spares.env.get(k) != v}
            proc = self.spares.take(argv, child.log_path, own)
        if proc is not None:
            child.adopt(proc)
        else:
            child.start(argv)

    def apply_chaos(self, now: float) -> None:
        """Inject the events due at `now` (seconds into the run, or the targets' steps),
        record the applied ones in `applied`, then recover what is due."""
        self.applied += inject_due(self, self.schedule, now, self.steps_done)

    def inject(self, ev: ChaosEvent, now: float) -> dict[str, Any] | None:
        """Apply `ev`; the fields its record adds, or None when it did not apply."""
        raise NotImplementedError

    def recover(self, now: float) -> None:
        """Resume, restart or reconnect what is due by `now`."""
        raise NotImplementedError
