"""The merge journal: a merge is durable as a record of its inputs before it is served, its
fragment file written after (synchronizer/storage/journal.py), and a restart redoes what the file
lacks to the same bits.

    pytest tests/unit/test_journal.py

Real files; the background writer is stopped (`Snapshots.abandon`, what a SIGKILL leaves)
so the files stay behind the served versions, and a new `Synchronizer` on the same
directory is the restart. Default merge settings (RDA per tensor, Nesterov 0.7 / 0.9,
`merge_scale = live`) on tensors with vector tails (37 x 53, 1031), bf16 and fp32 updates.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddiloco.cli.export import from_state_dir
from ddiloco.synchronizer import fragment
from ddiloco.synchronizer.buffers import ALIGN, aligned
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.merge import NonFiniteMerge
from ddiloco.synchronizer.replay import replay
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.synchronizer.storage.journal import MergeJournal
from ddiloco.synchronizer.storage.records import records_in
from ddiloco.synchronizer.storage.segments import FragmentLog
from ddiloco.synchronizer.storage.snapshots import Snapshots
from ddiloco.wire import codec
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)
from tests.unit.test_contract import Clock

SHAPES = {"a": [37, 53], "b": [1031]}
LAYOUT = Layout(
    fragments=[
        FragmentSpec(index=0, tensors=[TensorSpec(name=k, shape=v) for k, v in SHAPES.items()])
    ]
)


def make(state: Path, clock: Clock, **kw: object) -> Synchronizer:
    base: dict[str, object] = {"token": "t", "state_dir": state, "quorum": 1, "grace": False}
    return Synchronizer(SyncSettings(**(base | kw)), clock=clock)  # type: ignore[arg-type]


def start(sync: Synchronizer) -> None:
    for lid in "abc":
        sync.join(JoinRequest(learner_id=lid))
    g = torch.Generator().manual_seed(0)
    init = {k: torch.randn(v, generator=g) for k, v in SHAPES.items()}
    sync.init(codec.encode(init, {LAYOUT_KEY: LAYOUT.model_dump_json()}))


def update(lid: str, step: int, base: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> bytes:
    g = torch.Generator().manual_seed(seed)
    delta = {k: (0.01 * torch.randn(v, generator=g)).to(dtype) for k, v in SHAPES.items()}
    meta = UpdateMeta(
        learner_id=lid,
        fragment=0,
        base_version=base,
        steps=10 + seed % 7,
        tokens=100 + 13 * seed,
        learner_step=step,
        incarnation=1,
        encoding="bfloat16" if dtype == torch.bfloat16 else "float32",
    )
    return codec.encode(delta, meta.to_metadata())


def stop_writer(sync: Synchronizer) -> None:
    assert sync.snapshots is not None
    sync.snapshots.abandon()


def rounds(sync: Synchronizer) -> list[dict[str, Any]]:
    """Three merges: two learners, one update absorbed into another, a stale one, and an
    update left waiting after the last merge. Returns what was served after each."""
    out = []
    v = sync.versions()[0]
    assert sync.submit(update("a", 10, v, 1)).status == "accepted"
    assert sync.submit(update("b", 10, v, 2, torch.float32)).status == "accepted"
    assert sync.merge(0) == v + 1
    out.append(snapshot(sync))
    assert sync.submit(update("a", 20, v + 1, 3)).status == "accepted"
    assert sync.submit(update("a", 21, v + 1, 4)).status == "accepted"  # absorbed
    assert sync.submit(update("c", 10, v, 5)).status == "accepted"  # one version stale
    assert sync.merge(0) == v + 2
    out.append(snapshot(sync))
    assert sync.submit(update("c", 20, v + 2, 6)).status == "accepted"
    assert sync.submit(update("b", 20, v + 2, 7)).status == "accepted"
    assert sync.merge(0) == v + 3
    out.append(snapshot(sync))
    assert sync.submit(update("a", 30, v + 3, 8)).status == "accepted"  # waits
    return out


def snapshot(sync: Synchronizer) -> dict[str, Any]:
    fs = sync.fragments[0].state
    return {
        "served": sync.fragment(0),
        "params": {k: t.clone() for k, t in fs.params.items()},
        "momentum": {k: t.clone() for k, t in fs.momentum.items()},
        "tokens": fs.tokens_merged,
    }


def same_bits(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> bool:
    return x.keys() == y.keys() and all(
        torch.equal(x[k].view(torch.int32), y[k].view(torch.int32)) for k in x
    )


def test_journaled_merges_are_served_before_their_file_and_replay_to_the_same_bits(
    tmp_path: Path,
) -> None:
    clock = Clock()
    sync = make(tmp_path, clock)
    start(sync)
    stop_writer(sync)
    served = rounds(sync)
    assert sync.versions() == [3]
    assert sync.store.load_fragment(0).version == 0  # the file is behind: not yet written
    assert [r.version for r in sync.fragments[0].journal.records()] == [0, 1, 2]
    # each took its round's sum; the second's replaced a's term (a twice): its replay sums
    # the log's records in their order through a round's sum, as admission did
    assert [r.stream for r in sync.fragments[0].journal.records()] == [True, True, True]
    # the crash: the object is dropped; the restart redoes the three merges from the log
    again = make(tmp_path, clock)
    assert again.versions() == [3]
    assert again.fragment(0) == served[-1]["served"]  # the bytes served before the crash
    fs = again.fragments[0].state
    assert same_bits(fs.params, served[-1]["params"])
    assert same_bits(fs.momentum, served[-1]["momentum"])
    assert fs.tokens_merged == served[-1]["tokens"] and fs.merges == 3
    assert again.store.load_fragment(0).version == 3  # written at startup
    assert again.fragments[0].journal.records() == []
    st = again.status().fragments[0]
    assert (st.contributors_pending, st.tokens_pending) == (1, 100 + 13 * 8)  # a's last
    for lid, step, seed in (("a", 21, 4), ("c", 10, 5), ("a", 30, 8)):  # all still held
        assert again.submit(update(lid, step, 0, seed)).status == "duplicate"


def test_the_file_trails_its_served_version_by_at_most_snapshot_lag(tmp_path: Path) -> None:
    sync = make(tmp_path, Clock(), snapshot_lag=2)
    start(sync)
    stop_writer(sync)
    rounds(sync)
    # merges 1 and 2 journaled; the third would leave the file 3 behind: written first
    assert sync.store.load_fragment(0).version == 3
    assert sync.fragments[0].journal.records() == []
    remaining = sync.store.pending(0).read()
    assert len(remaining) == 1  # the merged segments are gone; a's waiting update is kept


def one_merge(sync: Synchronizer, n: int) -> None:
    v = sync.versions()[0]
    assert sync.submit(update("a", 100 + n, v, n)).status == "accepted"
    assert sync.merge(0) == v + 1


@pytest.mark.parametrize("every", [1, 3])
def test_the_writer_writes_a_file_every_snapshot_every_merges(tmp_path: Path, every: int) -> None:
    sync = make(tmp_path, Clock(), snapshot_lag=4, snapshot_every=every)
    start(sync)
    assert sync.snapshots is not None
    files = []
    for n in range(1, 7):
        one_merge(sync, n)
        sync.snapshots.flush()  # what the writer was asked for, written
        files.append(sync.store.load_fragment(0).version)
    assert files == [n // every * every for n in range(1, 7)]  # 1..6, or 0 0 3 3 3 6
    assert sync.versions() == [6]
    assert len(sync.fragments[0].journal.records()) == 6 - files[-1]  # kept until a file holds them


def test_the_writer_counts_merges_from_the_file_it_is_writing(tmp_path: Path) -> None:
    sync = make(tmp_path, Clock(), snapshot_lag=4, snapshot_every=2)
    start(sync)
    assert sync.snapshots is not None
    real = sync.store.save_fragment
    writing, go = threading.Event(), threading.Event()
    written: list[int] = []

    def slow(p: int, fs: Any, *args: Any, **kw: Any) -> None:
        writing.set()
        go.wait(5)
        written.append(fs.version)
        real(p, fs, *args, **kw)

    sync.store.save_fragment = slow  # type: ignore[method-assign]
    one_merge(sync, 1)
    one_merge(sync, 2)  # the file trails by 2: asked for
    assert writing.wait(5)  # version 2 is being written
    one_merge(sync, 3)  # one past the file being written: not yet
    go.set()
    sync.snapshots.flush()
    one_merge(sync, 4)  # two past it
    sync.snapshots.flush()
    assert written == [2, 4]


def test_flush_writes_a_file_the_writer_was_not_yet_asked_for(tmp_path: Path) -> None:
    sync = make(tmp_path, Clock(), snapshot_lag=4, snapshot_every=3)
    start(sync)
    one_merge(sync, 1)
    sync.flush()
    assert sync.store.load_fragment(0).version == 1
    assert sync.fragments[0].journal.records() == []


def test_snapshot_every_defaults_to_half_the_lag_and_never_exceeds_it() -> None:
    def period(**kw: object) -> int:
        return SyncSettings(token="t", **kw).tuning.snapshot_period()  # type: ignore[arg-type]

    assert [period(snapshot_lag=lag) for lag in (0, 1, 2, 4, 9)] == [1, 1, 1, 2, 4]
    assert period(snapshot_lag=4, snapshot_every=4) == 4
    assert period(snapshot_lag=0, snapshot_every=5) == 5  # every merge writes its own file
    with pytest.raises(ValueError, match="DDILOCO_SNAPSHOT_EVERY=5 exceeds DDILOCO_SNAPSHOT_LAG=4"):
        period(snapshot_lag=4, snapshot_every=5)


def test_the_synchronizer_command_passes_snapshot_every_to_its_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddiloco.synchronizer import server

    monkeypatch.setenv("DDILOCO_TOKEN", "t")
    argv = ["--snapshot-every", "9", "--snapshot-lag", "4", "--state-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as e:  # ignored, the flag would start a server instead
        server.main(argv)
    assert e.value.code == 2
    assert "DDILOCO_SNAPSHOT_EVERY=9 exceeds DDILOCO_SNAPSHOT_LAG=4" in capsys.readouterr().err


def test_the_writer_lets_go_of_journal_and_segments_once_the_file_is_written(
    tmp_path: Path,
) -> None:
    sync = make(tmp_path, Clock())
    start(sync)
    rounds(sync)
    sync.flush()
    assert sync.store.load_fragment(0).version == 3
    assert sync.fragments[0].journal.records() == []
    assert len(sync.store.pending(0).read()) == 1


def test_a_replay_that_differs_in_its_bits_takes_one_version_more(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    sync = make(tmp_path, clock)
    start(sync)
    stop_writer(sync)
    served = rounds(sync)
    journal = MergeJournal(tmp_path, 0)
    records = journal.records()
    journal.close()
    (tmp_path / "merges-0000.log").unlink()
    forged = MergeJournal(tmp_path, 0)  # as if another machine's vector unit had merged
    for rec in records:
        forged.append(dataclasses.replace(rec, digest="0" * 16) if rec.version == 1 else rec)
    forged.close()
    with caplog.at_level(logging.ERROR):
        again = make(tmp_path, clock)
    assert "differ in their bits" in caplog.text
    assert again.versions() == [4]  # never the bytes served as 3 under the number 3
    fs = again.fragments[0].state
    assert fs.tokens_merged == served[-1]["tokens"]  # every contribution merged once
    assert same_bits(fs.params, served[-1]["params"])  # the same bits after all, here


def test_a_journaled_merge_is_served_only_once_the_records_it_names_are_durable(
    tmp_path: Path,
) -> None:
    """An update joins its round under the fragment's lock and its uploader fsyncs after:
    a merge may take it in between. Replay rebuilds a journaled merge from the log's
    records, so the merge is not served before theirs are durable (a power loss would leave
    a served version that no restart can rebuild)."""
    sync = make(tmp_path, Clock())
    start(sync)
    stop_writer(sync)
    paused: list[object] = []
    # both uploaders stopped just before their fsync (their threads not scheduled yet)
    sync.fragments[0].make_durable = lambda ticket: paused.append(ticket)  # type: ignore[method-assign]
    assert sync.submit(update("a", 10, 0, 1)).status == "accepted"
    assert sync.submit(update("b", 10, 0, 2)).status == "accepted"
    segments = sync.store.pending(0)._segments()
    assert len(paused) == 2 and segments and all(s.synced < s.written for s in segments)
    real_install = sync.payloads.retire
    at_install: list[bool] = []

    def retire(*args: Any) -> None:  # the merge's install: the old payload goes
        at_install.append(all(s.synced == s.written for s in segments))
        real_install(*args)

    sync.payloads.retire = retire  # type: ignore[method-assign]
    assert sync.merge(0) == 1
    assert at_install == [True]  # synced before the version was served
    assert [(r.version, r.inputs) for r in MergeJournal(tmp_path, 0).records()] == [(0, 2)]


def test_a_merge_writes_its_record_while_its_inputs_are_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The segments' fsync (the disk) runs beside the record's digest (the cores) and the
    record's own fdatasync (the same disk flush): the record is written once digested, not
    after the inputs; the version is served after both."""
    sync = make(tmp_path, Clock())
    start(sync)
    stop_writer(sync)
    sync.fragments[0].make_durable = lambda ticket: None  # type: ignore[method-assign]
    assert sync.submit(update("a", 10, 0, 1)).status == "accepted"  # its fsync not done
    events: list[str] = []
    real_digest, real_inputs = fragment.digest, sync.fragments[0]._inputs_durable
    real_append = sync.fragments[0].journal.append

    recorded = threading.Event()

    def digest(fs: Any) -> str:
        events.append("digested")
        return real_digest(fs)

    def inputs(segments: Any) -> float:
        recorded.wait(10)  # a disk whose flush outlasts the digest and the record's write
        done = real_inputs(segments)
        events.append(f"inputs durable, serving {sync.versions()}")
        return done

    def append(rec: Any) -> None:
        real_append(rec)
        events.append("record durable")
        recorded.set()

    monkeypatch.setattr(fragment, "digest", digest)
    sync.fragments[0]._inputs_durable = inputs  # type: ignore[method-assign]
    sync.fragments[0].journal.append = append  # type: ignore[method-assign]
    assert sync.merge(0) == 1
    assert events == ["digested", "record durable", "inputs durable, serving [0]"]
    assert all(s.synced == s.written for s in sync.store.pending(0)._segments())


