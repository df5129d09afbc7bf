"""Merge rounds: minimum quorum plus the adaptive grace window (paper §3, Eq. 3).

Pure bookkeeping with an injected clock; no HTTP, no tensors: a contribution is opaque here.
`Rounds` owns every input of the grace window: which learners are alive and how long their
inner steps take (both from `heard`), how long quorums take to gather (xi_quorum) and how
long merges take (xi_sync).

    rounds = Rounds(num_fragments=4, quorum=1, liveness_s=10, clock=fake_clock)
    rounds.heard("l0", step_seconds=0.05)        # every heartbeat
    rounds.add(p, "l0", item)                    # an accepted contribution
    for p in rounds.due(): items = rounds.take(p)
    rounds.observe_sync(merge_seconds)

Round of fragment p: it starts with the first contribution made for it (late ones wait in
it without starting it); once `quorum` learners have contributed the grace window opens:

    slack = tau * xi_step - (xi_quorum + xi_sync);  grace = clamp(gamma * slack, 0, cap)

with xi_step the step time of the slowest live learner, each live learner's step time
counted at most `step_ratio` times the median of the other live learners' (one implausible
report cannot hold every round open: the window and its cap follow a plausible slowest
learner), and the round merges when it expires, or at once when every live learner is in.
A learner that contributes again before the merge puts its (summed) contribution in place of
its earlier one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Ema:
    """Exponential moving average; `value` is None until the first sample."""

    alpha: float = 0.2
    value: float | None = None

    def update(self, sample: float) -> float:
        self.value = (
            sample if self.value is None else self.value + self.alpha * (sample - self.value)
        )
        return self.value


@dataclass
class Round(Generic[T]):
    contributions: dict[str, T] = field(default_factory=dict)
    started_at: float | None = None
    quorum_at: float | None = None
    deadline: float | None = None
    grace: float = 0.0
    due_at: float | None = None
    """When the round became due: its window's end, or when every live learner was in
    (set by `due`, which the merge loop polls)."""


@dataclass(kw_only=True)
class GracePolicy:
    """Eq. 3 of the paper with our defaults (gamma 0.5, cap one step of the slowest learner)."""

    enabled: bool = True
    gamma: float = 0.5
    cap_steps: float = 1.0
    default_s: float = 0.5
    tau: int = 2

    def window(
        self, xi_step: float | None, xi_quorum: float | None, xi_sync: float | None
    ) -> float:
        if not self.enabled:
            return 0.0
        if xi_step is None:
            return self.default_s
        cap = self.cap_steps * xi_step
        slack = self.tau * xi_step - ((xi_quorum or 0.0) + (xi_sync or 0.0))
        return min(max(self.gamma * slack, 0.0), cap)


class Rounds(Generic[T]):
    """The open round of every fragment. State: contributions, quorum and grace times, when
    each learner was last heard and its step time, the xi_quorum and xi_sync averages.
    Failure of a learner needs no handling here: a learner not heard for `liveness_s` is not
    live, so it is neither waited for nor counted in xi_step."""

    def __init__(
        self,
        num_fragments: int,
        *,
        quorum: int = 1,
        grace: GracePolicy | None = None,
        ema_alpha: float = 0.2,
        liveness_s: float = 10.0,
        step_ratio: float = 4.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {quorum}")
        if not step_ratio >= 1.0:
            raise ValueError(f"step_ratio must be >= 1, got {step_ratio}")
        self.quorum = quorum
        self.step_ratio = step_ratio
        self.grace = grace or GracePolicy()
        self.liveness_s = liveness_s
        self.clock = clock
        self.rounds: list[Round[T]] = [Round() for _ in range(num_fragments)]
        self.xi_quorum = Ema(ema_alpha)
        self.xi_sync = Ema(ema_alpha)
        self.last_heard: dict[str, float] = {}
        self.step_seconds: dict[str, float] = {}

    # ---- learners ----------------------------------------------------------------
    def heard(self, learner_id: str, step_seconds: float | None = None) -> None:
        """A learner spoke (joined, heartbeat, update); `step_seconds` is its step time."""
        self.last_heard[learner_id] = self.clock()
        if step_seconds is not None and step_seconds > 0:
            self.step_seconds[learner_id] = step_seconds

    def forget(self, learner_id: str) -> None:
        """Drop what is kept of a learner whose record the synchronizer dropped."""
        self.last_heard.pop(learner_id, None)
        self.step_seconds.pop(learner_id, None)

    def live(self) -> set[str]:
        horizon = self.clock() - self.liveness_s
        return {k for k, t in self.last_heard.items() if t >= horizon}

    def xi_step(self, live: set[str] | None = None) -> float | None:
        """Step time of the slowest live learner, None before any report; each learner's
        counted at most `step_ratio` times the median of the other live learners' (when
        there are others), so one implausible report cannot stretch every window."""
        live = self.live() if live is None else live
        steps = sorted(self.step_seconds[k] for k in live if k in self.step_seconds)
        if len(steps) < 2:
            return steps[0] if steps else None
        return max(min(v, self.step_ratio * _median_without(steps, i)) for i, v in enumerate(steps))

    # ---- rounds ------------------------------------------------------------------
    def add(self, p: int, learner_id: str, item: T, *, opens: bool = True) -> None:
        """Put a learner's contribution in p's round, in place of its earlier one. One with
        `opens=False` (an update that missed the round it was made for) waits in the round
        without starting it: it merges with the next round that a current contribution
        starts, so late work joins the fragment's regular cadence instead of adding merges."""
        r = self.rounds[p]
        now = self.clock()
        if r.started_at is None and opens:
            r.started_at = now
        r.contributions[learner_id] = item
        if r.started_at is None:
            return
        if r.deadline is None and len(r.contributions) >= self.quorum:
            r.quorum_at = now
            self.xi_quorum.update(now - r.started_at)
            r.grace = self.grace.window(self.xi_step(), self.xi_quorum.value, self.xi_sync.value)
            r.deadline = now + r.grace

    def due(self) -> list[int]:
        """Fragments whose round should merge now."""
        live = self.live()
        now = self.clock()
        out = []
        for p, r in enumerate(self.rounds):
            if r.deadline is None:
                continue
            if now >= r.deadline or live <= set(r.contributions):
                if r.due_at is None:
                    r.due_at = min(now, r.deadline)
                out.append(p)
        return out

    def take(self, p: int) -> dict[str, T]:
        """Close the round of fragment p and return its contributions."""
        return self.take_round(p).contributions

    def take_round(self, p: int) -> Round[T]:
        """Close the round of fragment p and return it whole: its contributions and its
        times (started, quorum, grace), which the merge's metrics observe."""
        r = self.rounds[p]
        self.rounds[p] = Round()
        return r

    def restore(
        self, p: int, contributions: dict[str, T], combine: Callable[[T, T], T] | None = None
    ) -> None:
        """Put back the contributions of a merge that was refused: they wait, without
        starting a round, for the next one. The round that opened while the merge ran keeps
        its times and its contributions; a learner in both gets `combine(taken, newer)`."""
        r = self.rounds[p]
        for learner_id, c in contributions.items():
            newer = r.contributions.get(learner_id)
            if newer is None:
                r.contributions[learner_id] = c
            else:
                assert combine is not None, "restore() over a newer contribution needs combine"
                r.contributions[learner_id] = combine(c, newer)

    def collecting(self) -> list[int]:
        """Fragments with a round under way: learners are asked to send them now."""
        return [p for p, r in enumerate(self.rounds) if r.started_at is not None]

    def pending(self, p: int) -> int:
        return len(self.rounds[p].contributions)

    def observe_sync(self, seconds: float) -> None:
        self.xi_sync.update(seconds)


def _median_without(ordered: list[float], i: int) -> float:
    """The median of sorted `ordered` without its element `i` (at least two elements)."""
    n = len(ordered) - 1

    def at(j: int) -> float:
        return ordered[j] if j < i else ordered[j + 1]

    return (at((n - 1) // 2) + at(n // 2)) / 2
