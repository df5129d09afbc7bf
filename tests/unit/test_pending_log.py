"""The pending log's group commit and record format, on real files; and the synchronizer's
answer when the log's fsync fails.

    pytest tests/unit/test_pending_log.py

- a record `write` returned is durable once `sync` returns; one fsync covers every record
  written before it started (group commit), and a record written before its segment's
  `remove` (the merge that consumed it is durable) needs none; a durable record's `sync`
  does not wait for the segment's lock (a deletion outside it, or another fsync);
- a segment starts with its format version: another version is refused in one line, a
  header never made durable reads as an empty segment; a record whose 64-bit checksum
  fails (in its high half too) ends the log;
- many threads submitting to one fragment are all accepted, and a restart replays every one;
- a fragment's log is a series of segments: a merge seals the ones holding its round, posts
  meanwhile go to a new one, a restart replays them all in order, and a merge deletes only
  the segments it sealed;
- a failed fsync stops the process (`on_fatal`) instead of answering `accepted`;
- order under the fragment's lock, bytes outside it: records are in the order their places
  were reserved, whatever order they are filled in; a record's `sync` waits until every
  record before it is filled; a place reserved and never filled (a crash) ends the log there,
  on reading; a failed fill fails every later `sync` and stops the process, a full disk
  refuses the update at its reservation (nothing held, the next accepted); an update's
  write does not hold its fragment's lock (another update of the fragment is admitted and
  written meanwhile);
- direct I/O: a body in a `BODIES` buffer is written from it with O_DIRECT, other payloads
  through the page cache, in one block format, read back in order; where O_DIRECT is
  refused (at open or at the first write) the same records go through the page cache; a
  fragment file streamed in direct blocks reads back exactly, at its true length.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddiloco.synchronizer.buffers import ALIGN, BODIES
from ddiloco.synchronizer.storage import direct_io, state
from ddiloco.synchronizer.storage.pending import PendingLog
from ddiloco.synchronizer.storage.records import FORMAT, StateFormatError
from ddiloco.synchronizer.storage.segments import FragmentLog
from ddiloco.wire import codec
from tests.unit.test_contract import Clock, make, start, update


def stoppable(state: Path, quorum: int) -> tuple[Any, Clock, list[bool]]:
    """A started synchronizer whose `on_fatal` records the stop instead of exiting, its
    clock, and the stops so far."""
    clock = Clock()
    sync = make(state, clock, quorum=quorum)
    start(sync)
    stopped: list[bool] = []
    sync.on_fatal = lambda: stopped.append(True)
    return sync, clock, stopped


def counting_fsync(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the real fsyncs state.py makes (they still happen)."""
    calls: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(state.os, "fsync", fsync)
    return calls


def test_one_fsync_makes_every_record_written_before_it_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = PendingLog(tmp_path / "p.log")
    tickets = [log.write(b"r%d" % i) for i in range(3)]
    calls = counting_fsync(monkeypatch)
    log.sync(tickets[0])  # syncs all three: they were written before it started
    log.sync(tickets[2])
    log.sync(tickets[1])
    assert len(calls) == 1
    later = log.write(b"r3")
    log.sync(later)
    assert len(calls) == 2
    assert PendingLog(tmp_path / "p.log").read() == [b"r0", b"r1", b"r2", b"r3"]


def test_a_record_written_before_its_segments_removal_needs_no_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = PendingLog(tmp_path / "p.log")
    ticket = log.write(b"merged")
    log.remove()  # the merge that consumed it is durable in the fragment file
    calls = counting_fsync(monkeypatch)
    log.sync(ticket)
    assert calls == [] and not log.path.exists()


