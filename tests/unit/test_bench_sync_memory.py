"""bench/sync_memory.py on a tiny model: a real synchronizer process driven by the round
trip's clients, its resident memory attributed to the owners its objects name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_bench

sm = load_bench("sync_memory")

pytestmark = pytest.mark.slow  # a real synchronizer process and clients, for seconds


def test_owners_add_up_to_the_model_and_stay_within_the_process(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    args = ["--params", "2e6", "--learners", "2", "--quorum", "1", "--seconds", "3"]
    assert sm.main([*args, "--interval", "0.02", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    n = report["params"]
    assert n == 4 * 122 * 4096  # sync_ingest.layout: P = 4 tensors of [rows, 4096]
    assert report["accepted"] > 0 and report["downloads"] > 0 and report["errors"] == 0
    peak = report["peaks"]["run"]
    owners, status = peak["owners"], peak["status"]
    assert set(owners) == {k for k, _ in sm.OWNERS}
    assert owners["theta_momentum"] == 8 * n  # float32 Theta and momentum of every fragment
    # the served copy: the whole model in bfloat16 (the default broadcast), a header each
    assert 2 * n < owners["served"] < 2 * n + 4 * 4096
    resident = status["RssAnon"] + status["RssShmem"]
    assert 0 < sum(owners.values()) < resident
    assert report["owner_max"]["theta_momentum"] == 8 * n
    text = sm.table(report)
    for _, label in sm.OWNERS:
        assert label in text
