"""The chart's PrometheusRule through helm: off by default, its thresholds from values, and
every series its alerts read one that the code exports (or the kubelet's volume stats).

    python tests/integration/k8senv.py build          # once per machine (it builds helm)
    .venv/bin/pytest tests/integration/test_chart_alerts.py

The exported names come from the real instruments: the synchronizer's SyncMetrics (its
StatusCollector fed a Status with every optional figure set), the operator's OperatorMetrics
and a learner's LearnerMetrics, scraped through prometheus_client's exposition and parsed
back. With $PROMTOOL (or promtool on PATH) the rendered groups also go through
`promtool check rules`, and `promtool test rules` replays series through them: each alert
fires when it should, and the job beside it that must not fire does not. Without promtool
those two skip: it is not part of the k8senv build (`go install
github.com/prometheus/prometheus/cmd/promtool@latest` compiles all of Prometheus' service
discovery, over 20 minutes on two cores).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import chart_helpers as c
import pytest
import yaml
from chart_helpers import helm_fixture  # noqa: F401  (fixture)
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ddiloco.learner.metrics import LearnerMetrics
from ddiloco.operator.metrics import OperatorMetrics
from ddiloco.synchronizer.metrics import SyncMetrics
from ddiloco.wire.protocol import EvaluationStatus, FragmentStatus, LearnerStatus, Status

pytestmark = pytest.mark.integration
ON = ["--set", "monitoring.prometheusRule.enabled=true"]
ALERTS = {
    "DDiLoCoNoMerge",
    "DDiLoCoGoodputLow",
    "DDiLoCoJobDegraded",
    "DDiLoCoSynchronizerDiskFull",
    "DDiLoCoRefusalsHigh",
    "DDiLoCoLearnersCrashLooping",
}
KUBELET = {"kubelet_volume_stats_available_bytes", "kubelet_volume_stats_capacity_bytes"}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
# PromQL words that are not series: keywords, and label lists after these modifiers
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or"}
KEYWORDS |= {"unless", "bool", "offset"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def full_status() -> Status:
    """A synchronizer status with every optional figure present, so every family exports."""
    return Status(
        initialized=True,
        global_version=3,
        merges=3,
        tokens_merged=1000,
        contributions_merged=6,
        contributions_rejected=1,
        refusals={"stale": 1},
        mean_contributors=2.0,
        mean_staleness=0.1,
        bytes_up=10,
        bytes_down=20,
        goodput=0.9,
        merged_work_ratio=0.95,
        fragments=[FragmentStatus(index=0, merge="rda", version=3, contributors_pending=1)],
        learners=[
            LearnerStatus(
                learner_id="a-0", alive=True, incarnation=0, step=10, tokens_total=5120,
                step_seconds=0.1, compute_seconds=1.0, uptime_seconds=1.1, contributions=3,
                last_seen_s=0.5,
            )
        ],
        xi={"step": 0.1, "quorum": 0.2, "sync": 0.05},
        total_tokens=2000,
        progress=0.5,
        estimated_remaining_seconds=60.0,
        evaluation=EvaluationStatus(loss=2.0, perplexity=7.39, global_version=3, time=1.0),
    )  # fmt: skip


def exported_series() -> set[str]:
    """Every series name the synchronizer, the operator and a learner expose."""
    registries = [
        SyncMetrics(full_status).registry,
        OperatorMetrics().registry,
        LearnerMetrics("a-0").registry,
    ]
    names: set[str] = set()
    for registry in registries:
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            names |= {family.name + s for s in SUFFIXES.get(family.type, ("",))}
            names |= {sample.name for sample in family.samples}
    return {n for n in names if n.startswith("ddiloco_")}


def series_in(expr: str) -> set[str]:
    """The series names a PromQL expression selects (functions, keywords, label matchers,
    ranges, grouping label lists and numbers left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = GROUPING.sub("", text)
    words = re.finditer(r"(?<![\w:.])[a-zA-Z_:][a-zA-Z0-9_:]*(?=\s*(\()?)", text)
    return {m[0] for m in words if m[1] is None and m[0] not in KEYWORDS}


def the_rule(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return c.one(docs, "PrometheusRule")


def rules(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in the_rule(docs)["spec"]["groups"] for r in g["rules"]}


def test_the_expression_parser_finds_series_and_only_series() -> None:
    expr = (
        'sum by (namespace, job) (increase(a_total{x=~"b|c"}[5m])) == 0\n'
        "and on (namespace, job) max by (namespace, job) (d) > 0.5 unless e offset 1h"
    )
    assert series_in(expr) == {"a_total", "d", "e"}


@pytest.mark.parametrize(
    "args",
    [[], ["-f", str(c.CHART / "ci" / "03-production-values.yaml")], [*ON, "--set", "remoteRegion.enabled=true"]],
    ids=["defaults", "production", "remote-region"],
)  # fmt: skip
def test_no_rule_unless_enabled(helm: c.Helm, args: list[str]) -> None:
    assert not c.by_kind(helm.template(*args), "PrometheusRule")


def test_enabled_it_holds_the_alerts_with_the_default_thresholds(helm: c.Helm) -> None:
    lint = helm.run("lint", "--strict", str(c.CHART), *c.KUBE_VERSION, *ON)
    assert "0 chart(s) failed" in lint.stdout, lint.stdout
    docs = helm.template("--namespace", "ddiloco-system", *ON)
    rule = the_rule(docs)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "ddiloco-system"
    assert rule["metadata"]["labels"]["app.kubernetes.io/instance"] == "ddiloco"
    by_name = rules(docs)
    assert set(by_name) == ALERTS
    assert "[15m]" in by_name["DDiLoCoNoMerge"]["expr"]
    assert "< 0.5" in by_name["DDiLoCoGoodputLow"]["expr"]
    assert by_name["DDiLoCoGoodputLow"]["for"] == "30m"
    assert by_name["DDiLoCoJobDegraded"]["for"] == "5m"
    assert "< 0.1" in by_name["DDiLoCoSynchronizerDiskFull"]["expr"]
    assert "> 1" in by_name["DDiLoCoRefusalsHigh"]["expr"]
    assert "> 5" in by_name["DDiLoCoLearnersCrashLooping"]["expr"]
    for name, r in by_name.items():
        assert r["labels"]["severity"] in {"critical", "warning"}, name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
        assert "{{ $labels." in r["annotations"]["description"], name  # Prometheus', not helm's


def test_thresholds_and_labels_come_from_values(helm: c.Helm, tmp_path: Path) -> None:
    values = {
        "noMergeFor": "40m",
        "goodputBelow": 0.75,
        "goodputFor": "1h",
        "degradedFor": "2m",
        "diskFreeBelow": 0.2,
        "refusalsPerSecond": 0.25,
        "replacementsIn30m": 12,
        "labels": {"release": "prom"},
        "alertLabels": {"team": "ml"},
        "namespace": "monitoring",
    }
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"monitoring": {"prometheusRule": values}}))
    docs = helm.template(*ON, "-f", str(path))
    rule, by_name = the_rule(docs), rules(docs)
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "prom"
    assert "[40m]" in by_name["DDiLoCoNoMerge"]["expr"]
    assert "40m" in by_name["DDiLoCoNoMerge"]["annotations"]["summary"]
    assert "< 0.75" in by_name["DDiLoCoGoodputLow"]["expr"]
    assert by_name["DDiLoCoGoodputLow"]["for"] == "1h"
    assert by_name["DDiLoCoJobDegraded"]["for"] == "2m"
    assert "< 0.2" in by_name["DDiLoCoSynchronizerDiskFull"]["expr"]
    assert "20% free" in by_name["DDiLoCoSynchronizerDiskFull"]["annotations"]["summary"]
    assert "> 0.25" in by_name["DDiLoCoRefusalsHigh"]["expr"]
    assert "> 12" in by_name["DDiLoCoLearnersCrashLooping"]["expr"]
    assert all(r["labels"]["team"] == "ml" for r in by_name.values())


