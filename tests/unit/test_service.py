"""The synchronizer's rounds end to end in-process, on an injected clock.

    pytest tests/unit/test_service.py

Quorum reached -> grace window -> merge of exactly those who made it; a late update for
the merged round goes into the next one (up to max_staleness); durable state resumes exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.service import SyncError, Synchronizer
from ddiloco.wire import codec
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    Heartbeat,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

LAYOUT = Layout(fragments=[FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[4])])])


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path: Path, clock: Clock, **kw: object) -> Synchronizer:
    base: dict[str, object] = {
        "token": "t",
        "state_dir": tmp_path,
        "quorum": 1,
        "grace_gamma": 0.5,
        "tau": 2,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "max_update_ratio": 10.0,  # the toy deltas below move each weight by up to 3
        "merge_scale": "contributors",  # the arithmetic below; `live`: test_merge_scale.py
    }
    return Synchronizer(SyncSettings(**(base | kw)), clock=clock)  # type: ignore[arg-type]


def init(sync: Synchronizer, learners: list[str]) -> None:
    for lid in learners:
        sync.join(JoinRequest(learner_id=lid))
    sync.init(codec.encode({"w": torch.zeros(4)}, {LAYOUT_KEY: LAYOUT.model_dump_json()}))


def beat(sync: Synchronizer, lid: str, step_s: float = 1.0) -> None:
    sync.heartbeat(
        Heartbeat(
            learner_id=lid,
            step=10,
            steps=[10],
            tokens=[100],
            base_versions=[0],
            step_seconds=step_s,
        )
    )


def send(sync: Synchronizer, lid: str, value: float, base: int = 0, step: int = 10) -> str:
    meta = UpdateMeta(
        learner_id=lid, fragment=0, base_version=base, steps=10, tokens=100, learner_step=step
    )
    return sync.submit(codec.encode({"w": torch.full((4,), value)}, meta.to_metadata())).status


def test_quorum_grace_merge_and_late_update_merged_into_the_next_round(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock)
    init(sync, ["a", "b", "c"])
    for lid in "abc":
        beat(sync, lid, step_s=1.0)  # slowest live learner: 1 s steps -> grace cap 1 s
    assert send(sync, "a", 1.0) == "accepted"  # quorum K=1 reached now; grace = 0.5*(2*1 - 0) = 1.0
    assert sync.due() == []
    clock.now += 0.6
    assert send(sync, "b", 3.0) == "accepted"  # within the grace window
    assert sync.due() == []
    clock.now += 0.5  # grace expired; c never came
    assert sync.due() == [0]
    assert sync.merge(0) == 1
    # lr 1, momentum 0: new global = mean of a and b (equal weights) = 2.0, RDA of equal dirs
    _, body = sync.fragment(0)
    assert torch.allclose(codec.decode(body)["w"].float(), torch.full((4,), 2.0))
    # c's update was based on version 0 and missed that round: it waits for the next one,
    # without starting it (the fragment keeps its cadence)
    assert send(sync, "c", 2.0) == "accepted"
    clock.now += 5
    assert sync.due() == []
    assert send(sync, "a", 4.0, base=1, step=20) == "accepted"  # a's next round starts
    clock.now += 1.1
    assert sync.due() == [0]
    assert sync.merge(0) == 2
    # c's own progress (+2 from its base) and a's (+4) move the current copy: mean +3 -> 5
    _, body = sync.fragment(0)
    assert torch.allclose(codec.decode(body)["w"].float(), torch.full((4,), 5.0))
    st = sync.status()
    assert st.contributions_merged == 4
    assert st.mean_staleness == pytest.approx(1 / 4)  # 0, 0, 1 and 0 versions behind


def test_an_update_older_than_max_staleness_is_refused(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, grace=False, max_staleness=1)
    init(sync, ["a", "b"])
    for version in (1, 2):
        beat(sync, "a")
        send(sync, "a", 1.0, base=version - 1, step=10 * version)
        assert sync.merge(0) == version
    with pytest.raises(SyncError, match="more than 1 rounds already merged") as err:
        send(sync, "b", 3.0, base=0)  # two merges behind
    assert err.value.kind == "stale"
    assert send(sync, "b", 3.0, base=1) == "accepted"  # one behind: waits for the next round
    strict = make(tmp_path / "strict", clock, grace=False, max_staleness=0)
    init(strict, ["a", "b"])
    send(strict, "a", 1.0)
    strict.merge(0)
    with pytest.raises(SyncError, match="already merged"):
        send(strict, "b", 3.0)


def test_two_hand_overs_in_one_round_add_up(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock)
    init(sync, ["a", "b"])
    for lid in "ab":
        beat(sync, lid, step_s=1.0)
    send(sync, "a", 1.0, step=10)
    send(sync, "a", 2.0, step=20)  # a's next progress, before the round merged
    assert send(sync, "a", 2.0, step=20) == "duplicate"  # a re-send of the same update
    clock.now += 1.1
    sync.merge(0)
    _, body = sync.fragment(0)  # 1 + 2, one learner
    assert torch.allclose(codec.decode(body)["w"].float(), torch.full((4,), 3.0))
    st = sync.status()
    assert (st.contributions_merged, st.tokens_merged) == (1, 200)


def test_without_grace_only_the_first_is_merged(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, grace=False)
    init(sync, ["a", "b"])
    beat(sync, "a")
    beat(sync, "b")
    send(sync, "a", 1.0)
    assert sync.due() == [0]
    sync.merge(0)
    assert sync.status().contributions_merged == 1  # b was not waited for
    send(sync, "b", 3.0)  # so it waits for the next round
    assert sync.due() == []
    send(sync, "a", 1.0, base=1, step=20)
    assert sync.due() == [0]
    assert sync.merge(0) == 2
    assert sync.status().contributions_merged == 3


def test_quorum_k_waits_for_k_learners(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, quorum=2)
    init(sync, ["a", "b", "c"])
    for lid in "abc":
        beat(sync, lid)
    send(sync, "a", 1.0)
    clock.now += 30  # however long: no merge below the quorum
    for lid in "abc":
        beat(sync, lid)
    assert sync.due() == []
    send(sync, "b", 1.0)
    clock.now += 5
    assert sync.due() == [0]


def test_restart_resumes_versions_momentum_and_ledger(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, outer_momentum=0.9)
    init(sync, ["a"])
    beat(sync, "a")
    for step in (10, 20, 30):
        send(sync, "a", 0.5, base=sync.versions()[0], step=step)
        sync.merge(0)
    before = sync.fragments[0].state
    sync.snapshots.abandon()  # killed: its writer writes no more (nor beside the restart)
    again = make(tmp_path, clock, outer_momentum=0.9)
    after = again.fragments[0].state
    assert again.versions() == [3]
    assert torch.equal(after.params["w"], before.params["w"]) and torch.equal(
        after.momentum["w"], before.momentum["w"]
    )
    assert set(again.learners) == {"a"}
    # the restarted synchronizer still knows the learner and refuses a replay as a duplicate
    meta = UpdateMeta(
        learner_id="a", fragment=0, base_version=2, steps=10, tokens=100, learner_step=30
    )
    assert (
        again.submit(codec.encode({"w": torch.ones(4)}, meta.to_metadata())).status == "duplicate"
    )
