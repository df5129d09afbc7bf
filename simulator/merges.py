"""Which computed steps reach a merge: the round protocol replayed on learners' step times.

    from ddiloco.simulator.merges import merged_work_ratio
    merged_work_ratio(step_times, fragments=4, H=24, quorum=1, grace_s=0.07, deliver_s=0.09)

`step_times[m]` holds the times at which learner m completed its inner steps (from
`calibrate.replay`). Per fragment p, on the event loop (algorithm.md §4-§6, and the
synchronizer's `rounds.py` / stale-base rule):
- a learner hands p over when p falls due (step s with s mod H = p*H/P) or, while a round
  of p is open, at its next step (the synchronizer asks for fragments it is collecting);
- the first hand-over opens a round; once `quorum` learners are in, the grace window runs
  and the round merges when it expires or when every learner is in;
- a hand-over whose base version is older than the fragment's current one is rejected
  (its round already merged);
- after a merge every learner adopts the new version at its first step completed at least
  `deliver_s` later; adopting overwrites the fragment, so the steps since the learner's
  previous adoption that did not go into this merge are lost, as are the steps between
  a contribution and the adoption that follows it.
The ratio is merged (step, fragment) pairs over computed ones, as the local report's
tokens_merged / tokens_computed with a constant batch.
"""

from __future__ import annotations

import numpy as np

from ddiloco.simulator.engine import Event, EventLoop


class _Fragment:
    """Rounds of one fragment. State: version, open round, per-learner base version and
    step count at the last adoption, merged steps so far."""

    def __init__(
        self,
        loop: EventLoop,
        steps: list[np.ndarray],
        quorum: int,
        grace_s: float,
        deliver_s: float,
        ask_s: float = 0.0,
    ) -> None:
        self.loop, self.steps = loop, steps
        self.quorum, self.grace_s, self.deliver_s = quorum, grace_s, deliver_s
        self.ask_s = ask_s
        n = len(steps)
        self.version = 0
        self.base = [0] * n
        self.reset_at = [0] * n  # steps completed when the learner last adopted p
        self.members: dict[int, int] = {}  # learner -> step count of its hand-over
        self.deadline: Event | None = None
        self.round_open = False
        self.merged_steps = 0
        self.rejected = 0
        self.merges = 0
        self.contributions = 0

    def handover(self, m: int, count: int) -> None:
        if self.base[m] < self.version:
            self.rejected += 1  # its round already merged; it will adopt the new version
            return
        if m in self.members:
            self.members[m] = count  # a learner that sends again replaces its contribution
            return
        if not self.round_open:
            self.round_open = True
            self._ask_others(m)
        self.members[m] = count
        if self.deadline is None and len(self.members) >= self.quorum:
            self.deadline = self.loop.after(self.grace_s, self.merge)
        if self.deadline is not None and len(self.members) == len(self.steps):
            EventLoop.cancel(self.deadline)
            self.merge()

    def _ask_others(self, opener: int) -> None:
        now = self.loop.now
        for m, times in enumerate(self.steps):
            if m == opener:
                continue
            i = int(np.searchsorted(times, now + self.ask_s, side="right"))
            if i < len(times):
                self.loop.at(float(times[i]), self._asked, m, i + 1)

    def _asked(self, m: int, count: int) -> None:
        if self.round_open and m not in self.members:
            self.handover(m, count)

    def merge(self) -> None:
        self.deadline = None
        self.merges += 1
        self.contributions += len(self.members)
        for m, count in self.members.items():
            self.merged_steps += max(0, count - self.reset_at[m])
        self.members = {}
        self.round_open = False
        self.version += 1
        now = self.loop.now
        for m, times in enumerate(self.steps):
            i = int(np.searchsorted(times, now + self.deliver_s, side="left"))
            if i < len(times):
                self.loop.at(float(times[i]), self._adopt, m, i + 1, self.version)

    def _adopt(self, m: int, count: int, version: int) -> None:
        if version > self.base[m]:
            self.base[m] = self.version
            self.reset_at[m] = count


def merged_work_ratio(
    step_times: list[np.ndarray],
    *,
    fragments: int,
    H: int,
    quorum: int,
    grace_s: float,
    deliver_s: float,
    ask_s: float = 0.0,
) -> float:
    """Merged (step, fragment) pairs over computed ones (see the module docstring)."""
    total = sum(len(t) for t in step_times)
    if total == 0:
        return 0.0
    merged = 0
    for p in range(fragments):
        loop = EventLoop()
        frag = _Fragment(loop, step_times, min(quorum, len(step_times)), grace_s, deliver_s, ask_s)
        offset = (p * H) // fragments
        for m, times in enumerate(step_times):
            counts = np.arange(1, len(times) + 1)
            for i in np.flatnonzero(counts % H == offset % H):
                loop.at(float(times[i]), frag.handover, m, int(i) + 1)
        loop.run()
        merged += frag.merged_steps
    return merged / (total * fragments)
