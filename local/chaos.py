"""Chaos as data: a seeded, replayable schedule of what to do to which process, and when.

    schedule = make_schedule("kill+pause", learners=4, seconds=60, seed=1)
    for event in schedule.events: ...   # ChaosEvent(at=7.3, action="kill", target="learner-1", ...)
    Schedule.from_json(schedule.to_json()) == schedule
    make_schedule("kill+pause", learners=4, steps=360, seed=1)   # in steps: ChaosEvent(at_step=97, ...)
    for event in pop_due(schedule, now, steps_of): ...            # what a runner applies now
    applied += inject_due(injector, schedule, now, steps_of)      # ... through a ChaosInjector

In seconds, an event fires `at` seconds into the run. In steps (`steps=N`), it fires once its
target learner has trained `at_step` inner steps (its slot's, over every incarnation), so
the arms of a study meet each event at the same point of their work whatever their step
times; delays stay in seconds (a freeze or a replacement's start is wall time). A schedule
in steps has learner events only (kill, pause, partition; slow and straggler are factors).

Actions (the chaos scenarios of bench/RESULTS.md, 1-6):

- `kill`: SIGKILL a learner; its replacement arrives `delay` seconds later (long-tailed).
- `pause`: SIGSTOP a learner, SIGCONT after `delay`.
- `partition`: cut a learner off the network for `delay` seconds (its connections are
  dropped and new ones refused, then restored); the process keeps running.
- `kill_sync`: SIGKILL the synchronizer, restarted after `delay` on the same state directory.
- `add` / `remove`: scavenging; a learner slot listed in `absent` joins at `add` and leaves
  for good (SIGTERM, no replacement) at `remove`.

Slow learners are not events: `slow_factors` says how much slower each learner runs for the
whole run. Kinds combine with `+` ("kill+pause"); each part draws from its own random stream,
so adding a part never moves the events of another. The same kind, learners, seconds and
seed give the same schedule on every machine, so an arm and its baselines meet the same
chaos. `ddiloco local` applies it (local/launcher.py), the data-parallel baselines apply it
(local/dp_run.py), and local/k8s_chaos.py turns it into pod deletions and evictions; all
three are a `ChaosInjector` (processes, data-parallel ranks, pods).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, Protocol, runtime_checkable

Action = Literal["kill", "pause", "partition", "kill_sync", "add", "remove"]
ACTIONS: Final[tuple[str, ...]] = ("kill", "pause", "partition", "kill_sync", "add", "remove")
PARTS: Final[tuple[str, ...]] = (
    "kill",
    "pause",
    "partition",
    "slow",
    "straggler",
    "scavenge",
    "sync",
)
"""Single kinds. `slow`: a fast half and a slow half (2x). `straggler`: one learner
permanently 1.2-2x slower. `scavenge`: half the slots join mid-run and leave later."""
KINDS: Final[tuple[str, ...]] = ("none", *PARTS, "kill+pause")
"""What `ddiloco local --chaos` offers; make_schedule takes any `+` combination of PARTS."""
SYNCHRONIZER: Final = "synchronizer"


@dataclass(frozen=True)
class ChaosEvent:
    at: float
    """Seconds after the run started."""
    action: Action
    target: str
    """A learner id, or "synchronizer" (with `ddiloco local --sync-shards S`: one shard,
    "synchronizer-<i>"; plain "synchronizer" is shard seed % S)."""
    delay: float
    """Seconds until the process is restarted (kill), resumed (pause) or reconnected
    (partition); 0 for add and remove."""
    at_step: int | None = None
    """When set: fire once the target learner has trained this many inner steps, not at
    `at` (0). A schedule in steps."""


@dataclass
class Schedule:
    kind: str
    seed: int
    events: list[ChaosEvent] = field(default_factory=list)
    slow_factors: dict[str, float] = field(default_factory=dict)
    absent: list[str] = field(default_factory=list)
    """Learner slots not started with the run (they join with an `add` event)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        raw: dict[str, Any] = json.loads(text)
        events = [ChaosEvent(**e) for e in raw.get("events", [])]
        bad = [e.action for e in events if e.action not in ACTIONS]
        if bad:
            raise ValueError(f"unknown chaos action {bad[0]!r}; allowed: {', '.join(ACTIONS)}")
        return cls(
            kind=raw["kind"],
            seed=int(raw["seed"]),
            events=events,
            slow_factors={k: float(v) for k, v in raw.get("slow_factors", {}).items()},
            absent=list(raw.get("absent", [])),
        )

    @property
    def in_steps(self) -> bool:
        return any(e.at_step is not None for e in self.events)

    def window(self, action: str, target: str, at: float) -> bool:
        """Whether `target` is inside an event of `action` at time `at` (e.g. partitioned)."""
        return any(
            e.action == action and e.target == target and e.at <= at < e.at + e.delay
            for e in self.events
        )


