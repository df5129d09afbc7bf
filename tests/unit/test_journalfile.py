"""The merge journal's file (synchronizer/storage/journalfile.py): records written in place over
zeros made durable before them, so an append changes no size and no block (a merge's
fdatasync then commits nothing of the file system's), and whatever a crash leaves reads
back as a prefix of the records, never a stale record after a newer one.

    pytest tests/unit/test_journalfile.py

Real files in a temporary directory; a crash is the bytes it would leave, written by hand.
The file's first block is its header (kind and format version, records.py): a record's
offsets below count from there.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ddiloco.synchronizer.storage.journal import MergeJournal, MergeRecord
from ddiloco.synchronizer.storage.journalfile import RESERVE, JournalFile
from ddiloco.synchronizer.storage.records import FORMAT, StateFormatError, encoded

BLOCK = 4096


def payload(i: int, size: int = 300) -> bytes:
    return (f"record {i} ".encode() * size)[:size]


def test_appends_land_in_the_zeros_written_ahead_and_change_no_size_or_block(
    tmp_path: Path,
) -> None:
    f = JournalFile(tmp_path / "j.log")
    f.create()
    before = os.stat(f.path)
    assert before.st_size == BLOCK + RESERVE  # the file header, then the zeros
    assert before.st_blocks * 512 >= BLOCK + RESERVE  # written, not a sparse hole
    for i in range(5):
        f.append(payload(i))
    after = os.stat(f.path)
    assert (after.st_size, after.st_blocks) == (before.st_size, before.st_blocks)
    f.close()
    assert JournalFile(f.path).read() == [payload(i) for i in range(5)]


def test_the_file_doubles_when_its_zeros_run_out_and_keeps_every_record(
    tmp_path: Path,
) -> None:
    f = JournalFile(tmp_path / "j.log", reserve=4 * BLOCK)
    records = [payload(i, 5000) for i in range(7)]  # 3 blocks each
    for r in records:
        f.append(r)
    assert f.size >= f.end and f.size >= 2 * (BLOCK + 4 * BLOCK)  # grown: doubled at least
    assert os.path.getsize(f.path) == f.size
    assert JournalFile(f.path).read() == records
    f.append(payload(99))
    assert f.read() == [*records, payload(99)]


def test_a_file_of_another_kind_or_version_is_refused_in_one_line(tmp_path: Path) -> None:
    path = two_records(tmp_path)
    data = bytearray(path.read_bytes())
    data[8:12] = (FORMAT + 1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(StateFormatError, match=f"state format {FORMAT + 1};") as e:
        JournalFile(path).read()
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    data[:8] = b"ddpend\0\0"  # a pending log segment's header
    path.write_bytes(bytes(data))
    with pytest.raises(StateFormatError, match="not a ddmerge file"):
        JournalFile(path).create()


def two_records(tmp_path: Path) -> Path:
    """A closed journal file of payloads 0 and 1 (two blocks each), for a crash to tear."""
    path = tmp_path / "j.log"
    f = JournalFile(path)
    f.append(payload(0))
    f.append(payload(1))
    f.close()
    return path


def test_a_torn_record_ends_the_records_and_is_zeroed_before_the_next(
    tmp_path: Path,
) -> None:
    path = two_records(tmp_path)
    data = bytearray(path.read_bytes())
    torn = encoded(payload(2, 10000))  # four blocks; the crash wrote three
    data[5 * BLOCK : 8 * BLOCK] = torn[: 3 * BLOCK]
    path.write_bytes(bytes(data))
    assert JournalFile(path).read(repair=False) == [payload(0), payload(1)]
    assert path.read_bytes()[5 * BLOCK : 6 * BLOCK] != bytes(BLOCK)  # not repaired
    again = JournalFile(path)
    again.append(payload(3))  # a shorter record where the torn one began
    assert path.read_bytes()[7 * BLOCK :].strip(b"\0") == b""
    assert JournalFile(path).read() == [payload(0), payload(1), payload(3)]


def test_a_clear_torn_by_a_crash_never_lets_a_stale_record_follow_a_new_one(
    tmp_path: Path,
) -> None:
    """`clear` zeroes in place; a crash may leave any of its blocks unwritten. Here the
    first record's header was zeroed and the second's was not: the file reads empty, and
    the second is zeroed before a record of the first's size is written where the first
    was (without that, the stale second would read back after it)."""
    path = two_records(tmp_path)
    data = bytearray(path.read_bytes())
    data[BLOCK : 2 * BLOCK] = bytes(BLOCK)
    path.write_bytes(bytes(data))
    again = JournalFile(path)
    assert again.read() == []
    again.append(payload(7))
    assert JournalFile(path).read() == [payload(7)]


def test_clear_zeroes_the_records_in_place(tmp_path: Path) -> None:
    f = JournalFile(tmp_path / "j.log")
    for i in range(3):
        f.append(payload(i))
    inode, size = os.stat(f.path).st_ino, os.stat(f.path).st_size
    f.clear()
    assert os.stat(f.path).st_ino == inode and os.stat(f.path).st_size == size
    assert f.path.read_bytes()[BLOCK:].strip(b"\0") == b""
    f.append(payload(5))
    assert JournalFile(f.path).read() == [payload(5)]


def record(version: int) -> MergeRecord:
    return MergeRecord(
        version=version,
        ids=["a"],
        high_water={"a": (0, version)},
        live_tokens=1.0,
        policy={},
        digest="0" * 16,
        stream=False,
        inputs=1,
    )


def test_a_merge_record_of_unknown_fields_is_refused_in_one_line(tmp_path: Path) -> None:
    journal = MergeJournal(tmp_path, 0)
    journal.append(record(0))
    journal.file.append(record(1).encode().replace(b'"ids"', b'"learners"'))
    journal.close()
    with pytest.raises(StateFormatError, match="a merge record of fields") as e:
        MergeJournal(tmp_path, 0).records()
    assert "\n" not in str(e.value) and "merges-0000.log" in str(e.value)


def test_compaction_keeps_the_records_a_merge_appends_while_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new file is written without the journal's lock; a merge that appends meanwhile
    must find its record in the file that replaces the old one."""
    journal = MergeJournal(tmp_path, 0)
    for v in range(4):
        journal.append(record(v))
    real_prepare = journal.file.prepare
    appended = threading.Event()

    def prepare(keep: list[bytes]) -> Path:
        tmp = real_prepare(keep)
        t = threading.Thread(target=lambda: (journal.append(record(4)), appended.set()))
        t.start()  # the lock is free: the merge's append goes in at once
        t.join(timeout=10)
        return tmp

    monkeypatch.setattr(journal.file, "prepare", prepare)
    journal.compact(2)
    assert appended.is_set()
    assert [r.version for r in journal.records()] == [2, 3, 4]
    journal.append(record(5))
    journal.close()
    assert [r.version for r in MergeJournal(tmp_path, 0).records()] == [2, 3, 4, 5]


def test_compaction_that_drops_every_record_keeps_the_file_and_its_zeros(
    tmp_path: Path,
) -> None:
    journal = MergeJournal(tmp_path, 0)
    journal.create()
    inode = os.stat(journal.path).st_ino
    for v in range(3):
        journal.append(record(v))
    journal.compact(3)
    assert journal.records() == []
    assert os.stat(journal.path).st_ino == inode  # cleared in place, not replaced
    journal.compact(3)  # nothing to drop: nothing written
    assert os.stat(journal.path).st_ino == inode
