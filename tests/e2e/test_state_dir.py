"""The state directory as a whole: a real `ddiloco synchronizer` refuses, in one line, a state
directory of another format and one another synchronizer holds; and at its start it deletes the
`.tmp` files a crash left.

    pytest tests/e2e/test_state_dir.py -m e2e

The refusals come before the synchronizer imports torch or binds a port.
"""

from __future__ import annotations

import json
import sqlite3
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ddiloco.synchronizer.storage.journal import MergeJournal, MergeRecord
from ddiloco.synchronizer.storage.records import FORMAT
from ddiloco.synchronizer.storage.segments import FragmentLog
from ddiloco.synchronizer.storage.state import FragmentState, StateStore
from ddiloco.synchronizer.storage.statedir import LOCK, StateDirBusy, open_state_dir
from ddiloco.wire.protocol import FragmentSpec, Layout, TensorSpec
from tests.e2e.conftest import SyncProcess, ddiloco_run, one_line_error

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
TOKEN = "e2e-token"
LAYOUT = Layout(
    fragments=[FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[4], dtype="float32")])]
)


def initialized(root: Path) -> StateStore:
    """A state directory as an init leaves it: layout, shard, one fragment file, a ledger."""
    store = StateStore(root)
    store.save_fragment(0, FragmentState({"w": torch.zeros(4)}, {"w": torch.zeros(4)}))
    store.save("shard.json", {"shard": 0, "shards": 1})
    store.save_layout(LAYOUT)
    store.save_ledger({}, {"bytes_up": 0})
    return store


def start_on(root: Path) -> object:
    return ddiloco_run(
        "synchronizer", "--port", "1", "--state-dir", str(root), env={"DDILOCO_TOKEN": TOKEN}
    )


def bare_layout(root: Path) -> None:
    """layout.json without its format: the layout alone."""
    (root / "layout.json").write_text(LAYOUT.model_dump_json())


def next_version_json(root: Path) -> None:
    (root / "shard.json").write_text(json.dumps({"format": FORMAT + 1, "shard": {}}))


def unversioned_fragment(root: Path) -> None:
    from safetensors.torch import save_file

    tensors = {"param/w": torch.zeros(4), "momentum/w": torch.zeros(4)}
    save_file(tensors, str(root / "fragment-0000.safetensors"), metadata={"version": "3"})


def next_version_segment(root: Path) -> None:
    log = FragmentLog(root, 0)
    log.append(b"an update")
    log.close()
    seg = next(root.glob("pending-0000.*.log"))
    data = bytearray(seg.read_bytes())
    data[8:12] = struct.pack("<I", FORMAT + 1)
    seg.write_bytes(bytes(data))


def unknown_merge_field(root: Path) -> None:
    rec = MergeRecord(0, ["a"], {"a": (0, 1)}, 1.0, {}, "0" * 16, stream=False, inputs=1)
    journal = MergeJournal(root, 0)
    journal.file.append(rec.encode().replace(b'"ids"', b'"learner_ids"'))
    journal.close()


def next_version_ledger(root: Path) -> None:
    db = sqlite3.connect(root / "ledger.db")
    db.execute(f"PRAGMA user_version = {FORMAT + 1}")
    db.commit()
    db.close()


@pytest.mark.parametrize(
    ("damage", "named", "found"),
    [
        (bare_layout, "layout.json", "None"),
        (next_version_json, "shard.json", str(FORMAT + 1)),
        (unversioned_fragment, "fragment-0000.safetensors", "None"),
        (next_version_segment, "pending-0000.000001.log", str(FORMAT + 1)),
        (unknown_merge_field, "merges-0000.log", "unknown (a merge record of fields"),
        (next_version_ledger, "ledger.db", str(FORMAT + 1)),
    ],
    ids=["layout", "shard", "fragment", "segment", "merge-record", "ledger"],
)
def test_a_state_dir_of_another_format_is_refused_in_one_line(
    tmp_path: Path, damage: Callable[[Path], None], named: str, found: str
) -> None:
    root = tmp_path / "state"
    initialized(root).close()
    damage(root)
    line = one_line_error(start_on(root), "synchronizer", 2)  # type: ignore[arg-type]
    assert f"{root / named} is state format {found}" in line
    assert f"reads format {FORMAT} only" in line


def test_a_second_synchronizer_on_a_held_state_dir_is_refused_in_one_line(
    tmp_path: Path, synchronizer_process: Callable[..., SyncProcess]
) -> None:
    first = synchronizer_process(tmp_path, TOKEN, "--no-grace")
    first.start()
    try:
        pid = (first.state / LOCK).read_text().strip()
        assert pid == str(first.child.proc.pid)  # type: ignore[union-attr]
        line = one_line_error(start_on(first.state), "synchronizer", 1)  # type: ignore[arg-type]
        assert f"state dir {first.state} is in use by another synchronizer (pid {pid})" in line
        assert first.client().healthy()  # the first one is untouched
        first.child.kill()  # SIGKILL: the kernel lets go of the lock
        first.start()  # a restart on the same dir takes it again
    finally:
        first.child.kill()


def test_the_start_deletes_stale_tmp_files_and_nothing_else(tmp_path: Path) -> None:
    root = tmp_path / "state"
    initialized(root).close()
    for name in (".layout.json.tmp", ".fragment-0000.safetensors.tmp", ".merges-0000.log.tmp"):
        (root / name).write_bytes(b"a whole-file write a crash interrupted")
    (root / "lost+found").mkdir()  # a volume's: not ours, left alone
    before = sorted(p.name for p in root.iterdir() if not p.name.endswith(".tmp"))
    held = open_state_dir(root)
    try:
        assert sorted(p.name for p in root.iterdir()) == sorted({*before, LOCK})
        with pytest.raises(StateDirBusy, match="in use by another synchronizer"):
            open_state_dir(root)  # another open file: flock refuses it in this process too
    finally:
        held.close()
    open_state_dir(root).close()  # let go: taken again
