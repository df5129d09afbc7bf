"""The learner ledger on disk: a SQLite database, a row per learner record.

    db = LedgerDB(state_dir / "ledger.db")
    db.save({"l0": {...record...}}, totals={"bytes_up": 1, ...})   # one transaction, durable
    db.save({}, totals, drop=["x7"])                                # a dropped record goes
    rows, totals = db.load()

A join writes its one record (and the small totals), not every record the job ever had: a
write costs the same with 1,500 records as with one. SQLite (the standard library's) keeps
each commit atomic and durable: write-ahead log, `synchronous=FULL` (the log is fsynced
before a commit returns), so a SIGKILL at any instant leaves the ledger as of the last
commit, and whatever a join answered (an incarnation, a data position) was on disk first.

The format is versioned (`PRAGMA user_version` = `FORMAT`, the state directory's, records.py):
a database of another version is refused with one line rather than misread. Records and totals are JSON (the dataclass's
fields, ledger.py), so a field added later reads back with its default.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from ddiloco.synchronizer.storage.records import FORMAT, StateFormatError

_SCHEMA: Final = (
    "CREATE TABLE IF NOT EXISTS learners (learner_id TEXT PRIMARY KEY, record TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS totals (id INTEGER PRIMARY KEY CHECK (id = 0), body TEXT NOT NULL)",
)


class LedgerFormatError(StateFormatError):
    """The ledger database is of a format this synchronizer does not read."""


class LedgerDB:
    """One connection to the ledger database, shared by the synchronizer's threads (each
    call holds `lock`). Opened on first use, so a state directory that is only read (an
    export) gets no database."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=FULL")
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version not in (0, FORMAT):
                    raise LedgerFormatError(self.path, version, "its SQLite user_version")
                if version == 0:
                    with db:  # one transaction: the tables and the version together
                        db.execute("BEGIN IMMEDIATE")
                        for statement in _SCHEMA:
                            db.execute(statement)
                        db.execute(f"PRAGMA user_version = {FORMAT}")
            except BaseException:
                db.close()
                raise
            self._db = db
        return self._db

    def save(
        self,
        records: Mapping[str, dict[str, Any]],
        totals: dict[str, Any],
        drop: Iterable[str] = (),
    ) -> None:
        """Write `records` (by learner id, in place of their rows), delete the rows of
        `drop`, and replace the totals: one transaction, durable when this returns."""
        body = json.dumps(totals, sort_keys=True)
        rows = [(lid, json.dumps(rec, sort_keys=True)) for lid, rec in records.items()]
        with self.lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany("DELETE FROM learners WHERE learner_id = ?", [(d,) for d in drop])
                db.executemany(
                    "INSERT INTO learners (learner_id, record) VALUES (?, ?) "
                    "ON CONFLICT(learner_id) DO UPDATE SET record = excluded.record",
                    rows,
                )
                db.execute(
                    "INSERT INTO totals (id, body) VALUES (0, ?) "
                    "ON CONFLICT(id) DO UPDATE SET body = excluded.body",
                    (body,),
                )
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def load(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Every saved record (as saved, not yet checked: ledger.record_from_row) and the
        totals; ([], {}) for a new database. A row that is not a JSON object is skipped."""
        with self.lock:
            if not self.path.exists():
                return [], {}
            db = self._conn()
            raw = db.execute("SELECT record FROM learners ORDER BY learner_id").fetchall()
            found = db.execute("SELECT body FROM totals WHERE id = 0").fetchone()
        rows = [r for r in (_object(text) for (text,) in raw) if r is not None]
        return rows, (_object(found[0]) or {}) if found else {}

    def check(self) -> None:
        """Open the database (its version checked, `LedgerFormatError`), then close it."""
        self._conn()
        self.close()

    def rows_written(self) -> int:
        """Rows this connection has inserted, updated or deleted: what its saves cost."""
        with self.lock:
            return self._conn().total_changes

    def close(self) -> None:
        with self.lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def _object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
