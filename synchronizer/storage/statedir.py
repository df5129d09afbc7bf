"""The state directory as a whole: taken by one synchronizer, checked, and read back.

    held = open_state_dir(root)      # the lock (a second synchronizer is refused), stale
                                     # `.*.tmp` gone, every file's format version checked
    back = read_back(store, p)       # fragment p's file state, merge records, logged updates

`open_state_dir` is the synchronizer process's (server.py), not `StateStore`'s: `ddiloco
export` reads a state directory beside the synchronizer that holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

from ddiloco.synchronizer.buffers import ALIGN
from ddiloco.synchronizer.storage.journal import MergeJournal, MergeRecord
from ddiloco.synchronizer.storage.ledgerdb import LedgerDB
from ddiloco.synchronizer.storage.records import (
    PENDING,
    check_file_header,
    load_json,
)
from ddiloco.synchronizer.storage.segments import FragmentLog
from ddiloco.synchronizer.storage.state import JSON_FILES, FragmentState, StateStore

__all__ = ["LOCK", "StateDirBusy", "Stored", "check_formats", "open_state_dir", "read_back"]

LOCK: Final = "lock"
"""The lock file: `flock`ed by the synchronizer that holds the directory; holds its pid."""
_FRAGMENT = re.compile(r"fragment-\d{4}\.safetensors")
_PENDING = re.compile(r"pending-\d{4}\.\d{6}\.log")
_JOURNAL = re.compile(r"merges-\d{4}\.log")


class StateDirBusy(RuntimeError):
    """Another process holds the state directory's lock."""


def open_state_dir(root: Path) -> IO[bytes]:
    """Take `root` (created if missing) for this process: an exclusive `flock` on its lock
    file, held while the returned file stays open (the kernel lets go when the process
    dies, however it dies); then the stale `.*.tmp` files a crash left are deleted and every
    file's format version checked (`check_formats`). `StateDirBusy` if another process
    holds it, `StateFormatError` for a file of another format: one line each."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    f = open(root / LOCK, "a+b")  # noqa: SIM115 - held open for the process's life
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read(32).decode(errors="replace").strip() or "unknown"
            raise StateDirBusy(
                f"state dir {root} is in use by another synchronizer (pid {pid}): one "
                "synchronizer per state dir"
            ) from None
        f.truncate(0)
        f.write(f"{os.getpid()}\n".encode())
        f.flush()
        for tmp in root.glob(".*.tmp"):  # a whole-file write a crash interrupted
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        check_formats(root)
    except BaseException:
        f.close()
        raise
    return f


def check_formats(root: Path) -> None:
    """Every file of the state directory `root` of this format version (`StateFormatError`
    naming the first that is not): the JSON files, the fragment files' metadata, the record
    files' headers and the merge journal's records, the ledger's `user_version`. Names the
    synchronizer does not write are left alone (a volume's `lost+found`, say)."""
    for path in sorted(Path(root).iterdir()):
        name = path.name
        if name in JSON_FILES:
            load_json(path, JSON_FILES[name])
        elif _FRAGMENT.fullmatch(name):
            StateStore.check_fragment(path)
        elif _PENDING.fullmatch(name):
            with open(path, "rb") as f:
                check_file_header(path, f.read(ALIGN), PENDING)
        elif _JOURNAL.fullmatch(name):  # small: its records are decoded too
            MergeJournal(root, int(name[7:11])).records(repair=False)
        elif name == "ledger.db":
            LedgerDB(path).check()


@dataclass
class Stored:
    """What storage holds of one fragment, in order."""

    state: FragmentState
    """The fragment file's state."""
    merges: list[MergeRecord]
    """The journal's merge records, in the order the merges were made."""
    updates: list[bytes]
    """The pending log's update payloads, in the order accepted (every segment)."""


def read_back(
    store: StateStore,
    p: int,
    *,
    repair: bool = True,
    state: FragmentState | None = None,
    journal: MergeJournal | None = None,
    log_if_merges: bool = False,
) -> Stored:
    """Fragment p as storage holds it: its file's state (`state` if given), its journal's
    records (`journal`'s if given), its log's payloads (none if `log_if_merges` and the
    journal holds no record: a reader that only needs the merged state). `repair`: torn
    tails are cut off (a restart); False: nothing is written (a reader beside a running
    synchronizer)."""
    fs = state if state is not None else store.load_fragment(p)
    merges = (journal or MergeJournal(store.root, p)).records(repair=repair)
    updates: list[bytes] = []
    if merges or not log_if_merges:
        log = store.pending(p) if repair else FragmentLog(store.root, p)
        updates = log.read(repair=repair)
    return Stored(fs, merges, updates)
