"""Quorum + adaptive grace window, driven by an injected clock (the paper's Eq. 3).

pytest tests/unit/test_rounds.py
"""

from __future__ import annotations

import pytest

from ddiloco.synchronizer.rounds import GracePolicy, Rounds


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


def test_grace_window_formula_and_clamps() -> None:
    g = GracePolicy(gamma=0.5, cap_steps=1.0, default_s=0.7, tau=2)
    assert g.window(None, None, None) == 0.7  # before any estimate: the default
    # slack = 2*1.0 - (0.2 + 0.3) = 1.5 -> 0.75, under the cap of one step (1.0)
    assert g.window(1.0, 0.2, 0.3) == pytest.approx(0.75)
    assert g.window(1.0, 0.0, 0.0) == pytest.approx(1.0)  # 0.5*2 = 1.0, the cap
    assert g.window(1.0, 1.5, 1.0) == 0.0  # no slack left: no grace
    assert GracePolicy(enabled=False).window(1.0, 0.0, 0.0) == 0.0


def hear(rounds: Rounds[str], step_seconds: float | None, *ids: str) -> None:
    for learner in ids:
        rounds.heard(learner, step_seconds)


def test_quorum_then_grace_then_merge() -> None:
    clock = Clock()
    rounds: Rounds[str] = Rounds(2, quorum=2, grace=GracePolicy(gamma=0.5, tau=2), clock=clock)
    hear(rounds, 1.0, "a", "b", "c")
    rounds.add(0, "a", "ua")
    assert rounds.due() == []  # quorum 2 not reached
    assert rounds.collecting() == [0]  # others are asked to send fragment 0 now
    clock.advance(0.4)
    rounds.add(0, "b", "ub")  # quorum reached at 0.4 s: xi_quorum = 0.4
    r = rounds.rounds[0]
    assert r.quorum_at == clock.now
    # slack = 2*1.0 - (0.4 + 0) = 1.6 -> gamma*slack = 0.8 (cap 1.0)
    assert r.grace == pytest.approx(0.8)
    clock.advance(0.5)
    assert rounds.due() == []  # grace still open: c may come
    clock.advance(0.31)
    assert rounds.due() == [0]  # grace expired without c
    assert rounds.take(0) == {"a": "ua", "b": "ub"}
    assert rounds.collecting() == []


def test_a_round_is_due_at_its_windows_end_or_when_every_live_learner_is_in() -> None:
    clock = Clock()
    rounds: Rounds[str] = Rounds(2, quorum=1, grace=GracePolicy(gamma=0.5, tau=2), clock=clock)
    hear(rounds, 1.0, "a", "b")
    rounds.add(0, "a", "ua")  # window: min(0.5 * 2, 1) = 1 s
    end = clock.now + rounds.rounds[0].grace
    clock.advance(1.3)  # the merge loop looks late: the round closed at its window's end
    assert rounds.due() == [0]
    clock.advance(0.2)
    assert rounds.due() == [0]  # asked again: it closed when it first was due
    assert rounds.take_round(0).due_at == pytest.approx(end)
    rounds.add(1, "a", "ua")
    clock.advance(0.1)
    rounds.add(1, "b", "ub")  # every live learner in, 0.9 s before the window's end
    assert rounds.rounds[1].due_at is None
    assert rounds.due() == [1]
    assert rounds.take_round(1).due_at == clock.now


def test_xi_step_is_the_slowest_live_learner_and_forgets_the_silent() -> None:
    clock = Clock()
    rounds: Rounds[str] = Rounds(1, quorum=1, liveness_s=10.0, clock=clock)
    assert rounds.xi_step() is None  # nobody reported: the grace window uses its default
    rounds.heard("fast", 0.5)
    rounds.heard("slow", 2.0)  # 4x the other: within `step_ratio`, counted as it is
    rounds.heard("mute")  # alive, no step time yet: does not count
    assert rounds.xi_step() == 2.0
    assert rounds.live() == {"fast", "slow", "mute"}
    clock.advance(6)
    rounds.heard("fast", 0.5)
    clock.advance(6)  # slow and mute silent for 12 s > 10 s
    assert rounds.live() == {"fast"}
    assert rounds.xi_step() == 0.5  # a dead straggler no longer stretches the window


def test_round_merges_at_once_when_every_live_learner_is_in() -> None:
    clock = Clock()
    rounds: Rounds[str] = Rounds(1, quorum=1, clock=clock)
    hear(rounds, 10.0, "a", "b")
    rounds.add(0, "a", "x")
    assert rounds.due() == []  # grace open (up to one 10 s step)
    rounds.add(0, "b", "y")
    assert rounds.due() == [0]  # nobody left to wait for
    assert clock.now == 100.0


def test_without_grace_the_quorum_merges_immediately() -> None:
    clock = Clock()
    rounds: Rounds[str] = Rounds(1, quorum=1, grace=GracePolicy(enabled=False), clock=clock)
    hear(rounds, 1.0, "a", "b", "c")
    rounds.add(0, "a", "x")
    assert rounds.due() == [0]


def test_dead_learners_are_not_waited_for() -> None:
    clock = Clock()
    rounds: Rounds[str] = Rounds(1, quorum=1, liveness_s=10.0, clock=clock)
    hear(rounds, 5.0, "a", "b")
    rounds.add(0, "a", "x")
    assert rounds.due() == []
    clock.advance(4.0)  # still inside the grace window (one 5 s step)
    rounds.heard("a", 5.0)
    assert rounds.due() == []
    clock.advance(0.5)
    assert rounds.due() == []
    clock.advance(6.0)  # b silent for 10.5 s: gone, so not waited for
    rounds.heard("a", 5.0)
    assert rounds.live() == {"a"}
    assert rounds.due() == [0]


def test_a_learner_sending_again_replaces_its_contribution() -> None:
    rounds: Rounds[str] = Rounds(1, quorum=2, clock=Clock())
    rounds.add(0, "a", "old")
    rounds.add(0, "a", "new")
    assert rounds.pending(0) == 1
    assert rounds.take(0) == {"a": "new"}


def test_a_late_contribution_waits_for_the_next_round_without_starting_it() -> None:
    clock = Clock()
    rounds: Rounds[str] = Rounds(1, quorum=1, grace=GracePolicy(enabled=False), clock=clock)
    hear(rounds, 1.0, "late", "b")
    rounds.add(0, "late", "x", opens=False)
    assert rounds.collecting() == []  # nobody is asked for fragment 0 on its account
    clock.advance(30)
    hear(rounds, 1.0, "late", "b")
    assert rounds.due() == []  # however long it waits
    rounds.add(0, "b", "y")  # a contribution made for this round starts it
    assert rounds.due() == [0]
    assert rounds.take(0) == {"late": "x", "b": "y"}  # and the late one merges with it


def test_restored_contributions_wait_without_starting_a_round() -> None:
    clock = Clock()
    rounds: Rounds[str] = Rounds(1, quorum=1, grace=GracePolicy(enabled=False), clock=clock)
    hear(rounds, 1.0, "a", "b")
    rounds.add(0, "a", "x")
    taken = rounds.take(0)
    rounds.restore(0, taken)  # a refused merge gives them back
    assert rounds.due() == [] and rounds.collecting() == []
    rounds.add(0, "b", "y")
    assert rounds.take(0) == {"a": "x", "b": "y"}


def test_quorum_must_be_positive() -> None:
    with pytest.raises(ValueError, match="quorum"):
        Rounds(1, quorum=0)
