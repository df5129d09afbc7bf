"""Equal tokens by construction, end to end: the data-parallel runner's step budget, and
bench/quality.py running a DiLoCo arm and the data-parallel arm on one seed.

pytest tests/e2e/test_quality.py -m e2e
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddiloco.local.dp_run import DPConfig, DPRun
from ddiloco.local.report import read_jsonl
from tests.conftest import load_bench

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]


def test_dp_step_budget_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    run = DPRun(
        DPConfig(
            learners=2, max_steps=25, max_seconds=200, ckpt_every=10, eval_every=60, out=tmp_path
        )
    )
    r = run.run()
    assert all(child.finished for child in run.ranks)  # stopped by the budget, not the cap
    assert [s["steps"] for s in r["learners"]] == [25, 25]
    assert r["tokens_computed"] == 2 * 25 * run.evaluator.task.tokens_per_batch
    for child in run.ranks:
        stops = [x for x in read_jsonl(run.learner_log(child.name)) if x.get("event") == "stop"]
        assert stops[-1]["step"] == 25
    # step 25 is no multiple of ckpt_every: the budget's own checkpoint is what was evaluated
    assert run.evaluator.history[-1][2] == 25
    assert r["eval_loss_final"] < r["eval_loss_initial"]


def test_harness_runs_two_arms_at_equal_tokens_and_resumes(tmp_path: Path) -> None:
    load_bench("quality_stats")  # what quality.py imports from beside itself
    quality = load_bench("quality")
    argv = ["--arms", "sync_diloco,dp", "--seeds", "1", "--learners", "2", "--steps", "24"]
    argv += ["--eval-windows", "256", "--out", str(tmp_path)]
    assert quality.main(argv) == 0
    runs = {
        r["arm"]: r
        for r in (json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/result.json"))
    }
    assert set(runs) == {"sync_diloco", "dp"}
    for r in runs.values():
        assert r["budget_met"] and r["final_model_fresh"]
        assert r["tokens"] == 2 * 24 * 8 * 64
        assert r["eval_windows"] == 256 and 0 < r["eval_se"] < 0.1
        assert r["eval_loss"] < r["eval_loss_initial"]
    summary = json.loads((tmp_path / "quality.json").read_text())
    (row,) = summary["comparisons"]
    assert (row["arm"], row["reference"], row["seeds"]) == ("sync_diloco", "dp", [0])
    assert "relative" not in row  # one seed: no interval
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*/result.json")}
    assert quality.main(argv) == 0  # the same part again: nothing reruns
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    with pytest.raises(SystemExit):  # other settings in the same --out
        quality.main([*argv[:-2], "--steps", "48", "--out", str(tmp_path)])
