"""`ddiloco local` end to end: real synchronizer and learner processes, with chaos.

pytest tests/e2e/test_local.py -m e2e
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]


def test_local_run_with_kill_chaos_keeps_merging_and_learning(tmp_path: Path) -> None:
    report_path = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "ddiloco.cli.main",
        "local",
        "--learners",
        "3",
        "--max-seconds",
        "30",
        "--seed",
        "1",
        "--batch-size",
        "12",  # not the default: tokens must be counted with the learners' batch
        "--chaos",
        "kill",
        "--merge",
        "mean",  # not the default: the flag must reach the synchronizer's merges
        "--report",
        str(report_path),
        "--out",
        str(tmp_path / "run"),
        "--quiet",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=360)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(report_path.read_text())
    for key in (
        "goodput",
        "merged_work_ratio",
        "eval_loss_initial",
        "eval_loss_final",
        "merges",
        "tokens_computed",
        "tokens_merged",
        "bytes_up",
        "bytes_down",
        "learner_restarts",
        "wall_seconds",
        "config",
        "learners",
    ):
        assert key in r, key
    assert r["learner_restarts"] >= 1
    assert r["eval_loss_final"] <= 0.8 * r["eval_loss_initial"]
    assert 0.0 < r["goodput"] <= 1.0 and 0.0 < r["merged_work_ratio"] <= 1.0
    assert len(r["learners"]) == 3 and r["tokens_computed"] > r["tokens_merged"] > 0
    assert r["config"]["tokens_per_step"] == 12 * 64  # tiny's block size is 64
    assert r["merge_rules"] == ["mean"]  # what the synchronizer ran, dense fragments included
    # merges continued through the kills: the global version kept rising after the first one
    first_kill = min(t for lr in r["learners"] for t in lr["kill_times"])
    versions_after = [v for t, _, v in r["eval_history"] if t > first_kill]
    versions_before = [v for t, _, v in r["eval_history"] if t <= first_kill] or [0]
    assert versions_after and max(versions_after) > max(versions_before)
    killed = [lr for lr in r["learners"] if lr["restarts"]]
    assert all(lr["dead_seconds"] > 0 for lr in killed)
    assert (tmp_path / "run" / "report.png").stat().st_size > 10_000