def learner_ids(n: int) -> list[str]:
    return [f"learner-{i}" for i in range(n)]


def long_tailed_delay(rng: random.Random, median: float, cap: float) -> float:
    """Restart delay: log-normal around `median` (sigma 0.8), capped. Most replacements are
    quick, a few take much longer (a pod that waits for a node)."""
    return round(min(cap, rng.lognormvariate(0.0, 0.8) * median), 3)


def _periodic(
    part: str,
    rng: random.Random,
    ids: list[str],
    span: float,
    every: float,
    start: float,
    steps: bool = False,
) -> list[ChaosEvent]:
    """One event every ~`every` s (jittered +-30%) on a random learner, from `start`; with
    `steps` the axis is inner steps (the same draws, `at_step` rounded)."""
    events = []
    t = start + rng.uniform(0, every / 2)
    while t < span - 2.0:
        target = rng.choice(ids)
        if part == "kill":
            delay = long_tailed_delay(rng, median=2.0, cap=10.0)
        elif part == "pause":
            delay = round(rng.uniform(1.0, 4.0), 3)
        else:  # partition
            delay = round(rng.uniform(3.0, 8.0), 3)
        if steps:
            events.append(ChaosEvent(0.0, part, target, delay, at_step=round(t)))  # type: ignore[arg-type]
        else:
            events.append(ChaosEvent(at=round(t, 3), action=part, target=target, delay=delay))  # type: ignore[arg-type]
        t += every * rng.uniform(0.7, 1.3)
    return events


DEFAULT_EVERY: Final[dict[str, float]] = {"kill": 12.0, "pause": 8.0, "partition": 15.0}
DEFAULT_EVERY_STEPS: Final[dict[str, float]] = {"kill": 120.0, "pause": 80.0, "partition": 150.0}
"""In steps: a tiny learner trains ~10 steps per second on this machine's 2 cores."""
STEP_PARTS: Final[tuple[str, ...]] = ("kill", "pause", "partition", "slow", "straggler")


