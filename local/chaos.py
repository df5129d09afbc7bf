"""Chaos as data: a seeded, replayable schedule of what to do to which process, and when.

    schedule = make_schedule("kill", learners=3, seconds=60, seed=1)
    for event in schedule.events: ...   # ChaosEvent(at=7.3, action="kill", target="learner-1", ...)

Actions: `kill` (SIGKILL a learner; it is restarted `delay` seconds later), `pause`
(SIGSTOP, then SIGCONT after `delay`), `kill_sync` (SIGKILL the synchronizer, restarted
after `delay` on the same state directory). Slow learners are not events: `slow_factors`
says how much slower each learner runs from the start. The same schedule, given the same
seed, is identical on every machine, so runs and baselines can be compared.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import Literal

Action = Literal["kill", "pause", "kill_sync"]
Kind = Literal["none", "kill", "pause", "slow", "sync"]
KINDS: tuple[str, ...] = ("none", "kill", "pause", "slow", "sync")


@dataclass(frozen=True)
class ChaosEvent:
    at: float
    """Seconds after the run started."""
    action: Action
    target: str
    """A learner id, or "synchronizer"."""
    delay: float
    """Seconds until the process is restarted (kill) or resumed (pause)."""


@dataclass
class Schedule:
    kind: str
    seed: int
    events: list[ChaosEvent] = field(default_factory=list)
    slow_factors: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def learner_ids(n: int) -> list[str]:
    return [f"learner-{i}" for i in range(n)]


def long_tailed_delay(rng: random.Random, median: float, cap: float) -> float:
    """Restart delay: log-normal around `median` (sigma 0.8), capped. Most replacements are
    quick, a few take much longer (a pod that waits for a node)."""
    return round(min(cap, rng.lognormvariate(0.0, 0.8) * median), 3)


def make_schedule(
    kind: str,
    *,
    learners: int,
    seconds: float,
    seed: int = 0,
    every: float | None = None,
    start: float = 5.0,
) -> Schedule:
    """The schedule of one chaos kind over a run of `seconds` with `learners` learners.

    kill: one random learner SIGKILLed every ~`every` s (default 12), back after a
    long-tailed delay (median 2 s). pause: one learner frozen every ~`every` s (default 8)
    for 1-4 s. slow: half the learners (rounded down, at least one) twice as slow.
    sync: the synchronizer killed once, at 40% of the run, back after 2 s.
    """
    if kind not in KINDS:
        raise ValueError(f"chaos must be one of {', '.join(KINDS)}, got {kind!r}")
    if learners < 1:
        raise ValueError(f"learners must be >= 1, got {learners}")
    rng = random.Random(f"{kind}:{seed}")
    ids = learner_ids(learners)
    sched = Schedule(kind=kind, seed=seed)
    if kind == "slow":
        n_slow = max(1, learners // 2)
        for lid in ids[learners - n_slow :]:
            sched.slow_factors[lid] = 2.0
    elif kind == "sync":
        sched.events.append(
            ChaosEvent(
                at=round(0.4 * seconds, 3), action="kill_sync", target="synchronizer", delay=2.0
            )
        )
    elif kind in ("kill", "pause"):
        period = every or (12.0 if kind == "kill" else 8.0)
        t = start + rng.uniform(0, period / 2)
        while t < seconds - 2.0:
            target = rng.choice(ids)
            if kind == "kill":
                delay = long_tailed_delay(rng, median=2.0, cap=10.0)
            else:
                delay = round(rng.uniform(1.0, 4.0), 3)
            sched.events.append(ChaosEvent(at=round(t, 3), action=kind, target=target, delay=delay))  # type: ignore[arg-type]
            t += period * rng.uniform(0.7, 1.3)
    return sched