def cut_last_record(state: Path) -> None:
    """What a power loss does to a log record written and not yet fsynced: gone."""
    seg = sorted(state.glob("pending-0000.*.log"))[-1]
    records, end = records_in(seg.read_bytes())
    assert records and end == seg.stat().st_size
    with open(seg, "rb+") as f:
        f.truncate(end - ALIGN - aligned(len(records[-1])))


@pytest.mark.parametrize("lost", [True, False], ids=["an-input-lost", "inputs-kept"])
def test_a_crash_between_a_merges_record_and_its_inputs_fsync_merges_each_update_once(
    tmp_path: Path, lost: bool
) -> None:
    """The record is durable, the merge's inputs' fsync never returned (the merge not
    served). If the disk lost one of them (not acknowledged to its learner: its uploader's
    fsync did not return either), the restart drops the record, the other update waits in
    the round and the lost one is taken again when its learner sends it again; if the disk
    kept them, the restart redoes the merge. Either way each update is merged once."""
    clock = Clock()
    sync = make(tmp_path, clock)
    start(sync)
    stop_writer(sync)
    sync.fragments[0].make_durable = lambda ticket: None  # type: ignore[method-assign]
    assert sync.submit(update("a", 10, 0, 1)).status == "accepted"
    assert sync.submit(update("b", 10, 0, 2)).status == "accepted"

    def power_loss(segments: Any) -> float:
        raise OSError("the machine stopped before the inputs' fsync returned")

    sync.fragments[0]._inputs_durable = power_loss  # type: ignore[method-assign]
    with pytest.raises(OSError):
        sync.merge(0)
    assert sync.versions() == [0]  # never served
    assert [(r.version, r.inputs) for r in MergeJournal(tmp_path, 0).records()] == [(0, 2)]
    if lost:
        cut_last_record(tmp_path)  # b's
    assert from_state_dir(tmp_path).versions == [0 if lost else 1]  # `ddiloco export`, too
    again = make(tmp_path, clock)
    if lost:
        assert again.versions() == [0] and MergeJournal(tmp_path, 0).records() == []
        assert again.status().fragments[0].tokens_pending == 113  # a's
        assert again.submit(update("c", 10, 0, 3)).status == "accepted"
        assert again.merge(0) == 1  # a and c: a record from version 0 again
        assert again.submit(update("b", 10, 0, 2)).status == "accepted"  # b's retry
        assert again.merge(0) == 2
    else:
        assert again.versions() == [1] and again.fragments[0].state.tokens_merged == 113 + 126
        assert again.submit(update("b", 10, 0, 2)).status == "duplicate"
        assert again.submit(update("c", 10, 1, 3)).status == "accepted"
        assert again.merge(0) == 2
    assert again.fragments[0].state.tokens_merged == 113 + 126 + 139
    assert again.status().fragments[0].tokens_pending == 0
    third = make(tmp_path, clock)  # the dropped record is gone: it would be redone first
    assert third.versions() == [2] and third.fragments[0].state.tokens_merged == 113 + 126 + 139
    assert third.fragment(0) == again.fragment(0)


