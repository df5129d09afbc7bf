"""Chaos schedules are data: seeded, deterministic, combinable, and round-trip through JSON.

pytest tests/unit/test_chaos.py
"""

from __future__ import annotations

import pytest

from ddiloco.local.chaos import (
    ACTIONS,
    KINDS,
    PARTS,
    SYNCHRONIZER,
    ChaosEvent,
    Schedule,
    learner_ids,
    make_schedule,
)


@pytest.mark.parametrize("kind", [*KINDS, "kill+pause+partition+sync", "scavenge+kill"])
def test_same_seed_same_schedule_and_json_round_trip(kind: str) -> None:
    a = make_schedule(kind, learners=6, seconds=90, seed=3)
    b = make_schedule(kind, learners=6, seconds=90, seed=3)
    assert a == b
    assert Schedule.from_json(a.to_json()) == a
    assert a.to_json() == b.to_json()


def test_different_seeds_differ() -> None:
    a = make_schedule("kill+pause", learners=4, seconds=120, seed=1)
    b = make_schedule("kill+pause", learners=4, seconds=120, seed=2)
    assert a.events != b.events


def test_kill_schedule_is_pinned() -> None:
    """Golden values: a change in how 'kill' draws its events would silently change every
    recorded bench figure."""
    s = make_schedule("kill", learners=4, seconds=60, seed=1)
    assert [(e.at, e.target, e.delay) for e in s.events] == [
        (6.676, "learner-2", 1.922),
        (21.588, "learner-2", 3.02),
        (30.692, "learner-3", 1.346),
        (45.799, "learner-0", 1.098),
        (56.687, "learner-0", 1.283),
    ]
    assert all(5.0 <= e.at < 58.0 for e in s.events)
    assert all(0 < e.delay <= 10.0 for e in s.events)


def test_adding_a_part_does_not_move_the_others() -> None:
    kill = make_schedule("kill", learners=4, seconds=100, seed=7)
    both = make_schedule("kill+pause", learners=4, seconds=100, seed=7)
    assert [e for e in both.events if e.action == "kill"] == kill.events
    assert {e.action for e in both.events} == {"kill", "pause"}


def test_events_sorted_and_targets_valid() -> None:
    s = make_schedule("kill+pause+partition+sync", learners=5, seconds=200, seed=0)
    times = [e.at for e in s.events]
    assert times == sorted(times)
    ids = set(learner_ids(5)) | {SYNCHRONIZER}
    assert all(e.target in ids and e.action in ACTIONS for e in s.events)
    assert [e.target for e in s.events if e.action == "kill_sync"] == [SYNCHRONIZER]


def test_pause_and_partition_durations() -> None:
    s = make_schedule("pause+partition", learners=3, seconds=300, seed=4)
    pauses = [e.delay for e in s.events if e.action == "pause"]
    cuts = [e.delay for e in s.events if e.action == "partition"]
    assert pauses and all(1.0 <= d <= 4.0 for d in pauses)
    assert cuts and all(3.0 <= d <= 8.0 for d in cuts)
    first = next(e for e in s.events if e.action == "partition")
    assert s.window("partition", first.target, first.at + first.delay / 2)
    assert not s.window("partition", first.target, first.at + first.delay + 0.01)


def test_every_per_part() -> None:
    dense = make_schedule("kill+pause", learners=4, seconds=200, seed=1, every={"kill": 5.0})
    sparse = make_schedule("kill+pause", learners=4, seconds=200, seed=1, every={"kill": 40.0})
    n = lambda s, a: sum(e.action == a for e in s.events)  # noqa: E731
    assert n(dense, "kill") > 3 * n(sparse, "kill")
    assert n(dense, "pause") == n(sparse, "pause")


def test_slow_half_and_straggler() -> None:
    s = make_schedule("slow", learners=8, seconds=60, seed=0)
    assert s.slow_factors == {f"learner-{i}": 2.0 for i in range(4, 8)}
    assert s.events == []
    t = make_schedule("straggler", learners=8, seconds=60, seed=2)
    assert len(t.slow_factors) == 1
    assert all(1.2 <= f <= 2.0 for f in t.slow_factors.values())


def test_scavenge_adds_then_removes_the_absent_half() -> None:
    s = make_schedule("scavenge", learners=8, seconds=100, seed=0)
    assert s.absent == [f"learner-{i}" for i in range(4, 8)]
    for lid in s.absent:
        mine = [e for e in s.events if e.target == lid]
        assert [(e.action, e.at) for e in mine] == [("add", 35.0), ("remove", 75.0)]
    assert not any(e.target in learner_ids(4) for e in s.events)


@pytest.mark.parametrize(
    "kind", ["bogus", "kill+kill", "kill+", "none+kill", "slow+nonsense", "kill+pause "]
)
def test_bad_kinds_are_refused(kind: str) -> None:
    with pytest.raises(ValueError, match="chaos must be"):
        make_schedule(kind, learners=2, seconds=10)


def test_bad_sizes_and_actions_are_refused() -> None:
    with pytest.raises(ValueError, match="learners"):
        make_schedule("kill", learners=0, seconds=10)
    with pytest.raises(ValueError, match="seconds"):
        make_schedule("kill", learners=2, seconds=0)
    bad = Schedule(kind="x", seed=0, events=[ChaosEvent(1.0, "kill", "learner-0", 1.0)])
    text = bad.to_json().replace('"kill"', '"explode"')
    with pytest.raises(ValueError, match="unknown chaos action"):
        Schedule.from_json(text)


