"""The metrics of a real `ddiloco local` run: every documented name, with sensible values.

    pytest tests/e2e/test_metrics_e2e.py -m e2e

`ddiloco local --learner-metrics` (real synchronizer and learner processes) is scraped over
HTTP while it trains, twice, from here: counters must rise between the two. Its end-of-run
scrapes (<out>/metrics/*.prom: the launcher's, of every learner just before it stops them
and of the synchronizer once their last updates merged) must hold every metric the
"Metrics" table of docs/operations.md documents, with histogram counts equal to merges per
fragment.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
FRAGMENT_HISTOGRAMS = (
    "ddiloco_merge_duration_seconds",
    "ddiloco_round_quorum_seconds",
    "ddiloco_round_publish_seconds",
    "ddiloco_grace_window_seconds",
    "ddiloco_merge_contributors",
)
LEARNERS = ("learner-0", "learner-1")
BUDGET_ONLY = frozenset({"ddiloco_job_progress_ratio", "ddiloco_job_remaining_seconds"})
"""Served only by a job with a token budget (`--total-tokens`; tests/unit/test_budget.py)."""


def documented() -> dict[str, list[tuple[str, str]]]:
    """docs/operations.md "Metrics" table rows: served-by -> [(name, type)]."""
    text = DOCS.read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[tuple[str, str]]] = {}
    for m in re.finditer(r"^\| `(ddiloco_\w+)` \| (\w+) \|[^|]*\| (\w+) \|", text, re.M):
        rows.setdefault(m[3], []).append((m[1], m[2]))
    return rows


class Scrape:
    """One /metrics text: samples by (name, labels) and the declared type of each family."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def get(self, name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        assert key in self.samples, f"no sample {name}{labels}"
        return self.samples[key]

    def by(self, name: str, label: str) -> dict[str, float]:
        return {
            dict(lbls)[label]: v
            for (n, lbls), v in self.samples.items()
            if n == name and label in dict(lbls)
        }

    def has(self, name: str, kind: str) -> bool:
        return self.types.get(name) == kind  # text format 0.0.4: counters keep their _total


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        return resp.read().decode()