def test_a_durable_record_does_not_wait_for_the_segments_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merge syncs every segment its round may hold; one already durable answers at
    once, whoever holds its lock (the writer deleting it took 135-322 ms a segment at
    1 GB/s, and the merge waited for each); one not yet durable still waits for its fsync.
    The deletion itself is outside the lock."""
    log = PendingLog(tmp_path / "p.log")
    done = log.write(b"r0")
    log.sync(done)
    pending = log.write(b"r1")
    returned: list[str] = []
    with log.sync_lock:  # held as by a deletion or another thread's fsync
        for name, ticket in (("durable", done), ("pending", pending)):
            t = threading.Thread(target=lambda n=name, k=ticket: (log.sync(k), returned.append(n)))
            t.start()
            t.join(0.5)
        assert returned == ["durable"]
    t.join(5)
    assert returned == ["durable", "pending"]
    unlinked: list[bool] = []
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        unlinked.append(log.sync_lock.locked())
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    log.remove()
    assert unlinked == [False] and not log.path.exists()
    log.sync(pending)  # merged and durable elsewhere: at once


def test_a_segment_of_another_version_is_refused_and_a_bad_checksum_ends_the_log(
    tmp_path: Path,
) -> None:
    path = tmp_path / "p.log"
    log = PendingLog(path)
    for body in (b"r-1", b"r-2", b"r-3"):
        log.append(body)
    log.close()
    raw = bytearray(path.read_bytes())
    assert raw[:12] == struct.pack("<8sI", b"ddpend\0\0", FORMAT)
    third = 1 * ALIGN + 2 * 2 * ALIGN  # the file header, then two records of two blocks
    assert struct.unpack_from("<QQ", raw, third)[0] == 3
    raw[third + 8 + 7] ^= 0x80  # the checksum's top bit: a 32-bit checksum would miss it
    path.write_bytes(bytes(raw))
    assert PendingLog(path).read() == [b"r-1", b"r-2"]
    assert path.stat().st_size == third  # the bad record was cut off
    raw[8:12] = struct.pack("<I", FORMAT + 1)
    path.write_bytes(bytes(raw))
    with pytest.raises(StateFormatError, match=f"state format {FORMAT + 1};") as e:
        PendingLog(path).read()
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    raw[: 2 * ALIGN] = bytes(2 * ALIGN)  # created, its header never synced: nothing acked
    path.write_bytes(bytes(raw))
    assert PendingLog(path).read() == []
    assert path.stat().st_size == 0


def test_a_segment_whose_header_write_failed_takes_its_header_at_the_next_reservation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "p.log"
    log = PendingLog(path)
    real = os.pwrite

    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state.os, "pwrite", full)
    with pytest.raises(OSError, match="No space"):
        log.reserve(10)  # refused before anything is held
    monkeypatch.setattr(state.os, "pwrite", real)
    log.sync(log.write(b"r" * 10))
    assert PendingLog(path).read() == [b"r" * 10]


def test_concurrent_updates_of_one_fragment_are_all_accepted_and_replayed(
    tmp_path: Path,
) -> None:
    clock = Clock()
    learners = "abcdefgh"
    sync = make(tmp_path, clock, quorum=len(learners) + 1)  # no merge: all stay pending
    start(sync, learners)
    answers: list[str] = []

    def post(lid: str) -> None:
        for step in range(1, 4):
            answers.append(
                sync.submit(update(lid, 1, torch.tensor([0.01, 0.02]), step=step)).status
            )

    threads = [threading.Thread(target=post, args=(lid,)) for lid in learners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == ["accepted"] * 3 * len(learners)
    assert sync.status().fragments[1].tokens_pending == 300 * len(learners)
    assert len(sync.store.pending(1).read()) == 3 * len(learners)
    again = make(tmp_path, clock, quorum=len(learners) + 1)  # a SIGKILL's restart
    assert again.status().fragments[1].tokens_pending == 300 * len(learners)
    assert again.status().fragments[1].contributors_pending == len(learners)


def test_a_failed_fsync_stops_the_process_instead_of_answering_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync, _, stopped = stoppable(tmp_path, quorum=2)
    assert sync.submit(update("a", 1, torch.tensor([0.1, 0.0]), step=1)).status == "accepted"

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(state.os, "fsync", failing)
    with pytest.raises(OSError):  # the route answers 500: the client re-sends after a restart
        sync.submit(update("b", 1, torch.tensor([0.0, 0.1]), step=1))
    assert stopped == [True]
    assert sync.metrics.updates_accepted._value.get() == 1  # "b" was never counted accepted


def test_fragment_log_segments_replay_in_order_and_a_merge_drops_only_what_it_sealed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = FragmentLog(tmp_path, 2)
    log.append(b"r0")
    log.seal()  # a merge that failed: its segment stays sealed for the next
    log.append(b"r1")
    taken = log.seal()  # a merge takes the round: "r0" and "r1"
    ticket = log.write(b"r2")  # a post admitted while it persists: a new segment
    assert [s.path.name for s in taken] == ["pending-0002.000001.log", "pending-0002.000002.log"]
    assert log.path.name == "pending-0002.000003.log"
    log.sync(ticket)
    assert FragmentLog(tmp_path, 2).read() == [b"r0", b"r1", b"r2"]  # a restart here
    log.drop(taken)  # the merge is durable
    assert sorted(f.name for f in tmp_path.iterdir()) == ["pending-0002.000003.log"]
    calls = counting_fsync(monkeypatch)
    stale = log.write(b"r3")
    taken = log.seal()
    log.drop(taken)
    log.sync(stale)  # its segment was merged and deleted: nothing to fsync
    assert calls == []
    again = FragmentLog(tmp_path, 2)
    assert again.read() == []
    again.append(b"r4")  # every segment merged and deleted: numbering starts again
    assert again.path.name == "pending-0002.000001.log"
    assert FragmentLog(tmp_path, 2).read() == [b"r4"]


def test_concurrent_first_posts_of_a_fragment_share_one_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `FragmentLog`s of one fragment number their segments each on its own: one's
    records are then missing from the other's seal and read (a CI run read 23 of 24)."""
    from ddiloco.synchronizer.storage import state

    real = state.FragmentLog.__init__

    def slow(self: state.FragmentLog, root: Path, p: int) -> None:
        time.sleep(0.05)  # widen the window between the check and the insert
        real(self, root, p)

    monkeypatch.setattr(state.FragmentLog, "__init__", slow)
    store = state.StateStore(tmp_path)
    got: list[state.FragmentLog] = []
    threads = [threading.Thread(target=lambda: got.append(store.pending(1))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(x) for x in got}) == 1