@pytest.mark.parametrize(
    ("key", "value"),
    [("noMergeFor", "soon"), ("goodputBelow", "2"), ("diskFreeBelow", "0"), ("replacementsIn30m", "-1")],
)  # fmt: skip
def test_the_schema_refuses_nonsense_thresholds(helm: c.Helm, key: str, value: str) -> None:
    args = ("template", "x", str(c.CHART), *c.KUBE_VERSION, *ON)
    bad = helm.run(*args, "--set", f"monitoring.prometheusRule.{key}={value}", check=False)
    assert bad.returncode != 0 and key in bad.stderr, bad.stderr


def test_every_series_the_alerts_read_is_exported(helm: c.Helm) -> None:
    exported = exported_series()
    assert {"ddiloco_merges_total", "ddiloco_operator_job_degraded"} <= exported  # the source
    read: dict[str, set[str]] = {
        n: series_in(r["expr"]) for n, r in rules(helm.template(*ON)).items()
    }
    for name, series in read.items():
        assert series, f"{name} reads no series"
        unknown = series - exported - KUBELET
        assert not unknown, f"{name} reads {sorted(unknown)}, which nothing exports"
    assert read["DDiLoCoSynchronizerDiskFull"] == KUBELET


def test_promtool_accepts_the_rules(helm: c.Helm, tmp_path: Path) -> None:
    promtool = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not promtool:
        pytest.skip("no promtool ($PROMTOOL or PATH); go install .../prometheus/cmd/promtool")
    spec = the_rule(helm.template(*ON, "-f", str(c.CHART / "ci" / "05-monitoring-values.yaml")))
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(spec["spec"]))
    run = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in run.stdout, run.stdout


