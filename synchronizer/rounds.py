"""Merge rounds: minimum quorum plus the adaptive grace window (algorithm.md §5, §6.1-§6.2).

Pure bookkeeping with an injected clock; the service feeds it contributions and asks
which fragments are due to merge. No HTTP, no tensors: a contribution is opaque here.

    rounds = Rounds(num_fragments=4, quorum=1, clock=fake_clock)
    rounds.add(p, "l0", item, now_live={"l0", "l1"})
    for p in rounds.due(now_live={"l0", "l1"}, xi_step=0.05): items = rounds.take(p)

Round of fragment p: it starts with the first contribution made for it (late ones wait in
it without starting it); once `quorum` learners have contributed the grace window opens:

    slack = tau * xi_step - (xi_quorum + xi_sync);  grace = clamp(gamma * slack, 0, cap)

and the round merges when it expires, or at once when every live learner is in.
A learner that sends again before the merge replaces its own contribution.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
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
    """The open round of every fragment. State: contributions, quorum and grace times,
    the xi_quorum and xi_sync moving averages. Failure of a learner needs no handling here:
    it simply does not contribute, and `due` stops waiting for learners not in `now_live`."""

    def __init__(
        self,
        num_fragments: int,
        *,
        quorum: int = 1,
        grace: GracePolicy | None = None,
        ema_alpha: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {quorum}")
        self.quorum = quorum
        self.grace = grace or GracePolicy()
        self.clock = clock
        self.rounds: list[Round[T]] = [Round() for _ in range(num_fragments)]
        self.xi_quorum = Ema(ema_alpha)
        self.xi_sync = Ema(ema_alpha)
        self.xi_step: float | None = None

    def add(self, p: int, learner_id: str, item: T, *, opens: bool = True) -> None:
        """Put (or replace) a learner's contribution in p's round. One with `opens=False` (an
        update that missed the round it was made for) waits in the round without starting
        it: it merges with the next round that a current contribution starts, so late work
        joins the fragment's regular cadence instead of adding merges to it."""
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
            r.grace = self.grace.window(self.xi_step, self.xi_quorum.value, self.xi_sync.value)
            r.deadline = now + r.grace

    def due(self, now_live: Iterable[str], xi_step: float | None = None) -> list[int]:
        """Fragments whose round should merge now."""
        if xi_step is not None:
            self.xi_step = xi_step
        live = set(now_live)
        now = self.clock()
        out = []
        for p, r in enumerate(self.rounds):
            if r.deadline is None:
                continue
            everyone_in = live <= set(r.contributions)
            if now >= r.deadline or everyone_in:
                out.append(p)
        return out

    def take(self, p: int) -> dict[str, T]:
        """Close the round of fragment p and return its contributions."""
        r = self.rounds[p]
        self.rounds[p] = Round()
        return r.contributions

    def collecting(self) -> list[int]:
        """Fragments with a round under way: learners are asked to send them now."""
        return [p for p, r in enumerate(self.rounds) if r.started_at is not None]

    def pending(self, p: int) -> int:
        return len(self.rounds[p].contributions)

    def drop_learner(self, learner_id: str) -> None:
        """Forget a learner's pending contributions (e.g. it rejoined with fresh state)."""
        for r in self.rounds:
            r.contributions.pop(learner_id, None)

    def observe_sync(self, seconds: float) -> None:
        self.xi_sync.update(seconds)