def direct_fds(log: PendingLog) -> bool:
    """Whether the log holds a descriptor opened with O_DIRECT (its flags in /proc)."""
    if log.direct is None:
        return False
    flags = Path(f"/proc/self/fdinfo/{log.direct}").read_text().split("flags:")[1].split()[0]
    return bool(int(flags, 8) & os.O_DIRECT)


def test_pool_bodies_go_to_the_log_with_o_direct_and_read_back_among_packed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body the upload port read into a `BODIES` buffer is written from that buffer with
    O_DIRECT (no page cache copy); any other payload through the page cache, in the same
    block format, in the same file; all read back in order, and a corrupt one ends the log."""
    wrote: list[int] = []
    real_pwrite = os.pwrite

    def pwrite(fd: int, data: object, offset: int) -> int:
        wrote.append(fd)
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(state.os, "pwrite", pwrite)
    path = tmp_path / "p.log"
    log = PendingLog(path)
    sizes = [5000, 1, 4096, 3 << 20, 123_457]
    want = []
    for i, size in enumerate(sizes):
        data = os.urandom(size)
        want.append(data)
        if i % 2 == 0:
            body = BODIES.take(size)
            body[:] = data
            log.sync(log.write(body, PendingLog.record(body)))
            assert BODIES.frame(body) is not None
            BODIES.give(body)
        else:
            log.append(data)  # bytes: the page cache
    assert direct_fds(log)
    assert wrote.count(log.direct) == 3  # the three pool bodies, one write each
    assert path.stat().st_size % ALIGN == 0
    assert PendingLog(path).read() == want
    raw = bytearray(path.read_bytes())
    at = raw.index(want[2])
    raw[at + 100] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert PendingLog(path).read() == want[:2]
    assert path.stat().st_size % ALIGN == 0  # cut at a record's start: appends stay aligned


@pytest.mark.parametrize("when", ["open", "write"])
def test_a_file_system_that_refuses_o_direct_gets_the_same_records_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    real_open, real_write, real_pwrite = os.open, os.write, os.pwrite
    direct: set[int] = set()

    def refuse_open(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT and when == "open":
            raise OSError(22, "Invalid argument")
        fd = real_open(path, flags, *args)  # type: ignore[arg-type]
        (direct.add if flags & os.O_DIRECT else direct.discard)(fd)  # numbers are reused
        return fd

    def refuse_write(fd: int, data: object) -> int:
        if fd in direct:
            raise OSError(22, "Invalid argument")
        return real_write(fd, data)  # type: ignore[arg-type]

    def refuse_pwrite(fd: int, data: object, offset: int) -> int:
        if fd in direct:
            raise OSError(22, "Invalid argument")
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(state.os, "open", refuse_open)
    monkeypatch.setattr(state.os, "write", refuse_write)
    monkeypatch.setattr(state.os, "pwrite", refuse_pwrite)
    log = PendingLog(tmp_path / "p.log")
    want = [os.urandom(n) for n in (10, 70_000, 2 << 20)]
    for data in want:
        body = BODIES.take(len(data))
        body[:] = data
        log.sync(log.write(body))
        BODIES.give(body)
    assert log._direct() is None  # refused at open, or at the first write
    assert PendingLog(tmp_path / "p.log").read() == want
    # the fragment file too: written through the page cache, read back the same
    g = torch.Generator().manual_seed(1)
    fs = state.FragmentState({"w": torch.randn(300, 70, generator=g)}, {"w": torch.zeros(300, 70)})
    store = state.StateStore(tmp_path / "s")
    store.save_fragment(0, fs)
    back = store.load_fragment(0)
    assert torch.equal(back.params["w"], fs.params["w"])


def test_a_fragment_file_written_in_direct_blocks_reads_back_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a staging buffer smaller than the file (parts cross its edges), O_DIRECT,
    the last block cut back to the file's true length."""
    monkeypatch.setattr(direct_io, "STAGE", 3 * ALIGN)
    monkeypatch.setattr(direct_io, "_stages", [])
    opened: list[int] = []
    real_open = os.open

    def spy(path: object, flags: int, *args: object) -> int:
        opened.append(flags)
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(state.os, "open", spy)
    g = torch.Generator().manual_seed(2)
    params = {"a": torch.randn(1031, generator=g), "b": torch.randn(7, 3, generator=g)}
    params["c"] = torch.randn(4096, generator=g)
    fs = state.FragmentState(
        params, {k: torch.randn(v.shape, generator=g) for k, v in params.items()}, version=9
    )
    store = state.StateStore(tmp_path)
    store.save_fragment(2, fs)
    assert any(f & os.O_DIRECT for f in opened)
    back = store.load_fragment(2)
    assert back.version == 9
    for k in params:
        assert torch.equal(back.params[k], fs.params[k])
        assert torch.equal(back.momentum[k], fs.momentum[k])
    file = tmp_path / "fragment-0002.safetensors"
    parts = codec.pieces(
        {f"param/{k}": v for k, v in params.items()}
        | {f"momentum/{k}": v for k, v in fs.momentum.items()},
        {},
    )
    assert parts is not None
    header_len = int.from_bytes(file.read_bytes()[:8], "little")
    data = sum(len(memoryview(p).cast("B")) for p in parts[1:])
    assert file.stat().st_size == 8 + header_len + data  # no padding left at the end


