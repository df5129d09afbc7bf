"""The simulator's protocol replay follows the synchronizer's and the learners' rules.

.venv/bin/pytest tests/unit/test_sim_protocol.py

Hand-made timelines: learner a steps at t = 1, 2, 3, ...; learner b half a second later.
With P = 1, H = 4, K = 1 and no grace window a's fresh updates merge the moment they
arrive, so b's (0.5 s later, on the old version) are late.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.fragments import Schedule
from ddiloco.simulator import protocol
from ddiloco.simulator.protocol import (
    Incarnation,
    Learner,
    ProtocolConfig,
    ProtocolResult,
    run_protocol,
)
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.rounds import Rounds

NO_GRACE = ProtocolConfig(fragments=1, H=4, quorum=1, grace=False)


def steps(*times: float, join: float = 0.0, end: float | None = None) -> Incarnation:
    return Incarnation(join, np.array(times), end=end)


def learner(name: str, *incs: Incarnation, silent: list[tuple[float, float]] = ()) -> Learner:  # type: ignore[assignment]
    return Learner(name, step_s=1.0, incarnations=list(incs), silent=list(silent))


def balanced(r: ProtocolResult) -> bool:
    """Every computed token is accounted for exactly once."""
    parts = r.merged + r.refused + r.dropped + r.unsent + r.waiting
    return parts == pytest.approx(r.computed)


class SpyRounds(Rounds[Any]):
    """The service's Rounds, recording what the replay adds."""

    added: ClassVar[list[tuple[int, str, bool]]] = []

    def add(self, p: int, learner_id: str, item: Any, *, opens: bool = True) -> None:
        SpyRounds.added.append((p, learner_id, opens))
        super().add(p, learner_id, item, opens=opens)


def test_defaults_are_the_synchronizers_and_the_learners() -> None:
    cfg, sync = ProtocolConfig(fragments=4, H=24), SyncSettings.model_fields
    for name in ("quorum", "grace", "tau", "max_staleness", "liveness_s", "ema_alpha"):
        assert getattr(cfg, name) == sync[name].default, name
    assert cfg.adoption == LearnerConfig().adoption == "rebase"
    g = cfg.grace_policy()
    assert (g.gamma, g.cap_steps, g.default_s) == (
        sync["grace_gamma"].default,
        sync["grace_cap_steps"].default,
        sync["grace_default_s"].default,
    )
    sched = Schedule(24, 4)
    assert [cfg.offset(p) for p in range(4)] == [sched.offset(p) or 24 for p in range(4)]
    assert cfg.min_request_steps == 12  # learner/diloco.py: max(1, H // 2)


def test_a_late_update_within_max_staleness_merges_in_the_next_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(protocol, "Rounds", SpyRounds)
    SpyRounds.added = []
    a = learner("a", steps(*range(1, 13)))
    b = learner("b", steps(*np.arange(1.5, 13.0)))
    r = run_protocol([a, b], NO_GRACE, horizon=13.0)
    # a merges alone at 4 (v1); b's update of 4.5 is based on v0: late, waits in the next
    # round, which a's fresh update of 8 starts: merged with it. Likewise at 12.
    assert SpyRounds.added == [
        (0, "a", True),
        (0, "b", False),
        (0, "a", True),
        (0, "b", False),
        (0, "a", True),
        (0, "b", False),
    ]
    assert (r.fresh_updates, r.late_updates, r.refused_updates) == (3, 3, 0)
    assert (r.merges, r.contributions) == (3, 5)
    assert r.merged == 4 + 8 + 8  # b's work of steps 1-8 is merged work
    assert r.waiting == 4  # b's last update waits for a round nobody starts before the end
    assert r.staleness_sum == 2 and balanced(r)