def test_replay_drops_only_the_last_record_short_of_its_inputs(tmp_path: Path) -> None:
    """A record short of its inputs (`inputs`, the updates it took) is dropped if it is the
    fragment's last (its merge never served); before another, the state is damaged."""
    clock = Clock()
    sync = make(tmp_path, clock)
    start(sync)
    stop_writer(sync)
    base = sync.store.load_fragment(0)
    rounds(sync)
    journal = MergeJournal(tmp_path, 0).records()
    payloads = FragmentLog(tmp_path, 0).read()
    spec = LAYOUT.fragments[0]
    assert [r.inputs for r in journal] == [2, 3, 2]
    full = replay(store_copy(base), spec, payloads, journal)
    assert full.merges == 3 and full.exact and full.dropped is None
    assert [u[0].learner_id for u in full.rest] == ["a"]
    more = dataclasses.replace(journal[-1], inputs=3)  # as if one of its inputs were lost
    short = replay(store_copy(base), spec, payloads, [*journal[:-1], more])
    assert short.merges == 2 and short.dropped == more and short.state.version == 2
    assert [u[0].learner_id for u in short.rest] == ["c", "b", "a"]  # the log's order
    with pytest.raises(ValueError, match="has 3 of its 4 updates"):
        replay(store_copy(base), spec, payloads, [journal[0], dataclasses.replace(
            journal[1], inputs=4), journal[2]])  # fmt: skip


