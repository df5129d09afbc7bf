"""A replacement learner continues its slot's data stream; it does not retrain it.

    pytest tests/e2e/test_resume_data.py -m e2e

A real synchronizer and a real learner (tiny GPT, a JSONL corpus cut from the standard
library's sources): the learner is SIGKILLed mid-run and a new process with the same learner
id takes the slot. Evidence: with `--log-level DEBUG` the learner's batch stream logs every
batch as it is drawn, before it is trained (`data positions=lo:hi rank=r windows=i,j,...`,
learner/data.py), so the first process's log lists every window it may have trained on, the
one it was killed in included. The replacement's first batch, and every one after it, must
hold none of those windows, and must start where the synchronizer recorded the slot (its
ledger, which ran ahead of every draw: learner/corpus.py, the data contract).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ddiloco.learner.data import stdlib_files
from ddiloco.local.processes import Child, terminate_all
from ddiloco.synchronizer.storage.state import StateStore

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
DRAW = re.compile(r"data positions=(\d+):(\d+) rank=(\d+) windows=([\d,]+)")


def draws(log: Path) -> list[tuple[int, int, list[int]]]:
    """(lo, hi, window indices) of every batch the log says was drawn, in order."""
    out = []
    for m in DRAW.finditer(log.read_text(errors="replace")):
        out.append((int(m[1]), int(m[2]), [int(w) for w in m[4].split(",")]))
    return out


def wait_for(what: str, check: Callable[[], bool], child: Child, timeout_s: float = 90) -> None:
    deadline = time.time() + timeout_s
    while not check():
        assert child.alive(), (
            f"{child.name} died waiting for {what}:\n" + child.log_path.read_text()[-3000:]
        )
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_replacement_never_trains_a_window_its_slot_drew(
    tmp_path: Path, synchronizer_process: Callable, learner_process: Callable
) -> None:
    corpus = tmp_path / "docs.jsonl"
    with open(corpus, "w") as f:
        for source in stdlib_files()[:40]:
            for doc in source.read_text(errors="replace").split("\n\n\n"):
                f.write(json.dumps({"text": doc}) + "\n")
    sync = synchronizer_process(tmp_path, "resume-token", "--no-grace")
    flags = ["--data", str(corpus), "--batch-size", "4", "-H", "8", "-P", "2"]
    flags += ["--max-steps", "1000000", "--log-level", "DEBUG"]
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}  # shared by both processes of the slot
    first = learner_process(tmp_path / "first", sync, 0, 1, *flags, **env)
    second = learner_process(tmp_path / "second", sync, 0, 1, *flags, **env)
    ids = [c.argv[c.argv.index("--learner-id") + 1] for c in (first, second)]
    assert ids == ["l0", "l0"]  # the same slot, a new process
    client = sync.client()

    def recorded() -> int:
        rows = [r for r in client.status().learners if r.learner_id == "l0"]
        return rows[0].data_position if rows else 0

    try:
        sync.start()
        first.start()
        # mid-run: it has drawn a good many batches and reported reservations beyond its join's
        wait_for("40 batches", lambda: len(draws(first.log_path)) >= 40, first)
        wait_for("a reported reservation", lambda: recorded() > 32 + 40 * 4, first)
        first.kill()  # SIGKILL: no flush, no goodbye
        trained = draws(first.log_path)
        position = recorded()
        ledger = StateStore(sync.state).load_ledger()
        assert [r["data_position"] for r in ledger["learners"]] == [position]  # durable
        drawn_to = max(hi for _, hi, _ in trained)
        assert position >= drawn_to, (position, drawn_to)  # the record ran ahead of every draw

        second.start()
        wait_for("the replacement's batches", lambda: len(draws(second.log_path)) >= 5, second)
        second.stop()
    finally:
        client.close()
        terminate_all([first, second, sync.child])

    seen = {w for _, _, windows in trained for w in windows}
    resumed = draws(second.log_path)
    lo, _, first_windows = resumed[0]
    assert lo == position  # it continued the slot's stream where the synchronizer counted it
    assert not seen & set(first_windows), sorted(seen & set(first_windows))
    assert not seen & {w for _, _, windows in resumed for w in windows}
    assert [b[0] for b in resumed[:5]] == [position + 4 * i for i in range(5)]
    # the replacement read the slot's tokens from the cache the first process wrote
    assert "from the cache" in second.log_path.read_text()
    skipped = lo - drawn_to
    print(
        f"\nkilled after {len(trained)} batches (positions < {drawn_to}); replacement began at "
        f"{lo}: {skipped} windows skipped (reserved, never trained), 0 retrained"
    )