def make_schedule(
    kind: str,
    *,
    learners: int,
    seconds: float | None = None,
    seed: int = 0,
    every: float | dict[str, float] | None = None,
    start: float | None = None,
    steps: int | None = None,
) -> Schedule:
    """The schedule of one chaos kind (or a `+` combination) over `seconds` with `learners`.

    kill: one random learner SIGKILLed every ~`every` s (default 12), back after a
    long-tailed delay (median 2 s, capped at 10 s). pause: one learner frozen every ~8 s for
    1-4 s. partition: one learner cut off every ~15 s for 3-8 s. slow: the upper half of the
    learners (rounded down, at least one) twice as slow. straggler: one random learner
    1.2-2x slower. scavenge: the upper half of the slots (at least one) absent at the start,
    added at 35% of the run and removed at 75%. sync: the synchronizer killed once, at 40% of
    the run, back after 2 s. `every` may be a number (all periodic parts) or a dict per part;
    `start` defaults to 5 s.

    `steps` instead of `seconds`: the same draws on an axis of inner steps (`every` and
    `start` in steps, defaults DEFAULT_EVERY_STEPS and 24), learner parts only (STEP_PARTS).
    """
    if learners < 1:
        raise ValueError(f"learners must be >= 1, got {learners}")
    if (seconds is None) == (steps is None):
        raise ValueError("a schedule spans either seconds or steps")
    span = float(seconds if seconds is not None else steps)  # type: ignore[arg-type]
    if span <= 0:
        raise ValueError(f"{'seconds' if steps is None else 'steps'} must be > 0, got {span:g}")
    parts = [] if kind == "none" else kind.split("+")
    unknown = [p for p in parts if p not in PARTS]
    if unknown or len(set(parts)) != len(parts):
        raise ValueError(
            f"chaos must be none or a '+' combination of distinct {', '.join(PARTS)}; got {kind!r}"
        )
    if steps is not None and (off := [p for p in parts if p not in STEP_PARTS]):
        raise ValueError(
            f"chaos part {off[0]!r} has no schedule in steps (only {', '.join(STEP_PARTS)})"
        )
    defaults = DEFAULT_EVERY if steps is None else DEFAULT_EVERY_STEPS
    start = start if start is not None else (5.0 if steps is None else 24.0)
    seconds = span
    ids = learner_ids(learners)
    sched = Schedule(kind=kind, seed=seed)
    for part in parts:
        # One stream per part, seeded by the part's name: a part's events are the same alone
        # and combined with others, so "kill" stays comparable across studies.
        rng = random.Random(f"{part}:{seed}")
        if part in defaults:
            period = every.get(part) if isinstance(every, dict) else every
            sched.events += _periodic(
                part, rng, ids, span, period or defaults[part], start, steps is not None
            )
        elif part == "slow":
            n_slow = max(1, learners // 2)
            for lid in ids[learners - n_slow :]:
                sched.slow_factors[lid] = 2.0
        elif part == "straggler":
            sched.slow_factors[rng.choice(ids)] = round(rng.uniform(1.2, 2.0), 3)
        elif part == "scavenge":
            extra = ids[learners - max(1, learners // 2) :] if learners > 1 else []
            sched.absent = list(extra)
            for lid in extra:
                sched.events.append(ChaosEvent(round(0.35 * seconds, 3), "add", lid, 0.0))
                sched.events.append(ChaosEvent(round(0.75 * seconds, 3), "remove", lid, 0.0))
        elif part == "sync":
            sched.events.append(ChaosEvent(round(0.4 * seconds, 3), "kill_sync", SYNCHRONIZER, 2.0))
    sched.events.sort(key=lambda e: (e.at_step or 0, e.at, e.target, e.action))
    return sched


def pop_due(schedule: Schedule, now: float, steps_of: Callable[[str], int]) -> list[ChaosEvent]:
    """Take from `schedule` the events due at `now` seconds into the run, in order: a timed
    one once `at <= now`, one in steps once `steps_of(target) >= at_step`."""
    due = [
        e
        for e in schedule.events
        if (e.at <= now if e.at_step is None else steps_of(e.target) >= e.at_step)
    ]
    if due:
        taken = set(map(id, due))
        schedule.events = [e for e in schedule.events if id(e) not in taken]
    return due


@runtime_checkable
class ChaosInjector(Protocol):
    """What applies a schedule's events to something real (local/supervisor.py: learner and
    synchronizer processes, data-parallel ranks; local/k8s_chaos.py: pods)."""

    def inject(self, ev: ChaosEvent, now: float) -> dict[str, Any] | None:
        """Apply `ev` now (`now`: seconds into the run). Returns the fields its record adds
        to the event's, or None when the event did not apply (its target is gone, done, or
        the event means nothing here)."""
        ...

    def recover(self, now: float) -> None:
        """Undo what is due by `now`: resume the paused, restart the killed, reconnect the
        cut off."""
        ...


def inject_due(
    injector: ChaosInjector, schedule: Schedule, now: float, steps_of: Callable[[str], int]
) -> list[dict[str, Any]]:
    """Inject the events of `schedule` due at `now` (pop_due), then recover what is due.
    Returns one record per applied event: the event's fields, `applied_at` and the
    injector's own fields."""
    records = []
    for ev in pop_due(schedule, now, steps_of):
        extra = injector.inject(ev, now)
        if extra is not None:
            records.append({**asdict(ev), "applied_at": round(now, 3), **extra})
    injector.recover(now)
    return records


class StepCounter:
    """Inner steps each learner has logged (its JSON-lines records with `dt`, every
    incarnation: the file is appended to), read incrementally: a call reads only the whole
    lines appended since the last one."""

    def __init__(self, path_of: Callable[[str], Path]) -> None:
        self.path_of = path_of
        self._seen: dict[str, tuple[int, int]] = {}

    def __call__(self, lid: str) -> int:
        offset, steps = self._seen.get(lid, (0, 0))
        try:
            with open(self.path_of(lid), "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            return steps
        whole = chunk.rfind(b"\n") + 1
        steps += sum(
            1 for line in chunk[:whole].splitlines() if b'"step"' in line and b'"dt"' in line
        )
        self._seen[lid] = (offset + whole, steps)
        return steps