def store_copy(fs: Any) -> Any:
    """A fragment state whose tensors a replay may write (the base is reused)."""
    return dataclasses.replace(
        fs,
        params={k: t.clone() for k, t in fs.params.items()},
        momentum={k: t.clone() for k, t in fs.momentum.items()},
        high_water=dict(fs.high_water),
    )


def test_a_merge_encodes_what_it_will_serve_while_its_record_is_fsynced(tmp_path: Path) -> None:
    sync = make(tmp_path, Clock())
    start(sync)
    stop_writer(sync)
    assert sync.submit(update("a", 10, 0, 1)).status == "accepted"
    events: list[str] = []
    journal, payloads = sync.fragments[0].journal, sync.payloads
    real_append, real_encode = journal.append, payloads.encode

    def slow_append(rec: Any) -> None:  # a disk whose flush takes 0.3 s
        time.sleep(0.3)
        real_append(rec)
        events.append("durable")

    def encode(*args: Any, **kw: Any) -> memoryview:
        events.append(f"encode, serving {sync.versions()}")
        return real_encode(*args, **kw)

    journal.append = slow_append  # type: ignore[method-assign]
    payloads.encode = encode  # type: ignore[method-assign]
    assert sync.merge(0) == 1
    assert events == ["encode, serving [0]", "durable"]  # beside the fsync, served after it
    assert sync.versions() == [1]


