"""A merge computes and persists without its fragment's lock: posts of that fragment are
admitted meanwhile, into the next round and a new pending-log segment, and nothing is lost
or merged twice whatever instant a crash picks.

    pytest tests/unit/test_merge_unlocked.py

Real files and real threads; a "crash" is an exception at a chosen instant of the merge
(the synchronizer object is then dropped and a new one opens the same state directory,
as a restart after SIGKILL does). Each test runs for both ways a merge becomes durable:
its fragment file written before it is served (`snapshot_lag = 0`), and a merge journal
record (the default; synchronizer/storage/journal.py), the file written after.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ddiloco.synchronizer.merge import NonFiniteMerge
from ddiloco.synchronizer.service import Synchronizer
from tests.unit.test_contract import A, B, Clock, make, served, start, update


@pytest.fixture(params=[0, 4], ids=["file-before-serving", "journal"])
def lag(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def hold_save(sync: Synchronizer, during: Any) -> None:
    """Run `during()` (in the merging thread) once the merge has computed, just before what
    makes it durable is written: its fragment file, or its journal record."""
    if sync.settings.tuning.snapshot_lag == 0:
        real = sync.store.save_fragment

        def save(p: int, fs: Any) -> None:
            during()
            real(p, fs)

        sync.store.save_fragment = save  # type: ignore[method-assign]
        return
    journal = sync.fragments[1].journal
    append = journal.append

    def record(rec: Any) -> None:
        during()
        append(rec)

    journal.append = record  # type: ignore[method-assign]


def crash_after_durable(sync: Synchronizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raise SystemExit once the merge is durable, before anything is let go of: the log's
    segments (file mode), or before it is even served (journal mode: the file not written)."""

    def crash(*_: object) -> None:
        raise SystemExit("killed once the merge was durable")

    if sync.settings.tuning.snapshot_lag == 0:
        monkeypatch.setattr(sync.store.pending(1), "drop", crash)
        return
    journal = sync.fragments[1].journal
    append = journal.append

    def record(rec: Any) -> None:
        append(rec)
        crash()

    monkeypatch.setattr(journal, "append", record)


def test_posts_are_admitted_while_a_merge_persists(tmp_path: Path, lag: int) -> None:
    sync = make(tmp_path, Clock(), snapshot_lag=lag)
    start(sync)
    first = update("a", 1, A, step=10)
    assert sync.submit(first).status == "accepted"
    saving, release = threading.Event(), threading.Event()
    answers: dict[str, str] = {}

    def wait() -> None:
        saving.set()
        assert release.wait(10)

    hold_save(sync, wait)
    merger = threading.Thread(target=sync.merge, args=(1,))
    merger.start()
    assert saving.wait(10)

    def post() -> None:
        got = sync.submit(update("b", 1, B, step=10))
        answers["b"] = f"{got.status} for version {got.round_version}"  # after the one in flight
        answers["again"] = sync.submit(first).status  # taken by the merge: still held

    poster = threading.Thread(target=post)
    poster.start()
    poster.join(5)  # with the fragment's lock held through the save, this would hang
    alive = poster.is_alive()
    release.set()
    merger.join(10)
    poster.join(10)
    assert not alive, "a post waited for the merge's fsync"
    assert answers == {"b": "accepted for version 2", "again": "duplicate"}
    assert sync.versions() == [0, 1]
    assert torch.allclose(served(sync, 1), A)  # a alone (lr 1, momentum 0)
    status = sync.status().fragments[1]
    assert (status.contributors_pending, status.tokens_pending) == (1, 100)  # b waits
    assert sync.merge(1) == 2
    moved = served(sync, 1) - A  # b's direction (scaled by the live share of its tokens)
    assert moved[0] == 0 and moved[1] > 0


def test_a_crash_before_the_merge_is_durable_loses_neither_round(tmp_path: Path, lag: int) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, snapshot_lag=lag)
    start(sync)
    assert sync.submit(update("a", 1, A, step=10)).status == "accepted"

    def post_then_crash() -> None:
        assert sync.submit(update("b", 1, B, step=10)).status == "accepted"
        raise SystemExit("killed before the merged fragment was written")

    hold_save(sync, post_then_crash)
    with pytest.raises(SystemExit):
        sync.merge(1)
    assert len(list(tmp_path.glob("pending-0001.*.log"))) == 2  # the sealed one and the new
    again = make(tmp_path, clock, snapshot_lag=lag)
    assert again.versions() == [0, 0]
    status = again.status().fragments[1]
    assert (status.contributors_pending, status.tokens_pending) == (2, 200)
    assert again.submit(update("a", 1, A, step=10)).status == "duplicate"
    assert again.merge(1) == 1
    merged = served(again, 1)
    assert merged.norm() > 0 and not torch.allclose(merged, A)  # b is in it too


def test_a_crash_once_the_merge_is_durable_merges_nothing_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lag: int
) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, snapshot_lag=lag)
    start(sync)
    assert sync.submit(update("a", 1, A, step=10)).status == "accepted"
    hold_save(sync, lambda: sync.submit(update("b", 1, B, step=10)))
    crash_after_durable(sync, monkeypatch)
    with pytest.raises(SystemExit):
        sync.merge(1)
    assert sync.versions() == [0, 0 if lag else 1]  # a journaled merge: not served yet
    again = make(tmp_path, clock, snapshot_lag=lag)
    assert again.versions() == [0, 1]
    assert torch.allclose(served(again, 1), A)
    status = again.status().fragments[1]
    assert (status.contributors_pending, status.tokens_pending) == (1, 100)  # b, not a
    assert again.submit(update("a", 1, A, step=10)).status == "duplicate"
    assert again.merge(1) == 2
    assert torch.allclose(served(again, 1), A + B)
    again.flush()
    assert len(list(tmp_path.glob("pending-0001*.log"))) == 0  # every segment merged
    assert again.store.load_fragment(1).version == 2


def test_a_refused_merge_puts_its_round_back_beside_what_came_meanwhile(
    tmp_path: Path, lag: int
) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, snapshot_lag=lag)
    start(sync)
    assert sync.submit(update("a", 1, A, step=10)).status == "accepted"
    real = sync.fragments[1].shared.policy

    class Refusing:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def merge(self, *args: Any, **kw: Any) -> Any:
            assert sync.submit(update("a", 1, A * 0.5, step=11)).status == "accepted"
            assert sync.submit(update("b", 1, B, step=10)).status == "accepted"
            raise NonFiniteMerge("as if the sum overflowed")

    sync.fragments[1].shared.policy = Refusing()  # type: ignore[assignment]
    assert sync.merge(1) is None
    sync.fragments[1].shared.policy = real
    status = sync.status().fragments[1]
    assert (status.contributors_pending, status.tokens_pending) == (2, 300)  # a's two added
    assert sync.status().merges_refused == 1
    assert sync.submit(update("a", 1, A, step=10)).status == "duplicate"
    again = make(tmp_path, clock)  # the refused round's segment was kept: all three replay
    assert again.status().fragments[1].tokens_pending == 300
    assert sync.merge(1) == 1
    expected = make(tmp_path / "b", clock)  # the same three in one round, never refused
    start(expected)
    for body in (update("a", 1, A, step=10), update("a", 1, A * 0.5, step=11)):
        expected.submit(body)
    expected.submit(update("b", 1, B, step=10))
    assert expected.merge(1) == 1
    assert torch.allclose(served(sync, 1), served(expected, 1))
