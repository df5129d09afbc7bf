"""A merge's durable record: the merge journal's file against SQLite in WAL mode, side by side.

    .venv/bin/python bench/journal_store.py --records 300 --dir /some/disk

Each arm makes `--records` merge records durable, one at a time, as merges do (a record is
served only once it is durable), and reports the latency of each append (p50, p99, max):

- `journalfile`: `JournalFile.append` (synchronizer/storage/journalfile.py): the record written
  over zeros made durable before it, one `fdatasync`.
- `sqlite-wal`: one `INSERT` committed in SQLite (the standard library's), `journal_mode=WAL`,
  `synchronous=FULL` (the WAL fsynced at each commit: durable on return, as the ledger is).

Both run on an idle disk and beside a writer (`--busy`): a thread writing 32 MB chunks to
another file of the same directory and fsyncing each, as the pending log's uploads and the
background fragment writer do during a saturated ingest. The figure that matters is the ratio
between the arms on the same disk, in the same run.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ddiloco.synchronizer.storage.journalfile import JournalFile

RECORD = (b'{"digest": "0123456789abcdef", "ids": ["learner-00"], "policy": {}} ' * 30)[:2000]
"""About the size of a merge record of a dozen learners."""


def journalfile(root: Path) -> tuple[Callable[[], None], Callable[[], None]]:
    f = JournalFile(root / "merges-0000.log")
    f.create()
    return (lambda: f.append(RECORD)), f.close


def sqlite_wal(root: Path) -> tuple[Callable[[], None], Callable[[], None]]:
    db = sqlite3.connect(root / "journal.db", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE IF NOT EXISTS merges (version INTEGER PRIMARY KEY, record BLOB)")
    n = [0]

    def append() -> None:
        db.execute("INSERT INTO merges (version, record) VALUES (?, ?)", (n[0], RECORD))
        n[0] += 1

    return append, db.close


ARMS = {"journalfile": journalfile, "sqlite-wal": sqlite_wal}


def busy_writer(root: Path, stop: threading.Event) -> threading.Thread:
    chunk = os.urandom(32 << 20)

    def run() -> None:
        path = root / "pending-0000.000001.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            at = 0
            while not stop.is_set():
                os.pwrite(fd, chunk, at)
                os.fsync(fd)
                at += len(chunk)
                if at >= 1 << 30:  # a segment let go of, a new one
                    os.ftruncate(fd, 0)
                    at = 0
        finally:
            os.close(fd)
            path.unlink()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def measure(name: str, root: Path, records: int, busy: bool) -> list[float]:
    with tempfile.TemporaryDirectory(dir=root) as d:
        where = Path(d)
        append, close = ARMS[name](where)
        stop = threading.Event()
        writer = busy_writer(where, stop) if busy else None
        if writer is not None:
            time.sleep(1.0)  # the writer's queue filled
        times = []
        try:
            for _ in range(records):
                t0 = time.perf_counter()
                append()
                times.append(time.perf_counter() - t0)
                time.sleep(0.005)  # merges are apart; the writer runs between them
        finally:
            stop.set()
            if writer is not None:
                writer.join()
            close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=300)
    ap.add_argument("--dir", default=".", help="a directory on the disk to measure")
    ap.add_argument("--busy", default="0,1", help="without (0) and with (1) a writer beside")
    args = ap.parse_args()
    print(f"{'arm':<12} {'busy':>4} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for busy in (b == "1" for b in args.busy.split(",")):
        for name in ARMS:
            t = sorted(measure(name, Path(args.dir), args.records, busy))
            p99 = t[min(len(t) - 1, int(0.99 * len(t)))]
            print(
                f"{name:<12} {int(busy):>4} {statistics.median(t) * 1e3:>8.2f} "
                f"{p99 * 1e3:>8.2f} {t[-1] * 1e3:>8.2f}"
            )


if __name__ == "__main__":
    main()
