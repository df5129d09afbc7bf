"""SIGKILL the synchronizer mid-run, restart it on the same state directory.

    pytest tests/e2e/test_sync_restart.py -m e2e

Shows: the versions resume where they were durably written (nothing a learner adopted is
lost), merging continues from there, and the learner
processes keep running throughout (they retry with backoff, they are never restarted).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddiloco.learner.sync_client import SyncUnavailable
from ddiloco.local.processes import terminate_all
from ddiloco.synchronizer.replay import recovered
from ddiloco.synchronizer.storage.state import StateStore
from ddiloco.wire import codec
from ddiloco.wire.protocol import UpdateMeta

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
TOKEN = "e2e-token"


def adopted(log: Path) -> list[dict]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("event") == "adopt":
            out.append(rec)
    return out


def handed_over(log: Path, since: float) -> set[int]:
    """The fragments a learner's log says it handed over at or after `since`."""
    if not log.exists():
        return set()
    out = set()
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("event") == "handover" and rec.get("t", 0) >= since:
            out.add(rec["fragment"])
    return out


def wait_for(pred, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_synchronizer_killed_and_restarted_resumes_exactly(
    tmp_path: Path, synchronizer_process: Callable[..., Any], learner_process: Callable[..., Any]
) -> None:
    proc = synchronizer_process(tmp_path, TOKEN)
    sync, state = proc.child, proc.state
    learners = [learner_process(tmp_path, proc, i, 2, "-H", "12", "-P", "4") for i in range(2)]
    client = proc.client(timeout=5)
    try:
        sync.start()
        wait_for(client.healthy, 60, "the synchronizer")
        for c in learners:
            c.start()
        wait_for(lambda: client.status().global_version >= 12, 180, "a dozen merges")
        sync.kill()
        store = StateStore(state)
        layout = store.load_layout()
        assert layout is not None
        durable = [  # the fragment files, with the merges their journals hold (journal.py)
            recovered(store, f).version for f in layout.fragments
        ]
        seen_before = {}
        for c in learners:
            for rec in adopted(tmp_path / f"{c.name}.jsonl"):
                seen_before[rec["fragment"]] = max(
                    seen_before.get(rec["fragment"], 0), rec["version"]
                )
        # nothing a learner adopted can be missing from disk (published only once durable)
        assert all(seen_before.get(p, 0) <= v for p, v in enumerate(durable)), (
            seen_before,
            durable,
        )
        time.sleep(2.0)  # learners train on without the synchronizer
        assert all(c.alive() for c in learners)
        sync.start()
        restarted = time.time()
        wait_for(client.healthy, 60, "the restarted synchronizer")
        resumed = [f.version for f in client.status().fragments]
        assert all(r >= d for r, d in zip(resumed, durable, strict=True))
        assert "Resumed state" in (tmp_path / "sync.log").read_text()
        target = sum(durable) + 8
        wait_for(lambda: client.status().global_version >= target, 120, "merges after the restart")
        # the backlog held through the outage can make those merges before any learner's next
        # fetch; wait (bounded) until every learner has adopted one of them (what the checks
        # below ask of each; waiting for any one let the other's fetch lose the race)
        wait_for(
            lambda: all(
                any(rec["version"] > max(durable) for rec in adopted(tmp_path / f"{c.name}.jsonl"))
                for c in learners
            ),
            120,
            "every learner adopting a post-restart merge",
        )
        # and every learner has handed every fragment over since (a learner slow to start
        # under load may join only now: its join's adoptions satisfy the wait above)
        wait_for(
            lambda: all(
                handed_over(tmp_path / f"{c.name}.jsonl", restarted) >= set(range(4))
                for c in learners
            ),
            120,
            "every learner handing every fragment over after the restart",
        )
        assert all(c.alive() and len(c.starts) == 1 for c in learners)  # never restarted
    except SyncUnavailable as e:
        raise AssertionError(
            f"synchronizer unreachable: {e}\n{(tmp_path / 'sync.log').read_text()[-3000:]}"
        ) from e
    finally:  # the learners first: a SIGTERM drains their outboxes into the live synchronizer
        terminate_all(learners)
        terminate_all([sync])
    store = StateStore(state)
    layout = store.load_layout()
    assert layout is not None
    for p, f in enumerate(layout.fragments):
        fs = recovered(store, f)  # a clean stop wrote them: no-op
        assert fs.version == fs.merges  # one version per merge: none skipped, none doubled
        assert fs.version >= durable[p]
        # both learners' work reached every fragment: merged, or accepted and durably waiting
        # in its open round when the run was stopped (a slow learner's last hand-over may not
        # have met a quorum yet; exactly once: tests/e2e/test_ledger_e2e.py)
        waiting = {
            UpdateMeta.from_metadata(codec.read_header(r).metadata).learner_id
            for r in store.pending(p).read()
        }
        assert set(fs.high_water) | waiting == {"l0", "l1"}, (
            p,
            fs.high_water,
            waiting,
            [ln for c in learners for ln in c.log_path.read_text().splitlines() if "stopped" in ln],
        )
    for c in learners:
        steps = [
            json.loads(x)["step"]
            for x in (tmp_path / f"{c.name}.jsonl").read_text().splitlines()
            if '"dt"' in x
        ]
        assert steps == list(
            range(1, len(steps) + 1)
        )  # one incarnation, steps continued through the outage
        by_fragment: dict[int, list[int]] = {}
        for rec in adopted(tmp_path / f"{c.name}.jsonl"):
            by_fragment.setdefault(rec["fragment"], []).append(rec["version"])
        for versions in by_fragment.values():
            assert versions == sorted(set(versions))  # strictly increasing: nothing applied twice
        assert max(max(v) for v in by_fragment.values()) > max(
            durable
        )  # adopted post-restart merges