def wait_until(what: str, ok: Callable[[], bool], proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            if ok():
                return
        except OSError:
            pass
        assert proc.poll() is None, f"ddiloco local exited (rc {proc.returncode}) before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def scrape_all(index: dict) -> tuple[Scrape, dict[str, Scrape]]:
    sync = Scrape(http_get(index["synchronizer"]))
    return sync, {lid: Scrape(http_get(url)) for lid, url in index["learners"].items()}


def check_learner(s: Scrape, lid: str) -> None:
    for name, kind in documented()["learner"]:
        assert s.has(name, kind), (lid, name, kind)
    steps = s.get("ddiloco_learner_step_duration_seconds_count", learner=lid)
    compute = s.get("ddiloco_learner_step_duration_seconds_sum", learner=lid)
    assert steps > 0 and compute > 0
    assert s.get("ddiloco_learner_tokens_total", learner=lid) > 0
    assert s.get("ddiloco_learner_tokens_per_second", learner=lid) > 0
    assert math.isfinite(s.get("ddiloco_learner_loss", learner=lid))
    assert 0 < s.get("ddiloco_learner_loss", learner=lid) < 10
    # the loop never waits for the network: the wrapper holds it for a small share of compute
    assert 0 <= s.get("ddiloco_learner_sync_wait_seconds_total", learner=lid) < 0.25 * compute
    assert s.get("ddiloco_learner_handovers_total", learner=lid) >= 1
    assert s.get("ddiloco_learner_uploads_total", learner=lid, result="accepted") >= 1
    assert s.get("ddiloco_learner_uploads_total", learner=lid, result="refused") == 0
    assert s.get("ddiloco_learner_upload_queue_depth", learner=lid) >= 0
    lag_n = s.get("ddiloco_learner_adoption_lag_steps_count", learner=lid)
    lag_sum = s.get("ddiloco_learner_adoption_lag_steps_sum", learner=lid)
    assert lag_n >= 1 and 0 <= lag_sum <= 2 * lag_n  # folded in within a step or two


def check_synchronizer(s: Scrape, fragments: int) -> None:
    for name, kind in documented()["synchronizer"]:
        assert name in BUDGET_ONLY or s.has(name, kind), (name, kind)
    versions = s.by("ddiloco_fragment_version", "fragment")
    assert sorted(versions) == [str(p) for p in range(fragments)]
    for name in FRAGMENT_HISTOGRAMS:  # each merge observes each of them exactly once
        assert s.by(f"{name}_count", "fragment") == versions, name
    merges = s.get("ddiloco_merges_total")
    assert merges == sum(versions.values()) == s.get("ddiloco_global_version") > 0
    contributions = s.get("ddiloco_contributions_merged_total")
    assert s.get("ddiloco_update_staleness_count") == contributions >= merges
    assert s.get("ddiloco_update_staleness_sum") >= 0
    assert sum(s.by("ddiloco_merge_contributors_sum", "fragment").values()) == contributions
    assert 0 < s.get("ddiloco_merged_work_ratio") <= 1.0
    tokens = s.by("ddiloco_learner_tokens", "learner")
    assert set(tokens) == set(LEARNERS) and all(v > 0 for v in tokens.values())
    merged = s.by("ddiloco_learner_tokens_merged_total", "learner")
    assert sum(merged.values()) == pytest.approx(
        s.get("ddiloco_tokens_merged_total"), abs=fragments
    )
    accepted = s.get("ddiloco_updates_accepted_total")
    assert accepted == s.get("ddiloco_update_bytes_count") >= contributions
    assert s.get("ddiloco_update_bytes_sum") == s.get("ddiloco_bytes_up_total") > 0
    # learners upload bfloat16 deltas; the synchronizer serves bfloat16 fragments (the default)
    assert s.by("ddiloco_bytes_received_total", "encoding") == {
        "bf16": s.get("ddiloco_bytes_up_total")
    }
    assert s.by("ddiloco_bytes_served_total", "encoding") == {
        "bf16": s.get("ddiloco_bytes_down_total")
    }
    quorum = sum(s.by("ddiloco_round_quorum_seconds_sum", "fragment").values())
    publish = sum(s.by("ddiloco_round_publish_seconds_sum", "fragment").values())
    assert 0 <= quorum <= publish
    assert sum(s.by("ddiloco_grace_window_seconds_sum", "fragment").values()) >= 0
    assert s.get("ddiloco_learners_live") == len(LEARNERS)
    assert s.get("ddiloco_contributions_rejected_total") == 0
    assert sum(s.by("ddiloco_contributions_pending", "fragment").values()) >= 0


def test_local_run_exports_every_documented_metric(tmp_path: Path) -> None:
    assert set(documented()) >= {"synchronizer", "learner"}
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "ddiloco.cli.main",
        "local",
        "--learners",
        str(len(LEARNERS)),
        "--max-seconds",
        "16",
        "-H",
        "8",
        "-P",
        "2",
        "--hot-spares",
        "0",
        "--learner-metrics",
        "--out",
        str(out),
        "--quiet",
    ]
    log = tmp_path / "local.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_until("metrics.json", (out / "metrics.json").exists, proc, 120)
        index = json.loads((out / "metrics.json").read_text())
        assert set(index["learners"]) == set(LEARNERS)

        def training() -> bool:
            sync, learners = scrape_all(index)
            return sync.get("ddiloco_merges_total") > 0 and all(
                s.get("ddiloco_learner_handovers_total", learner=lid) > 0
                for lid, s in learners.items()
            )

        wait_until("every learner training and a merge", training, proc, 150)
        sync_a, learners_a = scrape_all(index)
        time.sleep(3.0)
        sync_b, learners_b = scrape_all(index)
        for name in ("ddiloco_merges_total", "ddiloco_updates_accepted_total"):
            assert sync_b.get(name) > sync_a.get(name), name
        for lid in LEARNERS:
            for name in (
                "ddiloco_learner_tokens_total",
                "ddiloco_learner_step_duration_seconds_count",
            ):
                assert learners_b[lid].get(name, learner=lid) > learners_a[lid].get(
                    name, learner=lid
                ), (lid, name)
            check_learner(learners_b[lid], lid)
        for p, v in sync_b.by("ddiloco_fragment_version", "fragment").items():
            n = sync_b.get("ddiloco_merge_duration_seconds_count", fragment=p)
            assert abs(n - v) <= 1  # a live scrape may fall inside a merge
        assert proc.wait(timeout=150) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    final = out / "metrics"
    sync_end = Scrape((final / "synchronizer.prom").read_text())
    check_synchronizer(sync_end, fragments=2)
    for lid in LEARNERS:
        end = Scrape((final / f"{lid}.prom").read_text())
        check_learner(end, lid)
        assert end.get("ddiloco_learner_tokens_total", learner=lid) >= learners_b[lid].get(
            "ddiloco_learner_tokens_total", learner=lid
        )
    report = json.loads((out / "report.json").read_text())
    assert report["metrics"] == index
    assert sync_end.get("ddiloco_merges_total") >= sync_b.get("ddiloco_merges_total")