@pytest.mark.parametrize("lag", [0, 4], ids=["file-before-serving", "journal"])
def test_a_merge_whose_encode_fails_waits_for_its_durable_part_and_its_work_is_merged_once(
    tmp_path: Path, lag: int
) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, snapshot_lag=lag)
    start(sync)
    stop_writer(sync)
    assert sync.submit(update("a", 10, 0, 1)).status == "accepted"
    real_encode = sync.payloads.encode

    def out_of_memory(*args: Any, **kw: Any) -> memoryview:
        raise MemoryError("as if the payload's buffer could not be made")

    sync.payloads.encode = out_of_memory  # type: ignore[method-assign]
    with pytest.raises(MemoryError):
        sync.merge(0)
    sync.payloads.encode = real_encode  # type: ignore[method-assign]
    assert sync.versions() == [0] and sync.status().fragments[0].tokens_pending == 113
    assert sync.snapshots is not None
    assert sync.snapshots.locks[0].acquire(timeout=1)  # the file's lock was let go of
    sync.snapshots.locks[0].release()
    assert sync.submit(update("b", 10, 0, 2)).status == "accepted"
    assert sync.merge(0) == 1
    assert sync.fragments[0].state.tokens_merged == 113 + 126  # each update once
    again = make(tmp_path, clock, snapshot_lag=lag)  # and after a restart
    assert again.versions() == [1] and again.fragments[0].state.tokens_merged == 113 + 126


