"""bench/learner_startup.py on tiny corpora: every arm runs real processes and reports.

    .venv/bin/pytest tests/e2e/test_bench_learner_startup.py

The figures themselves come from a run at full size (the script's docstring); here each arm
runs at a fraction of a megabyte so that the whole path is exercised in about a minute: the
corpus, `ddiloco prepare`, the repeated prepared dataset, a synchronizer and a learner per
arm, the replacement resuming the slot, the extrapolation and the JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_bench

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]


def test_every_arm_reports_its_time_to_first_step(tmp_path: Path) -> None:
    bench = load_bench("learner_startup")
    out = tmp_path / "startup.json"
    argv = ["--before-mb", "0.3,0.6", "--after-mb", "0.3,1", "--chunk-tokens", "20000"]
    argv += ["--work", str(tmp_path / "work"), "--json", str(out)]
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    arms = {(a["path"], a["corpus_mb"]): a for a in res["arms"]}
    assert set(arms) == {("before", 0.3), ("before", 0.6), ("after", 0.3), ("after", 1.0)}
    for a in arms.values():
        assert 0 < a["first_step_s"] < 120 and 0 < a["replacement_first_step_s"] < 120
        assert all(r["resumed_at"] > 0 for r in a["runs"])  # the synchronizer's record
    assert res["prepare"]["mb_per_s"] > 0 and res["prepare"]["source_mb"] == pytest.approx(
        0.3, 0.01
    )
    assert res["before_extrapolated"]["corpus_mb"] == 1.0
    assert res["after_ratio_biggest_over_smallest"] > 0
    # the after arms trained from prepared datasets, opened by their manifests
    logs = (tmp_path / "work" / "after-1mb-0" / "l0-0.log").read_text()
    assert "prepared dataset" in logs and "1000000 training tokens" in logs
    assert not (tmp_path / "work" / "prepared-1mb" / "manifest.json").exists()  # removed after