def test_records_are_in_reservation_order_and_a_sync_waits_for_every_record_before_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "p.log"
    log = PendingLog(path)
    a, b, c = os.urandom(5000), os.urandom(70_000), os.urandom(10)
    ta, tb, tc = log.reserve(len(a)), log.reserve(len(b)), log.reserve(len(c))
    log.fill(tc, c)
    log.fill(tb, b)  # a, first in the log, not yet written
    synced = threading.Event()
    waiter = threading.Thread(target=lambda: (log.sync(tb), synced.set()))
    waiter.start()
    assert not synced.wait(0.3)  # b's sync waits for a
    assert PendingLog(path).read(repair=False) == []  # a crash now: a's place is zeros
    log.fill(ta, a)
    assert synced.wait(10)
    waiter.join()
    log.sync(tc)
    assert PendingLog(path).read() == [a, b, c]


def test_a_place_never_filled_ends_the_log_with_every_record_after_it(tmp_path: Path) -> None:
    """A crash between a reservation and its fill: the records after it were never
    acknowledged (their sync waits for it); reading cuts the file at the unfilled place,
    and the records appended after the restart follow the ones kept."""
    path = tmp_path / "p.log"
    log = PendingLog(path)
    kept, lost, after = os.urandom(3000), os.urandom(9000), os.urandom(100)
    log.sync(log.write(kept))
    log.reserve(len(os.urandom(50_000)))  # the crash: never filled
    log.fill(log.reserve(len(lost)), lost)
    log.close()
    again = PendingLog(path)
    assert again.read() == [kept]
    assert path.stat().st_size == 2 * ALIGN + 4096  # cut where the unfilled place began
    again.sync(again.write(after))
    assert PendingLog(path).read() == [kept, after]


