"""The merge journal: a merge made durable by a record of its inputs, before it is served.

Writing and fsyncing the fragment file (64 MB of Theta and 64 MB of momentum for a 16M-parameter
fragment) before serving would be half of a merge's time (bench/RESULTS.md, "Figures behind the
code"). The merge's inputs are on disk already: every update it took is a record in the fragment's
pending log, written before the update joined its round (its uploader's fsync comes after, so the
merge syncs those segments too: mostly at once). So a merge appends one small record here and fsyncs
it (`MergeRecord`: the fragment's version before, which learners' updates up to which order it took,
in the round's order and how many, the live token mass, the merge policy, and a digest of the
result), beside its segments' fsync, and its version is served once both are done; the fragment file
is written after, by `Snapshots` (snapshots.py) in the background, and only then are the journal's
records and the log's segments it covers let go. A crash between the two fsyncs can leave the last
record without some of its updates: replay drops it (`MergeRecord.inputs`).

This module stores and reads the records; it knows nothing of the merge. Redoing the
journaled merges at a restart is the synchronizer's (replay.py), fed by these records and
the pending log's.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.synchronizer.storage.journalfile import JournalFile
from ddiloco.synchronizer.storage.records import StateFormatError
from ddiloco.synchronizer.storage.state import Order

__all__ = ["MergeJournal", "MergeRecord"]


@dataclass(frozen=True)
class MergeRecord:
    version: int
    """The fragment's version the merge started from (its result is `version + 1`)."""
    ids: list[str]
    """The learners whose contributions the merge took, in the round's order."""
    high_water: dict[str, Order]
    """Per learner taken, the highest update order in its contribution."""
    live_tokens: float
    policy: dict[str, Any]
    """The merge policy's fields (replay.py `policy_fields`): a replay merges as this merge
    did, whatever the settings are now."""
    digest: str
    """XXH3-64 hex of the merged state (replay.py `digest`)."""
    stream: bool
    """The merge took the round's sum formed as its updates were admitted (`RoundSum`; a
    replay forms it again from the log, in the log's order); else it summed the
    contributions."""
    inputs: int
    """How many of the log's updates the merge took. The record is written beside its
    inputs' fsync (fragment.py), so a crash can leave a fragment's last record durable and
    some of those updates not: its merge was never served, and replay drops it when the
    log holds fewer."""

    def encode(self) -> bytes:
        d = dataclasses.asdict(self)
        d["high_water"] = {k: list(v) for k, v in self.high_water.items()}
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes, path: Path | None = None) -> MergeRecord:
        """The record `encode` wrote; `StateFormatError` (one line) for a record of other
        fields or types (another format's: the file header's version names ours)."""
        where = path if path is not None else Path("merge journal")
        try:
            d = json.loads(raw)
            fields = {f.name for f in dataclasses.fields(cls)}
            if not isinstance(d, dict) or set(d) != fields:
                got = sorted(d) if isinstance(d, dict) else type(d).__name__
                raise StateFormatError(where, "unknown", f"a merge record of fields {got}")
            d["high_water"] = {k: (int(v[0]), int(v[1])) for k, v in d["high_water"].items()}
            return cls(**d)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            if isinstance(e, StateFormatError):
                raise
            raise StateFormatError(where, "unknown", f"an unreadable merge record: {e}") from None


class MergeJournal:
    """`merges-PPPP.log`: the fragment's merges not yet in its file, one record each,
    written in place into zeros made durable before them (journalfile.py)."""

    def __init__(self, root: Path, p: int) -> None:
        self.path = root / f"merges-{p:04d}.log"
        self.file = JournalFile(self.path)
        self.lock = threading.Lock()

    def create(self) -> None:
        """The file and its zeros, made before the first merge needs them."""
        with self.lock:
            self.file.create()

    def records(self, *, repair: bool = True) -> list[MergeRecord]:
        with self.lock:
            return [MergeRecord.decode(r, self.path) for r in self.file.read(repair=repair)]

    def append(self, rec: MergeRecord) -> None:
        """Durable on return (one small write and one fdatasync)."""
        with self.lock:
            self.file.append(rec.encode())

    def clear(self) -> None:
        """No records (a restart that wrote the file, or dropped a merge never served)."""
        with self.lock:
            self.file.clear()

    def compact(self, version: int) -> None:
        """Let go of the records of merges the fragment file at `version` holds: zeros
        over them if none is left (in place), else a new file of those left. One caller at
        a time (the fragment's writer, or the restart before it): merges append meanwhile,
        and the lock is held for the rename only, not the new file's writing."""
        with self.lock:
            raw = self.file.read()
            keep = [r for r in raw if MergeRecord.decode(r, self.path).version >= version]
            if not keep:
                self.file.clear()
                return
            if len(keep) == len(raw):
                return
        tmp = self.file.prepare(keep)  # fsynced, beside the file
        with self.lock:
            since = self.file.read()[len(raw) :]  # appended while it was written
            self.file.replace(tmp, since)

    def close(self) -> None:
        with self.lock:
            self.file.close()
