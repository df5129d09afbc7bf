"""The simulator's event loop: time order, FIFO ties, cancellation, run(until).

.venv/bin/pytest tests/unit/test_sim_engine.py
"""

from __future__ import annotations

import pytest

from ddiloco.simulator.engine import EventLoop


def test_events_run_in_time_order_whatever_the_scheduling_order() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    for t, name in [(5.0, "c"), (1.0, "a"), (3.0, "b")]:
        loop.at(t, lambda t=t, name=name: seen.append((loop.now, name)))
    loop.run()
    assert seen == [(1.0, "a"), (3.0, "b"), (5.0, "c")]


def test_simultaneous_events_run_in_scheduling_order() -> None:
    loop = EventLoop()
    seen: list[int] = []
    for i in range(5):
        loop.at(2.0, seen.append, i)
    loop.run()
    assert seen == [0, 1, 2, 3, 4]


def test_cancelled_events_do_not_run_and_callbacks_can_schedule_more() -> None:
    loop = EventLoop()
    seen: list[str] = []
    dropped = loop.at(1.0, seen.append, "dropped")
    loop.at(2.0, lambda: loop.after(1.5, seen.append, "chained"))
    EventLoop.cancel(dropped)
    loop.run()
    assert seen == ["chained"]
    assert loop.now == 3.5
    assert loop.processed == 2


def test_run_until_leaves_later_events_queued() -> None:
    loop = EventLoop()
    seen: list[float] = []
    for t in (1.0, 10.0, 20.0):
        loop.at(t, seen.append, t)
    assert loop.run(until=15.0) == 15.0
    assert seen == [1.0, 10.0]
    assert loop.pending() == 1
    loop.run()
    assert seen == [1.0, 10.0, 20.0]


def test_scheduling_in_the_past_is_refused() -> None:
    loop = EventLoop(start=10.0)
    with pytest.raises(ValueError, match="before now"):
        loop.at(5.0, print)
    with pytest.raises(ValueError, match="delay"):
        loop.after(-1.0, print)