def test_a_failed_fill_fails_every_later_sync_and_stops_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = PendingLog(tmp_path / "p.log")
    ta, tb = log.reserve(10), log.reserve(10)
    log.fill(tb, b"b" * 10)
    real = os.pwritev

    def failing(fd: int, buffers: object, offset: int) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(state.os, "pwritev", failing)
    with pytest.raises(OSError):
        log.fill(ta, b"a" * 10)
    with pytest.raises(OSError, match="a record before this one"):
        log.sync(tb)
    monkeypatch.setattr(state.os, "pwritev", real)

    sync, _, stopped = stoppable(tmp_path / "s", quorum=3)
    assert sync.submit(update("a", 1, torch.tensor([0.1, 0.0]), step=1)).status == "accepted"
    monkeypatch.setattr(state.os, "pwritev", failing)
    monkeypatch.setattr(state.os, "pwrite", failing)
    with pytest.raises(OSError):  # the route answers 500: the client re-sends after a restart
        sync.submit(update("b", 1, torch.tensor([0.0, 0.1]), step=1))
    assert stopped == [True]
    assert sync.metrics.updates_accepted._value.get() == 1


def test_a_full_disk_refuses_the_update_at_its_reservation_and_keeps_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync, clock, stopped = stoppable(tmp_path, quorum=3)
    assert sync.submit(update("a", 1, torch.tensor([0.1, 0.0]), step=1)).status == "accepted"
    real = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state.os, "posix_fallocate", full)
    with pytest.raises(OSError):
        sync.submit(update("b", 1, torch.tensor([0.0, 0.1]), step=1))
    assert sync.status().fragments[1].contributors_pending == 1  # "b" not held
    monkeypatch.setattr(state.os, "posix_fallocate", real)
    assert sync.submit(update("b", 1, torch.tensor([0.0, 0.1]), step=1)).status == "accepted"
    assert stopped == []
    assert len(sync.store.pending(1).read(repair=False)) == 2
    again = make(tmp_path, clock, quorum=3)  # a restart replays both
    assert again.status().fragments[1].contributors_pending == 2


def test_an_updates_write_does_not_hold_its_fragments_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one update's record is being written (its write held here), another update of
    the same fragment is admitted and written; both are accepted, in the order admitted."""
    clock = Clock()
    sync = make(tmp_path, clock, quorum=3)
    start(sync)
    real = os.pwritev
    first_in, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def held_first(fd: int, buffers: object, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 1:
            first_in.set()
            assert release.wait(10)
        return real(fd, buffers, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(state.os, "pwritev", held_first)
    answers: dict[str, str] = {}

    def post(lid: str, value: float) -> None:
        answers[lid] = sync.submit(update(lid, 1, torch.tensor([value, 0.0]), step=1)).status

    ta = threading.Thread(target=post, args=("a", 0.1))
    ta.start()
    assert first_in.wait(10)
    tb = threading.Thread(target=post, args=("b", 0.2))
    tb.start()
    deadline = time.monotonic() + 10
    while len(calls) < 2 and time.monotonic() < deadline:  # b's write, while a's is held
        time.sleep(0.01)
    assert len(calls) == 2 and calls[1] > calls[0]
    assert "b" not in answers  # accepted only once a's record, before it, is durable too
    release.set()
    ta.join()
    tb.join()
    assert answers == {"a": "accepted", "b": "accepted"}
    records = sync.store.pending(1).read(repair=False)
    assert [codec.read_metadata(r)["learner_id"] for r in records] == ["a", "b"]


def test_an_update_not_held_after_its_reservation_fails_the_next_instead_of_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug between the reservation and the hold leaves a place that is never written:
    the process stops (`on_fatal`) and the next update of the fragment fails at once,
    rather than waiting forever for the place before its own."""
    sync, _, stopped = stoppable(tmp_path, quorum=3)
    real = sync.fragments[1].hold

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(sync.fragments[1], "hold", broken)
    with pytest.raises(RuntimeError):
        sync.submit(update("a", 1, torch.tensor([0.1, 0.0]), step=1))
    assert stopped == [True]
    monkeypatch.setattr(sync.fragments[1], "hold", real)
    t0 = time.monotonic()
    with pytest.raises(OSError, match="reserved and never written"):
        sync.submit(update("b", 1, torch.tensor([0.0, 0.1]), step=1))
    assert time.monotonic() - t0 < 5
    assert stopped == [True, True]
    assert sync.metrics.updates_accepted._value.get() == 0
