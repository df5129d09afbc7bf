"""SIGKILL the synchronizer while accepted updates wait in open rounds; nothing is lost.

    pytest tests/e2e/test_ledger_e2e.py -m e2e

Three real learner processes, one of them three times slower, and a real synchronizer with
quorum 3, so rounds stay open waiting for the slow one and accepted updates (late ones
among them) sit in them. The synchronizer is SIGKILLed at a moment its status shows
accepted tokens pending, and restarted on the same state directory; the learners train on
and then stop by their step budget. Afterwards the ledger balances from both sides' own
counters, per fragment:

    synchronizer: tokens merged + tokens pending == tokens the learners were told were
                  accepted (or, for a re-send after a lost answer, were a duplicate)
    each learner: computed == accepted + duplicate + refused + queued + not handed over
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddiloco.learner.sync_client import SyncUnavailable
from ddiloco.local.processes import terminate_all

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
TOKEN = "e2e-ledger"
M, P, STEPS = 3, 2, 480  # long enough that four merges happen while all three train


def wait_for(pred, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            value = pred()
        except SyncUnavailable:
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def stop_record(log: Path) -> dict:
    for line in reversed(log.read_text().splitlines()):
        rec = json.loads(line)
        if rec.get("event") == "stop":
            return rec
    raise AssertionError(f"{log} has no stop record")


def test_killed_synchronizer_loses_no_accepted_update(
    tmp_path: Path, synchronizer_process: Callable[..., Any], learner_process: Callable[..., Any]
) -> None:
    proc = synchronizer_process(tmp_path, TOKEN, DDILOCO_QUORUM=str(M), DDILOCO_MAX_STALENESS="8")
    sync = proc.child
    learners = [
        learner_process(
            tmp_path,
            proc,
            i,
            M,
            "-H",
            "8",
            "-P",
            str(P),
            "--max-steps",
            str(STEPS),
            DDILOCO_SLOW_FACTOR="3" if i == 0 else "1",
        )
        for i in range(M)
    ]
    client = proc.client(timeout=5)
    try:
        sync.start()
        wait_for(client.healthy, 60, "the synchronizer")
        for c in learners:
            c.start()
        wait_for(lambda: client.status().global_version >= 4, 120, "a few merges")
        pending = wait_for(
            lambda: sum(f.tokens_pending for f in client.status().fragments),
            60,
            "accepted tokens waiting in an open round",
        )
        sync.kill()
        assert pending > 0
        time.sleep(1.0)  # learners train on; their uploads fail and wait in their outboxes
        sync.start()
        wait_for(client.healthy, 60, "the restarted synchronizer")
        log = (tmp_path / "sync.log").read_text()
        replayed = [int(n) for n in re.findall(r"(\d+) pending updates replayed", log)]
        assert replayed and replayed[-1] > 0, "no pending update was replayed after the kill"
        for c in learners:
            wait_for(lambda c=c: c.exit_code() is not None, 240, f"{c.name} to finish")
        assert all(c.exit_code() == 0 for c in learners)
        status = client.status()
    finally:
        terminate_all([*learners, sync])
    told_accepted = [0] * P
    for i in range(M):
        rows = stop_record(tmp_path / f"l{i}.jsonl")["ledger"]
        for row in rows:
            assert row["balanced"], row
            assert row["queued_tokens"] == 0, row  # everything had an answer by the stop
            told_accepted[row["fragment"]] += row["accepted_tokens"] + row["duplicate_tokens"]
    for f in status.fragments:
        assert f.tokens_merged + f.tokens_pending == told_accepted[f.index], (
            f,
            told_accepted,
        )
        assert f.tokens_merged > 0