def test_every_part_is_offered() -> None:
    assert set(PARTS) <= set(KINDS)


def test_kubernetes_plan_maps_every_action() -> None:
    from ddiloco.local.k8s_chaos import plan, selector

    s = make_schedule("kill+partition+pause+scavenge+sync", learners=4, seconds=60, seed=5)
    actions = plan(s, job="j")
    assert [a.at for a in actions] == sorted(a.at for a in actions)
    verbs = {a.verb for a in actions}
    assert verbs == {"delete", "evict", "isolate", "heal", "skip"}
    cuts = [e for e in s.events if e.action == "partition"]
    assert sum(a.verb == "isolate" for a in actions) == len(cuts)
    assert sum(a.verb == "heal" for a in actions) == len(cuts)
    assert sum(a.verb == "evict" for a in actions) == sum(e.action == "remove" for e in s.events)
    assert selector("learner-3", "j") == "ddiloco.dev/learner-id=learner-3,ddiloco.dev/job=j"
    assert selector(SYNCHRONIZER) == "app.kubernetes.io/component=synchronizer"
    assert plan(s, job="j") == actions


# ---- schedules in steps -------------------------------------------------------------------
def test_a_schedule_in_steps_fires_on_its_targets_steps() -> None:
    from ddiloco.local.chaos import pop_due

    s = make_schedule("kill+pause", learners=4, steps=360, seed=3)
    assert s.in_steps and s.events
    assert all(e.at_step is not None and 24 <= e.at_step < 358 and e.at == 0 for e in s.events)
    assert [e.at_step for e in s.events] == sorted(e.at_step for e in s.events)  # type: ignore[type-var]
    assert Schedule.from_json(s.to_json()) == s
    assert make_schedule("kill+pause", learners=4, steps=360, seed=3) == s
    first = s.events[0]
    steps = dict.fromkeys(learner_ids(4), 0)
    assert pop_due(s, 1e9, steps.__getitem__) == []  # wall time does not fire them
    steps[first.target] = first.at_step - 1  # type: ignore[operator]
    assert first not in pop_due(s, 0.0, steps.__getitem__)
    steps[first.target] += 1
    due = pop_due(s, 0.0, steps.__getitem__)
    assert first in due and first not in s.events
    assert all(steps[e.target] >= e.at_step for e in due)  # type: ignore[operator]


def test_pop_due_keeps_timed_events_in_time() -> None:
    from ddiloco.local.chaos import pop_due

    s = make_schedule("kill", learners=2, seconds=60, seed=1)
    n = len(s.events)
    cut = s.events[1].at
    due = pop_due(s, cut, lambda _: 0)
    assert len(due) == 2 and all(e.at <= cut for e in due)
    assert len(s.events) == n - 2 and all(e.at > cut for e in s.events)


def test_steps_refuse_what_has_no_step_axis() -> None:
    for kind in ("sync", "scavenge", "kill+sync"):
        with pytest.raises(ValueError, match="no schedule in steps"):
            make_schedule(kind, learners=2, steps=100)
    with pytest.raises(ValueError, match="either seconds or steps"):
        make_schedule("kill", learners=2, seconds=10, steps=10)
    with pytest.raises(ValueError, match="either seconds or steps"):
        make_schedule("kill", learners=2)
    from ddiloco.local.k8s_chaos import plan

    with pytest.raises(ValueError, match="in steps"):
        plan(make_schedule("kill", learners=2, steps=400))


def test_the_step_counter_reads_only_whole_appended_lines(tmp_path) -> None:
    from ddiloco.local.chaos import StepCounter

    count = StepCounter(lambda lid: tmp_path / f"{lid}.jsonl")
    assert count("a") == 0  # no log yet
    log = tmp_path / "a.jsonl"
    log.write_text('{"step": 1, "dt": 0.1}\n{"event": "adopt"}\n{"step": 2, "dt": 0.1}\n')
    assert count("a") == 2
    with log.open("a") as f:
        f.write('{"step": 3, "dt": 0.1}\n{"step": 4, "d')  # the last line still being written
    assert count("a") == 3
    with log.open("a") as f:
        f.write('t": 0.1}\n')
    assert count("a") == 4 and count("a") == 4


def test_ddiloco_local_reads_its_chaos_unit_and_merge_scale(tmp_path) -> None:
    from ddiloco.local.launcher import LocalConfig, LocalRun

    steps = LocalRun(LocalConfig(chaos="kill", chaos_unit="steps", max_steps=200, out=tmp_path))
    assert steps.schedule.in_steps and steps.schedule.events
    timed = LocalRun(LocalConfig(chaos="kill", max_seconds=60, out=tmp_path / "t"))
    assert not timed.schedule.in_steps and timed.schedule.events
    env = LocalRun(LocalConfig(merge_scale="contributors", out=tmp_path / "c"))._sync_child().env
    assert env["DDILOCO_MERGE_SCALE"] == "contributors"
    with pytest.raises(ValueError, match="step budget"):
        LocalConfig(chaos="kill", chaos_unit="steps", out=tmp_path / "x")