def test_an_update_older_than_max_staleness_is_refused() -> None:
    a = learner("a", steps(*range(1, 41)))
    # b steps to 7.5, is frozen (SIGSTOP) until 30, then its step 8 at 30.5 is due: it hands
    # over based on v1 while a has merged v7 (every 4 s), 6 > max_staleness = 4 versions.
    b = learner("b", steps(*np.arange(1.5, 8.0), *np.arange(30.5, 40.0)), silent=[(7.6, 30.0)])
    r = run_protocol([a, b], NO_GRACE, horizon=40.0)
    assert r.refused_updates == 1
    assert r.refused == 4  # steps 5-8 of b: the work of the refused delta only
    assert r.late_updates >= 1 and r.fresh_updates > r.refused_updates
    assert balanced(r)
    tolerant = run_protocol(
        [a, b], ProtocolConfig(fragments=1, H=4, grace=False, max_staleness=8), 40.0
    )
    assert tolerant.refused_updates == 0 and tolerant.merged > r.merged


def offset_learners(n: int, step_s: float, steps_each: int) -> list[Learner]:
    """n learners starting a third of H apart, so their own schedules never line up."""
    out = []
    for i in range(n):
        start = i * 8 * step_s
        times = start + step_s * np.arange(1, steps_each + 1)
        out.append(Learner(f"l{i}", step_s, [Incarnation(start, times)]))
    return out


def test_without_failures_rebase_merges_nearly_all_work_and_overwrite_does_not() -> None:
    fleet = offset_learners(3, 0.1, 2000)
    cfg = ProtocolConfig(fragments=4, H=24, quorum=1)
    rebase = run_protocol(fleet, cfg, horizon=205.0)
    assert rebase.merged_work_ratio > 0.98  # only what was not handed over by the end
    assert rebase.dropped == 0 and rebase.refused_updates == 0 and balanced(rebase)
    overwrite = run_protocol(fleet, ProtocolConfig(fragments=4, H=24, adoption="overwrite"), 205.0)
    assert overwrite.dropped > 0 and balanced(overwrite)
    assert overwrite.merged_work_ratio < rebase.merged_work_ratio - 0.02


def test_learners_answer_requests_and_fall_into_step() -> None:
    # Offsets of 8 steps would give every learner its own rounds; answering a round's
    # request once H/2 steps stand behind the fragment brings them into one.
    fleet = offset_learners(3, 0.1, 2000)
    r = run_protocol(fleet, ProtocolConfig(fragments=4, H=24), horizon=205.0)
    assert r.contributions / r.merges > 2.8  # nearly every merge has all three
    assert r.merges <= 4 * 2000 / 24 * 1.05  # one round per fragment per H steps


def test_a_killed_process_loses_only_what_it_had_not_handed_over() -> None:
    a = learner("a", steps(*range(1, 31)))
    # b hands fragment 0 over at its steps 4 and 8 (t = 4.5, 8.5), is killed at 10 after
    # step 9, and its replacement joins at 15 with the current version, counting afresh.
    b = learner("b", steps(*np.arange(1.5, 10.0), end=10.0), steps(*np.arange(16, 31), join=15.0))
    r = run_protocol([a, b], NO_GRACE, horizon=31.0)
    # lost: step 9 of b's first process; at the end, b's steps 13-15 (handed over at 12)
    # and a's steps 29-30 (handed over at 28). All that b handed over before the kill merges.
    assert r.unsent == 1 + 3 + 2
    assert r.merged == r.computed - r.unsent and r.waiting == 0
    assert r.refused_updates == 0 and balanced(r)


def test_sampling_fragments_keeps_the_ratio() -> None:
    fleet = offset_learners(4, 1.0, 600)
    full = run_protocol(fleet, ProtocolConfig(fragments=12, H=24), horizon=640.0)
    some = run_protocol(fleet, ProtocolConfig(fragments=12, H=24, sample=3), horizon=640.0)
    assert ProtocolConfig(fragments=12, H=24, sample=3).replayed() == [0, 4, 8]
    assert some.computed == pytest.approx(full.computed / 4)
    assert some.merged_work_ratio == pytest.approx(full.merged_work_ratio, abs=0.01)


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="fragments"):
        ProtocolConfig(fragments=5, H=4)
    with pytest.raises(ValueError, match="adoption"):
        ProtocolConfig(adoption="mix")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token counts"):
        Incarnation(0.0, np.array([1.0, 2.0]), tokens=np.array([1.0]))
