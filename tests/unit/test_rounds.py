"""Quorum + adaptive grace window, driven by an injected clock (algorithm.md §6.1-§6.2).

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


def test_quorum_then_grace_then_merge() -> None:
    clock = Clock()
    rounds: Rounds[str] = Rounds(2, quorum=2, grace=GracePolicy(gamma=0.5, tau=2), clock=clock)
    live = {"a", "b", "c"}
    rounds.add(0, "a", "ua")
    assert rounds.due(live, xi_step=1.0) == []  # quorum 2 not reached
    assert rounds.collecting() == [0]  # others are asked to send fragment 0 now
    clock.advance(0.4)
    rounds.add(0, "b", "ub")  # quorum reached at 0.4 s: xi_quorum = 0.4
    r = rounds.rounds[0]
    assert r.quorum_at == clock.now
    # slack = 2*1.0 - (0.4 + 0) = 1.6 -> gamma*slack = 0.8 (cap 1.0)
    assert r.grace == pytest.approx(0.8)
    clock.advance(0.5)
    assert rounds.due(live) == []  # grace still open: c may come
    clock.advance(0.31)
    assert rounds.due(live) == [0]  # grace expired without c
    assert rounds.take(0) == {"a": "ua", "b": "ub"}
    assert rounds.collecting() == []


def test_round_merges_at_once_when_every_live_learner_is_in() -> None:
    clock = Clock()
    rounds: Rounds[str] = Rounds(1, quorum=1, clock=clock)
    rounds.add(0, "a", "x")
    assert rounds.due({"a", "b"}, xi_step=10.0) == []  # grace open (up to one 10 s step)
    rounds.add(0, "b", "y")
    assert rounds.due({"a", "b"}) == [0]  # nobody left to wait for
    assert clock.now == 100.0


def test_without_grace_the_quorum_merges_immediately() -> None:
    clock = Clock()
    rounds: Rounds[str] = Rounds(1, quorum=1, grace=GracePolicy(enabled=False), clock=clock)
    rounds.add(0, "a", "x")
    assert rounds.due({"a", "b", "c"}, xi_step=1.0) == [0]


def test_dead_learners_are_not_waited_for() -> None:
    clock = Clock()
    rounds: Rounds[str] = Rounds(1, quorum=1, clock=clock)
    rounds.add(0, "a", "x")
    assert rounds.due({"a", "b"}, xi_step=5.0) == []
    assert rounds.due({"a"}) == [0]  # b went silent: no reason to wait


def test_a_learner_sending_again_replaces_its_contribution() -> None:
    rounds: Rounds[str] = Rounds(1, quorum=2, clock=Clock())
    rounds.add(0, "a", "old")
    rounds.add(0, "a", "new")
    assert rounds.pending(0) == 1
    assert rounds.rounds[0].deadline is None  # one learner is not a quorum of two


def test_a_late_contribution_waits_for_the_next_round_without_starting_it() -> None:
    clock = Clock()
    rounds: Rounds[str] = Rounds(1, quorum=1, grace=GracePolicy(enabled=False), clock=clock)
    rounds.add(0, "late", "x", opens=False)
    assert rounds.collecting() == []  # nobody is asked for fragment 0 on its account
    clock.advance(30)
    assert rounds.due({"late", "b"}, xi_step=1.0) == []  # however long it waits
    rounds.add(0, "b", "y")  # a contribution made for this round starts it
    assert rounds.due({"late", "b"}) == [0]
    assert rounds.take(0) == {"late": "x", "b": "y"}  # and the late one merges with it


def test_quorum_must_be_positive() -> None:
    with pytest.raises(ValueError, match="quorum"):
        Rounds(1, quorum=0)