def test_after_a_put_back_round_the_next_merge_writes_its_file_first(tmp_path: Path) -> None:
    sync = make(tmp_path, Clock())
    start(sync)
    stop_writer(sync)
    assert sync.submit(update("a", 10, 0, 1)).status == "accepted"
    real = sync.fragments[0].shared.policy

    class Refusing:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def merge(self, *args: Any, **kw: Any) -> Any:
            assert sync.submit(update("a", 11, 0, 2)).status == "accepted"
            raise NonFiniteMerge("as if the sum overflowed")

    sync.fragments[0].shared.policy = Refusing()  # type: ignore[assignment]
    assert sync.merge(0) is None
    sync.fragments[0].shared.policy = real
    assert sync.merge(0) == 1  # a's two updates summed in another order than the log's
    assert sync.store.load_fragment(0).version == 1  # so this one is in its file already
    assert sync.fragments[0].journal.records() == []
    assert sync.submit(update("b", 10, 1, 3)).status == "accepted"
    assert sync.merge(0) == 2
    assert sync.fragments[0].journal.records() != []  # and the next is journaled again


def test_export_and_a_clean_close_see_the_journaled_merges(tmp_path: Path) -> None:
    sync = make(tmp_path, Clock())
    start(sync)
    stop_writer(sync)
    served = rounds(sync)
    model = from_state_dir(tmp_path)  # beside the running synchronizer, reading only
    assert model.versions == [3]
    assert same_bits(model.params, served[-1]["params"])
    assert sync.store.load_fragment(0).version == 0  # export wrote nothing
    sync.close()
    assert sync.store.load_fragment(0).version == 3
    assert MergeJournal(tmp_path, 0).records() == []


def test_a_compaction_that_keeps_records_leaves_a_journal_that_reads_back_whole(
    tmp_path: Path,
) -> None:
    """The writer may write a file behind the journal (the merges after it keep coming):
    compacting then rewrites the records it keeps, in the log's own record format, and
    appends after it stay readable (a compaction that wrote another layout lost every
    record after the first kept: a restart then lacked the last merges)."""
    sync = make(tmp_path, Clock())
    start(sync)
    stop_writer(sync)
    rounds(sync)
    journal = MergeJournal(tmp_path, 0)
    records = journal.records()
    assert [r.version for r in records] == [0, 1, 2]
    journal.compact(1)  # a file at version 1 holds the first merge
    assert journal.records() == records[1:]
    journal.append(dataclasses.replace(records[-1], version=3))
    journal.close()
    again = MergeJournal(tmp_path, 0)
    assert [r.version for r in again.records()] == [1, 2, 3]
    again.close()


