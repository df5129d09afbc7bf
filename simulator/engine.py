"""The discrete-event core of `ddiloco simulate`: a clock and a time-ordered event queue.

    from ddiloco.simulator.engine import EventLoop
    loop = EventLoop()
    loop.at(5.0, lambda: ...)          # run a callback at t = 5 s
    handle = loop.after(2.0, fn, arg)  # t = now + 2 s; loop.cancel(handle) drops it
    loop.run(until=86_400.0)

Events run in time order; events at the same instant run in the order they were scheduled
(a sequence number breaks ties), so a run is a pure function of its inputs and its seed.
Callbacks may schedule further events; nothing is ever scheduled in the past.

Tests: `.venv/bin/pytest tests/unit/test_sim_engine.py`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(order=True)
class Event:
    """One scheduled callback; ordered by (time, seq). `cancelled` events are skipped."""

    time: float
    seq: int
    fn: Callable[..., Any] = field(compare=False)
    args: tuple[Any, ...] = field(compare=False, default=())
    cancelled: bool = field(compare=False, default=False)


class EventLoop:
    """A simulated clock (`now`, seconds) and a heap of pending events.

    State: the current time and the pending events. `run(until)` pops events in order and
    stops at the first one later than `until` (it stays queued) or when none are left; the
    clock then reads `until` (or the last event's time if the queue ran dry first).
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now: float = start
        self._queue: list[Event] = []
        self._seq: int = 0
        self.processed: int = 0

    def at(self, time: float, fn: Callable[..., Any], *args: Any) -> Event:
        if time < self.now:
            raise ValueError(f"cannot schedule at t={time} before now={self.now}")
        event = Event(time, self._seq, fn, args)
        self._seq += 1
        heapq.heappush(self._queue, event)
        return event

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> Event:
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        return self.at(self.now + delay, fn, *args)

    @staticmethod
    def cancel(event: Event | None) -> None:
        if event is not None:
            event.cancelled = True

    def pending(self) -> int:
        return sum(not e.cancelled for e in self._queue)

    def run(self, until: float = float("inf")) -> float:
        queue = self._queue
        while queue:
            event = queue[0]
            if event.time > until:
                break
            heapq.heappop(queue)
            if event.cancelled:
                continue
            self.now = event.time
            self.processed += 1
            event.fn(*event.args)
        if until != float("inf"):
            self.now = max(self.now, until)
        return self.now
