"""The synchronizer's contract, in-process on a real state directory and an injected clock.

    pytest tests/unit/test_contract.py

- the configured merge rule is the one that runs (a setting that changes nothing is a defect);
- an update answered `accepted` is merged exactly once, whatever crashes in between: a new
  `Synchronizer` on the same directory is what a SIGKILLed one restarts as, since every
  durable write happens before the call that made it returns;
- a re-send is a duplicate however many updates came since;
- one finite but huge update on a fresh synchronizer is refused, and nothing non-finite is
  ever persisted or served.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.merge import Contribution, MergePolicy, merge_fragment
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.wire import codec
from ddiloco.wire.errors import PayloadError, Refusal
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    Heartbeat,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

LAYOUT = Layout(
    fragments=[
        FragmentSpec(index=0, embedding=True, tensors=[TensorSpec(name="emb", shape=[2])]),
        FragmentSpec(index=1, tensors=[TensorSpec(name="w", shape=[2])]),
    ]
)
# two learners' progress on a 2-vector: orthogonal, of norms 1 and 3, equal weights
A, B = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(state: Path, clock: Clock, **kw: object) -> Synchronizer:
    base: dict[str, object] = {
        "token": "t",
        "state_dir": state,
        "quorum": 1,
        "grace": False,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "max_update_ratio": 10.0,
        "broadcast_encoding": "float32",  # the served copy is Theta exactly: the merge's figures
    }
    return Synchronizer(SyncSettings(**(base | kw)), clock=clock)  # type: ignore[arg-type]


def start(sync: Synchronizer, learners: str = "ab") -> None:
    for lid in learners:
        sync.join(JoinRequest(learner_id=lid))
    init = {"emb": torch.zeros(2), "w": torch.zeros(2)}
    sync.init(codec.encode(init, {LAYOUT_KEY: LAYOUT.model_dump_json()}))


def beat(sync: Synchronizer, lid: str) -> None:
    sync.heartbeat(
        Heartbeat(
            learner_id=lid,
            step=1,
            steps=[1, 1],
            tokens=[1, 1],
            base_versions=[0, 0],
            step_seconds=1.0,
        )
    )


def update(
    lid: str, p: int, value: torch.Tensor, *, step: int, base: int = 0, inc: int = 1
) -> bytes:
    meta = UpdateMeta(
        learner_id=lid,
        fragment=p,
        base_version=base,
        steps=10,
        tokens=100,
        learner_step=step,
        incarnation=inc,
        encoding="bfloat16" if value.dtype == torch.bfloat16 else "float32",
    )
    return codec.encode({"emb" if p == 0 else "w": value}, meta.to_metadata())


def served(sync: Synchronizer, p: int) -> torch.Tensor:
    _, body = sync.fragment(p)
    return next(iter(codec.decode(body).values()))


# ---- the merge rule --------------------------------------------------------------------
def test_rda_and_mean_give_different_results_on_the_same_contributions() -> None:
    deltas = [{"w": A}, {"w": B}]
    mean = merge_fragment(deltas, [1.0, 1.0], "mean")["w"]
    rda = merge_fragment(deltas, [1.0, 1.0], "rda")["w"]
    assert torch.allclose(mean, torch.tensor([0.5, 1.5]))
    # RDA: mean length 2 along the mean direction of the unit vectors (1,1)/sqrt(2)
    assert torch.allclose(rda, torch.tensor([2.0, 2.0]) / 2**0.5)
    assert not torch.allclose(mean, rda)


@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_the_configured_rule_runs_on_dense_fragments_and_the_mean_on_embeddings(
    tmp_path: Path, rule: str
) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, merge=rule)
    assert MergePolicy.from_settings(sync.settings).rule == rule
    start(sync)
    beat(sync, "a")
    beat(sync, "b")
    for p in (0, 1):
        assert sync.submit(update("a", p, A, step=10)).status == "accepted"
        assert sync.submit(update("b", p, B, step=10)).status == "accepted"
        assert sync.merge(p) == 1
    # lr 1, mu 0: Theta moves by exactly the merged progress
    mean = torch.tensor([0.5, 1.5])
    assert torch.allclose(served(sync, 0), mean)  # embeddings: always the mean
    dense = served(sync, 1)
    if rule == "mean":
        assert torch.allclose(dense, mean)
    else:
        assert torch.allclose(dense, torch.tensor([2.0, 2.0]) / 2**0.5)
    st = sync.status()
    assert [f.merge for f in st.fragments] == ["mean", rule]


# ---- accepted means kept -------------------------------------------------------------
def test_accepted_updates_survive_a_crash_and_merge_once(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, quorum=2, merge="mean")
    start(sync)
    assert sync.submit(update("a", 1, A, step=10)).status == "accepted"
    assert sync.submit(update("a", 1, A, step=20)).status == "accepted"  # sums with the first
    # crash: the object is dropped with the round open (nothing merged yet)
    again = make(tmp_path, clock, quorum=2, merge="mean")
    st = again.status()
    assert st.fragments[1].tokens_pending == 200 and st.fragments[1].contributors_pending == 1
    assert again.submit(update("a", 1, A, step=20)).status == "duplicate"  # held already
    assert again.submit(update("b", 1, B, step=10)).status == "accepted"
    assert again.merge(1) == 1
    # the weighted mean of a's summed progress (2, 0) and b's (0, 3): a has 20 steps and 200
    # tokens (weight 200^2/20 = 2000), b 10 and 100 (1000): (4/3, 1)
    assert torch.allclose(served(again, 1), torch.tensor([4 / 3, 1.0]))
    assert again.snapshots is not None
    again.snapshots.abandon()  # killed: its writer writes no more (nor beside the restart)
    third = make(
        tmp_path, clock, quorum=2, merge="mean"
    )  # and after another restart nothing is replayed
    assert third.status().fragments[1].tokens_pending == 0
    assert third.status().fragments[1].tokens_merged == 300
    assert torch.allclose(served(third, 1), torch.tensor([4 / 3, 1.0]))


def test_a_crash_between_merge_and_emptying_the_log_merges_nothing_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, snapshot_lag=0)  # the file before serving (journal: journal.py)
    start(sync)
    sync.submit(update("a", 1, A, step=10))
    log = sync.store.pending(1)

    def crash(segments: object) -> None:
        raise SystemExit("killed after the fragment file was written")

    monkeypatch.setattr(log, "drop", crash)
    with pytest.raises(SystemExit):
        sync.merge(1)
    again = make(tmp_path, clock, snapshot_lag=0)  # the log still holds the merged update
    assert again.versions() == [0, 1]
    assert again.status().fragments[1].tokens_pending == 0  # skipped: the file says merged
    assert again.submit(update("a", 1, A, step=10)).status == "duplicate"
    assert torch.allclose(served(again, 1), A)


def test_a_torn_log_record_is_cut_off_and_the_whole_ones_kept(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, quorum=2)
    start(sync)
    sync.submit(update("a", 1, A, step=10))
    path = sync.store.pending(1).path
    whole = path.stat().st_size
    with open(path, "ab") as f:  # a crash in the middle of the next append
        f.write(b"\x99" * 40)
    again = make(tmp_path, clock, quorum=2)
    assert again.status().fragments[1].tokens_pending == 100
    assert path.stat().st_size == whole


def test_a_re_send_is_a_duplicate_however_many_updates_came_since(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock)
    start(sync)
    first = update("a", 1, A * 0.01, step=1)
    assert sync.submit(first).status == "accepted"
    for step in range(2, 600):  # more than the 512 ids the old window remembered
        base = sync.versions()[1]
        sync.submit(update("a", 1, A * 0.01, step=step, base=base))
        sync.merge(1)
    version = sync.versions()[1]
    assert sync.submit(first).status == "duplicate"
    sync.snapshots.abandon()  # killed: its writer writes no more (nor beside the restart)
    restarted = make(tmp_path, clock)
    assert restarted.submit(first).status == "duplicate"  # the guard survives a restart
    assert restarted.versions()[1] == version
    # a new incarnation starts its steps again and is not mistaken for a re-send
    assert restarted.join(JoinRequest(learner_id="a")).incarnation == 2
    fresh = update("a", 1, A * 0.01, step=1, base=version, inc=2)
    assert restarted.submit(fresh).status == "accepted"


def test_a_rejoin_keeps_the_learners_accepted_work(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, quorum=2)
    start(sync)
    sync.submit(update("a", 1, A, step=10))
    sync.join(JoinRequest(learner_id="a"))  # a replacement takes the slot
    assert sync.status().fragments[1].tokens_pending == 100


# ---- bad input changes nothing -----------------------------------------------------------
def test_one_huge_finite_update_on_a_fresh_synchronizer_is_refused(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, max_update_ratio=2.0)
    start(sync)
    before = sync.fragment(1)
    with pytest.raises(PayloadError, match="overflows") as err:
        sync.submit(update("a", 1, torch.full((2,), 3e38), step=10))
    assert err.value.kind == Refusal.INVALID
    with pytest.raises(PayloadError, match="max_update_ratio"):
        sync.submit(update("a", 1, torch.full((2,), 1e3), step=10))  # finite norm, still huge
    assert sync.fragment(1) == before
    assert sync.status().fragments[1].tokens_pending == 0
    assert sync.submit(update("a", 1, A, step=10)).status == "accepted"  # a plausible one


def test_a_merge_whose_result_is_not_finite_is_refused_and_its_work_waits(
    tmp_path: Path,
) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, outer_lr=3e38, outer_momentum=0.0)  # 2 * 3e38 overflows
    start(sync)
    sync.submit(update("a", 1, 2 * A, step=10))
    before = sync.fragment(1)
    assert sync.merge(1) is None
    assert sync.fragment(1) == before
    assert sync.store.load_fragment(1).version == 0  # nothing persisted
    st = sync.status()
    assert st.merges_refused == 1 and st.fragments[1].tokens_pending == 100


def test_policy_never_returns_a_non_finite_fragment() -> None:
    policy = MergePolicy(outer=MergePolicy().outer.__class__(lr=3e38, momentum=0.0))
    spec = LAYOUT.fragments[1]
    c = Contribution({"w": torch.tensor([1e3, 1e3])}, steps=1, tokens=1, base_version=0)
    with pytest.raises(ArithmeticError, match="non-finite"):
        policy.merge(spec, {"w": torch.zeros(2)}, {"w": torch.zeros(2)}, 0, [c])


def test_refusals_are_counted_by_reason_and_exported(tmp_path: Path) -> None:
    from ddiloco.synchronizer import metrics

    clock = Clock()
    sync = make(tmp_path, clock, max_update_ratio=2.0)
    start(sync)
    wrong_shape = codec.encode(
        {"w": torch.zeros(3)},
        UpdateMeta.from_metadata(codec.read_metadata(update("a", 1, A, step=9))).to_metadata(),
    )
    for payload in (update("a", 1, torch.full((2,), 1e3), step=10), wrong_shape):
        with pytest.raises(PayloadError) as err:
            sync.submit(payload)
        sync.reject(err.value.kind)  # what the route's handler does with every refusal
    sync.submit(update("a", 1, A, step=1))
    text = metrics.render(sync.status).decode()
    assert 'ddiloco_refusals_total{reason="invalid"} 2.0' in text
    assert 'ddiloco_tokens_pending{fragment="1"} 100.0' in text


@pytest.mark.parametrize("lag", [0, 4], ids=["file-before-serving", "journal"])
def test_a_merge_that_cannot_be_written_changes_nothing_and_its_work_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lag: int
) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, snapshot_lag=lag)
    start(sync)
    sync.submit(update("a", 1, A, step=10))
    before = sync.fragment(1)

    def disk_full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    if lag:  # what makes the merge durable is its journal record
        monkeypatch.setattr(sync.fragments[1].journal, "append", disk_full)
    else:
        monkeypatch.setattr(sync.store, "save_fragment", disk_full)
    with pytest.raises(OSError):
        sync.merge(1)
    assert sync.fragment(1) == before and sync.fragments[1].version == 0
    assert sync.status().fragments[1].tokens_pending == 100
    assert sync.submit(update("a", 1, A, step=10)).status == "duplicate"  # still held
    monkeypatch.undo()
    sync.submit(update("b", 1, B, step=10))  # the next round, with the waiting work in it
    assert sync.merge(1) == 1
    assert sync.status().fragments[1].tokens_merged == 200