def test_the_writer_takes_the_file_that_trails_most_first() -> None:
    """Fragments asked for while the writer is busy are written most-trailing first (the
    first asked among equals): always the lowest-numbered first starved the others, whose
    merges then wrote their files themselves."""
    release = threading.Event()
    order: list[int] = []
    lags = {0: 1, 1: 3, 2: 2, 3: 3}

    def write(p: int) -> None:
        order.append(p)
        if p == 9:
            release.wait(5)  # the writer is busy while the others are asked for

    snaps = Snapshots(write, 10, lambda p: lags.get(p, 0))
    snaps.request(9)
    while not order:
        time.sleep(0.01)
    for p in (0, 3, 2, 1):
        snaps.request(p)
    release.set()
    snaps.flush(5)
    snaps.close()
    assert order == [9, 3, 1, 2, 0]


@pytest.mark.parametrize("between", ["file and journal", "journal and segments"])
def test_export_beside_the_writer_reads_again_when_the_file_moves_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, between: str
) -> None:
    """The snapshot writer replaces the file and lets go of the journal's records and the
    log's segments it covers; an export that read the file (or the journal) just before
    reads again from the new file, and gives the latest merged state, not an error or an
    older one."""
    sync = make(tmp_path, Clock())
    start(sync)
    stop_writer(sync)
    served = rounds(sync)
    assert (
        sync.store.load_fragment(0).version == 0 and len(sync.fragments[0].journal.records()) == 3
    )
    assert sync.snapshots is not None
    written = []

    def writer_runs() -> None:
        if not written:
            written.append(sync.snapshots.write(0))  # type: ignore[union-attr]

    if between == "file and journal":
        real_records = MergeJournal.records

        def records(self: MergeJournal, **kw: Any) -> Any:
            writer_runs()
            return real_records(self, **kw)

        monkeypatch.setattr(MergeJournal, "records", records)
    else:
        real_read = FragmentLog.read

        def read(self: FragmentLog, **kw: Any) -> Any:
            writer_runs()
            return real_read(self, **kw)

        monkeypatch.setattr(FragmentLog, "read", read)
    model = from_state_dir(tmp_path)  # beside the running synchronizer, reading only
    assert written  # the writer did run between the reads
    assert sync.store.load_fragment(0).version == 3
    assert sync.fragments[0].journal.records() == []  # and let go of what the file holds
    assert model.versions == [3]
    assert same_bits(model.params, served[-1]["params"])
    sync.close()


def test_each_merge_logs_its_parts_and_where_its_compute_waited(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The merge's log line (bench/sync_ingest.py prints the slowest): its parts in ms and,
    of its compute, the time on a core and the time runnable without one (Linux's
    schedstat), which together are at most the compute."""
    sync = make(tmp_path, Clock())
    start(sync)
    with caplog.at_level(logging.INFO, logger="ddiloco.synchronizer.service"):
        assert sync.submit(update("a", 10, 0, 1)).status == "accepted"
        assert sync.merge(0) == 1
    line = next(r.getMessage() for r in caplog.records if "Merged fragment=0" in r.getMessage())
    parts = dict(kv.rsplit(" ", 1) for kv in line.rsplit("(", 1)[1].rstrip(")").split(", "))
    assert {"compute", "durable", "encode", "install", "finish"} <= set(parts)
    if Path("/proc/thread-self/schedstat").exists():
        ms = {k: int(v) for k, v in parts.items()}
        assert ms["ran"] + ms["queued"] <= ms["compute"] + 2  # each rounded to 1 ms
        assert ms["ran"] >= 0 and ms["queued"] >= 0
    assert " sum=streamed " in line  # the round's sum, formed as its update came
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ddiloco.synchronizer.service"):
        for step in (20, 30):  # the same learner twice in one round: its term replaced
            assert sync.submit(update("a", step, 1, step)).status == "accepted"
        assert sync.merge(0) == 2
    assert any(" sum=streamed " in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ddiloco.synchronizer.service"):
        assert sync.submit(update("b", 40, 2, 40)).status == "accepted"
        sync.fragments[0].sum.spoil()  # as a refused merge's put back does: summed by the merge
        assert sync.merge(0) == 3
    assert any(" sum=resummed " in r.getMessage() for r in caplog.records)
