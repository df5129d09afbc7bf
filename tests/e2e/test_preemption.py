"""A learner sent SIGTERM hands over its work and exits 0: real processes, one inner step lost at most.

    .venv/bin/pytest tests/e2e/test_preemption.py

A real synchronizer and one real learner (tiny model, H = 8, P = 2: at any step both
fragments have steps behind them that are not handed over yet, between 1 and 8 each). The
learner is sent SIGTERM mid-cycle, as a pod eviction or spot notice would; it must finish
the step it is in, hand over every fragment with work behind it, wait for those uploads and
exit 0. Then, per fragment, the tokens it computed (its "stop" record) minus the tokens the
synchronizer accepted from it (merged + pending, /v1/status; the job's only learner) is at
most one inner step's tokens. The numbers over many preemptions, against SIGKILL:
bench/preemption.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddiloco.local.processes import terminate_all
from ddiloco.local.report import read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(120)]
TOKEN = "e2e-preemption"
H, P = 8, 2


def last_step(path: Path) -> int:
    return max((r["step"] for r in read_jsonl(path) if "step" in r and "event" not in r), default=0)


def accepted(client: Any) -> list[int]:
    return [f.tokens_merged + f.tokens_pending for f in client.status().fragments]


def test_sigterm_hands_over_everything_and_exits_0(
    tmp_path: Path, synchronizer_process: Callable[..., Any], learner_process: Callable[..., Any]
) -> None:
    proc = synchronizer_process(tmp_path, TOKEN)
    learner = learner_process(
        tmp_path,
        proc,
        0,
        1,
        "-H",
        str(H),
        "-P",
        str(P),
        "--max-seconds",
        "90",
        DDILOCO_DRAIN_S="20",
    )
    log = tmp_path / "l0.jsonl"
    client = proc.client(timeout=5)
    try:
        proc.start()
        learner.start()
        deadline = time.time() + 80
        target = 3 * H + H // 2 + 1  # mid-cycle for both fragments
        while last_step(log) < target:
            assert learner.alive(), learner.log_path.read_text()[-3000:]
            assert time.time() < deadline, "the learner did not reach its step"
            time.sleep(0.01)
        assert learner.proc is not None
        t0 = time.time()
        learner.proc.terminate()
        code = learner.proc.wait(timeout=40)
        exit_s = time.time() - t0
        # an upload answered just before the exit is counted by now; give the status a moment
        time.sleep(0.5)
        got = accepted(client)
    finally:
        terminate_all([learner, proc.child])
    print(f"SIGTERM at step >= {target}: exit {code} after {exit_s:.2f} s, accepted {got}")
    assert code == 0, learner.log_path.read_text()[-3000:]
    stop = next(r for r in read_jsonl(log) if r.get("event") == "stop")
    assert stop["steps"] >= target
    per_step = stop["tokens"] // stop["steps"]
    assert stop["tokens"] == per_step * stop["steps"] > 0
    for row in stop["ledger"]:
        assert row["balanced"], row
        assert row["queued_tokens"] == 0, row  # every upload was answered before the exit
    lost = [stop["tokens"] - a for a in got]
    assert all(0 <= x <= per_step for x in lost), (
        f"tokens lost per fragment {lost} (computed {stop['tokens']}, accepted {got}): "
        f"more than one inner step ({per_step} tokens)"
    )