# Series over time (promtool's expanding notation: 'a+bxn' is a, a+b, ... n more steps) and
# what each alert must say at a time, with the defaults: one job per case that must fire and,
# where the expression has a guard, one beside it that must not.
BEHAVIOUR = {
    "input_series": [
        # merges stop at 10m while 4 learners are live; "idle" never merges and has none live
        {"series": 'ddiloco_merges_total{namespace="ns",job="tiny"}', "values": "0+1x10 10x50"},
        {"series": 'ddiloco_learners_live{namespace="ns",job="tiny"}', "values": "4x60"},
        {"series": 'ddiloco_merges_total{namespace="ns",job="idle"}', "values": "0x60"},
        {"series": 'ddiloco_learners_live{namespace="ns",job="idle"}', "values": "0x60"},
        {"series": 'ddiloco_goodput{namespace="ns",job="tiny"}', "values": "0.3x60"},
        {"series": 'ddiloco_goodput{namespace="ns",job="idle"}', "values": "0.1x60"},
        {
            "series": 'ddiloco_operator_job_degraded{namespace="ns",job="tiny",'
            'reason="ClusterUnreachable"}',
            "values": "1x60",
        },
        {
            "series": 'ddiloco_operator_job_degraded{namespace="ns",job="idle",reason=""}',
            "values": "0x60",
        },
        {
            "series": 'kubelet_volume_stats_available_bytes{namespace="ns",'
            'persistentvolumeclaim="state-tiny-synchronizer-0"}',
            "values": "5x60",
        },
        {
            "series": 'kubelet_volume_stats_capacity_bytes{namespace="ns",'
            'persistentvolumeclaim="state-tiny-synchronizer-0"}',
            "values": "100x60",
        },
        {
            "series": 'kubelet_volume_stats_available_bytes{namespace="ns",persistentvolumeclaim="data"}',
            "values": "1x60",
        },
        {
            "series": 'kubelet_volume_stats_capacity_bytes{namespace="ns",persistentvolumeclaim="data"}',
            "values": "100x60",
        },
        # 2 a second refused as stale, 1 a minute as invalid
        {
            "series": 'ddiloco_refusals_total{namespace="ns",job="tiny",reason="stale"}',
            "values": "0+120x60",
        },
        {
            "series": 'ddiloco_refusals_total{namespace="ns",job="tiny",reason="invalid"}',
            "values": "0+1x60",
        },
        # a learner pod replaced every minute in "tiny", one in all in "idle"
        {
            "series": 'ddiloco_operator_replacements_total{namespace="ns",job="tiny",cause="OOMKilled"}',
            "values": "0+1x60",
        },
        {
            "series": 'ddiloco_operator_replacements_total{namespace="ns",job="idle",cause="Evicted"}',
            "values": "0 1x59",
        },
    ],
    "expect": [
        ("DDiLoCoNoMerge", "12m", []),
        ("DDiLoCoNoMerge", "30m", [{"namespace": "ns", "job": "tiny", "severity": "critical"}]),
        ("DDiLoCoGoodputLow", "20m", []),
        ("DDiLoCoGoodputLow", "35m", [{"namespace": "ns", "job": "tiny", "severity": "warning"}]),
        ("DDiLoCoJobDegraded", "3m", []),
        (
            "DDiLoCoJobDegraded",
            "6m",
            [
                {
                    "namespace": "ns",
                    "job": "tiny",
                    "reason": "ClusterUnreachable",
                    "severity": "critical",
                }
            ],
        ),
        (
            "DDiLoCoSynchronizerDiskFull",
            "6m",
            [
                {
                    "namespace": "ns",
                    "persistentvolumeclaim": "state-tiny-synchronizer-0",
                    "severity": "critical",
                }
            ],
        ),
        ("DDiLoCoRefusalsHigh", "5m", []),
        (
            "DDiLoCoRefusalsHigh",
            "25m",
            [{"namespace": "ns", "job": "tiny", "reason": "stale", "severity": "warning"}],
        ),
        (
            "DDiLoCoLearnersCrashLooping",
            "20m",
            [{"namespace": "ns", "job": "tiny", "severity": "warning"}],
        ),
    ],
}


def test_promtool_fires_each_alert_when_it_should_and_not_otherwise(
    helm: c.Helm, tmp_path: Path
) -> None:
    promtool = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not promtool:
        pytest.skip("no promtool ($PROMTOOL or PATH); go install .../prometheus/cmd/promtool")
    spec = the_rule(helm.template(*ON))["spec"]
    for group in spec["groups"]:  # promtool compares annotations too: these test the rules
        for rule in group["rules"]:
            rule.pop("annotations")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    assert {name for name, _, _ in BEHAVIOUR["expect"]} == ALERTS
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": BEHAVIOUR["input_series"],
                "alert_rule_test": [
                    {
                        "eval_time": at,
                        "alertname": name,
                        "exp_alerts": [{"exp_labels": labels} for labels in alerts],
                    }
                    for name, at, alerts in BEHAVIOUR["expect"]
                ],
            }
        ],
    }
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    run = subprocess.run(
        [promtool, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout, run.stdout
