"""The chart's Grafana dashboard (charts/ddiloco/dashboards/ddiloco.json) asks only for what
real processes export: every metric name in every PromQL expression is found in a scrape of
the synchronizer or a learner of a real `ddiloco local --learner-metrics` run; the operator's
names are checked against a real operator in tests/integration/test_operator_metrics.py.

    .venv/bin/pytest tests/e2e/test_dashboard.py

The names come from the expressions themselves (chart_helpers.promql_metric_names: functions,
label matchers, grouping lists and durations stripped), not from a list kept beside them.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddiloco.operator.metrics import OperatorMetrics

REPO = Path(__file__).resolve().parents[2]


def _chart_helpers() -> Any:
    """tests/integration/chart_helpers.py (the dashboard parsing lives with the chart's
    helpers), loaded by path as that folder's conftest does."""
    if "chart_helpers" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "chart_helpers", REPO / "tests" / "integration" / "chart_helpers.py"
        )
        assert spec is not None and spec.loader is not None
        sys.modules["chart_helpers"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["chart_helpers"])
    return sys.modules["chart_helpers"]


c = _chart_helpers()


def test_promql_names_are_extracted_from_expressions() -> None:
    names = c.promql_metric_names
    assert names('rate(a_total{job=~"$job", x="b(c)"}[$__rate_interval])') == {"a_total"}
    assert names("histogram_quantile(0.95, sum by (le, learner) (rate(h_bucket[5m])))") == {
        "h_bucket"
    }
    assert names(
        "sum by (learner) (rate(t_total[1m])) / ignoring(learner) group_left sum(rate(u_total[1m]))"
    ) == {"t_total", "u_total"}
    assert names("sum without (pod) (g) > bool 0.5 and on(job) up offset 5m") == {"g", "up"}
    assert names("x:recorded:rate5m * 2e3 unless count(y)") == {"x:recorded:rate5m", "y"}


def test_the_dashboard_is_a_grafana_dashboard_with_its_variables() -> None:
    dash = json.loads(c.DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 39 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "job"} <= variables.keys()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            # every series is of the chosen jobs: each selector filters namespace and job
            expr = target["expr"]
            assert expr.count('namespace=~"$namespace"') == expr.count("{"), expr
            assert expr.count('job=~"$job"') == expr.count("{"), expr
    used = c.dashboard_metric_names()
    # what the issue asks the dashboard to show, by the series that show it
    for wanted in (
        "ddiloco_goodput",
        "ddiloco_merged_work_ratio",
        "ddiloco_learner_tokens_merged_total",  # participation per learner
        "ddiloco_merge_duration_seconds_bucket",  # merge latency
        "ddiloco_update_staleness_bucket",
        "ddiloco_bytes_received_total",  # bandwidth in and out
        "ddiloco_bytes_served_total",
        "ddiloco_learner_loss",
        "ddiloco_eval_loss",  # the global model's, from the evaluator
        "ddiloco_operator_replacements_total",
    ):
        assert wanted in used, wanted


def test_the_operator_names_are_the_operators() -> None:
    """In-process (the real operator's scrape is the integration test's): a misspelt
    operator name fails here too, without a control plane."""
    exported = c.exported_names(_text(OperatorMetrics()))
    wanted = {n for n in c.dashboard_metric_names() if n.startswith("ddiloco_operator_")}
    assert wanted and wanted <= exported, wanted - exported


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_dashboard_metric_is_exported_by_a_real_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "ddiloco.cli.main",
        "local",
        "--learners",
        "2",
        "--max-seconds",
        "8",
        "--seed",
        "3",
        "--learner-metrics",
        "--out",
        str(out),
        "--quiet",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # the launcher's scrapes of the live processes (local/scrapes.py): each learner's last
    # one before it stopped them, the synchronizer's after their last updates merged
    scrapes = {p.stem: p.read_text() for p in (out / "metrics").glob("*.prom")}
    assert "synchronizer" in scrapes and len(scrapes) == 3, sorted(scrapes)
    exported: dict[str, set[str]] = {k: c.exported_names(v) for k, v in scrapes.items()}
    everything = set().union(*exported.values())
    wanted = {n for n in c.dashboard_metric_names() if not n.startswith("ddiloco_operator_")}
    missing = wanted - everything
    assert not missing, f"the dashboard asks for series nobody exports: {sorted(missing)}"
    # and the learners' series come from the learners, each labelled with its id
    learner_only = {n for n in wanted if n.startswith("ddiloco_learner_")} - exported[
        "synchronizer"
    ]
    for lid in set(scrapes) - {"synchronizer"}:
        assert learner_only <= exported[lid], learner_only - exported[lid]
        assert f'learner="{lid}"' in scrapes[lid]
    print(f"dashboard: {len(wanted)} names found in {sorted(scrapes)}")


def _text(metrics: OperatorMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()
