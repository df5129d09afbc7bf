"""Goodput accounting (local/goodput.py): busy time, pauses inside steps, rollbacks, slots.

pytest tests/unit/test_goodput.py
"""

from __future__ import annotations

import pytest

from ddiloco.local.goodput import busy_seconds, goodput, new_step_spans, overlap, union
from ddiloco.local.report import system_uptime


def steps(*spans: tuple[float, float], first: int = 1) -> list[dict[str, float]]:
    return [{"t": b, "dt": b - a, "step": first + i} for i, (a, b) in enumerate(spans)]


def test_union_merges_overlaps_and_drops_empty_spans() -> None:
    assert union([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert overlap((0, 10), [(1, 2), (8, 12)]) == pytest.approx(3.0)


def test_busy_time_is_clipped_to_the_held_window() -> None:
    spans = new_step_spans(steps((0, 1), (1, 2), (2, 3), (3, 4)))
    assert busy_seconds(spans, held=(0, 4)) == pytest.approx(4.0)
    assert busy_seconds(spans, held=(0.5, 2.5)) == pytest.approx(2.0)
    assert busy_seconds(spans, held=(10, 20)) == 0.0


def test_a_pause_inside_a_step_is_not_work() -> None:
    # one 5 s step of which 4 s were SIGSTOPped: 1 s of work
    spans = new_step_spans(steps((0, 5)))
    assert busy_seconds(spans, held=(0, 5), idle=[(0.5, 4.5)]) == pytest.approx(1.0)
    # overlapping pause records do not subtract twice
    assert busy_seconds(spans, held=(0, 5), idle=[(0.5, 4.5), (1, 2)]) == pytest.approx(1.0)


def test_rolled_back_steps_count_once() -> None:
    # steps 1-4, a crash, the group resumes from its checkpoint at step 2 and redoes 3-4
    records = [
        *steps((0, 1), (1, 2), (2, 3), (3, 4)),
        {"event": "start", "t": 6.0, "resume_step": 2},
        *steps((7, 8), (8, 9), first=3),
    ]
    spans = new_step_spans(records)
    assert spans == [(0, 1), (1, 2), (7, 8), (8, 9)]
    assert busy_seconds(spans, held=(0, 10)) == pytest.approx(4.0)


def test_a_plain_restart_record_rolls_nothing_back() -> None:
    records = [*steps((0, 1), (1, 2)), {"event": "start", "t": 3.0}, *steps((4, 5), first=3)]
    assert len(new_step_spans(records)) == 3


def test_goodput_over_slots() -> None:
    assert goodput([9.0, 5.0], [10.0, 10.0]) == pytest.approx(0.7)
    assert goodput([], []) == 0.0
    with pytest.raises(ValueError, match="pair up"):
        goodput([1.0], [1.0, 2.0])


def test_system_uptime_counts_only_long_gaps() -> None:
    assert system_uptime([1, 2, 3, 4], 0, 5, threshold=2) == pytest.approx(1.0)
    # one 6 s gap with a 2 s threshold loses 4 s of 10
    assert system_uptime([2, 8], 0, 10, threshold=2) == pytest.approx(0.6)
