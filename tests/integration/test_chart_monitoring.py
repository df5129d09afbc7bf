"""The chart's monitoring objects through helm: off by default, and when on, ServiceMonitors,
a PodMonitor and the Grafana dashboard ConfigMap that select what the operator really makes.

    python tests/integration/k8senv.py build          # once per machine (it builds helm)
    .venv/bin/pytest tests/integration/test_chart_monitoring.py

The test apiservers have no Prometheus Operator CRDs and no schema of them is at hand, so the
monitoring objects are rendered only: their selectors are checked against the labels that
operator/builders.py puts on the synchronizer Services and learner pods, and their ports
against the ports those objects (and the chart's operator) name.
"""

from __future__ import annotations

import json
from typing import Any

import chart_helpers as c
import pytest
from chart_helpers import helm_fixture  # noqa: F401  (fixture)

from ddiloco.operator import builders, sync_workload
from ddiloco.operator.api import DecoupledDiLoCoJob

pytestmark = pytest.mark.integration
ALL_ON = [
    "--set",
    "monitoring.serviceMonitor.enabled=true",
    "--set",
    "monitoring.podMonitor.enabled=true",
    "--set",
    "monitoring.dashboard.enabled=true",
]
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "ConfigMap"}
DASHBOARD = c.CHART / "dashboards" / "ddiloco.json"


def a_job() -> DecoupledDiLoCoJob:
    return DecoupledDiLoCoJob.from_body(
        {
            "metadata": {"name": "tiny", "namespace": "team-a", "uid": "u-1", "generation": 1},
            "spec": {
                "image": "ddiloco:dev",
                "training": {"model": "tiny"},
                "learnerGroups": [{"name": "a", "replicas": 1}],
            },
        }
    )


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def named(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    found = [d for d in c.by_kind(docs, kind) if d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, [d["metadata"]["name"] for d in c.by_kind(docs, kind)]
    return found[0]


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--set", "remoteRegion.enabled=true"],
        ["-f", str(c.CHART / "ci" / "03-production-values.yaml")],
    ],
    ids=["defaults", "remote", "production"],
)
def test_monitoring_is_off_by_default(helm: c.Helm, args: list[str]) -> None:
    kinds = {d["kind"] for d in helm.template(*args)}
    assert not kinds & MONITORING_KINDS, kinds


def test_all_on_selects_what_the_operator_makes(helm: c.Helm) -> None:
    lint = helm.run("lint", "--strict", str(c.CHART), *c.KUBE_VERSION, *ALL_ON)
    assert "0 chart(s) failed" in lint.stdout, lint.stdout
    docs = helm.template("--namespace", "ddiloco-system", *ALL_ON)
    assert sorted(d["kind"] for d in docs if d["kind"] in MONITORING_KINDS) == [
        "ConfigMap",
        "PodMonitor",
        "ServiceMonitor",
        "ServiceMonitor",
    ]
    for doc in docs:  # every object says it is this release's
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "ddiloco"

    # the operator: its Service and container name the port the ServiceMonitor scrapes
    sm = named(docs, "ServiceMonitor", "-operator")
    service, deploy = c.one(docs, "Service"), c.one(docs, "Deployment")
    assert sm["metadata"]["namespace"] == "ddiloco-system"
    assert selects(sm["spec"]["selector"], service["metadata"]["labels"])
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["ddiloco-system"]}
    [endpoint] = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True  # the series' own namespace and job labels win
    assert endpoint["interval"] == "30s"
    port = next(p for p in service["spec"]["ports"] if p["name"] == "metrics")
    ctr = deploy["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in ctr["ports"]
    assert port == {"name": "metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}
    assert {"name": "DDILOCO_OPERATOR_METRICS_PORT", "value": "8081"} in ctr["env"]

    # the synchronizers: the Service every job gets (builders.py), any namespace
    job = a_job()
    sync_service = sync_workload.build_synchronizer_service(job)
    sm = named(docs, "ServiceMonitor", "-synchronizers")
    assert selects(sm["spec"]["selector"], sync_service["metadata"]["labels"])
    assert sm["spec"]["namespaceSelector"] == {"any": True}
    assert sm["spec"]["jobLabel"] == builders.LABEL_JOB  # job = the DecoupledDiLoCoJob's name
    assert sync_service["metadata"]["labels"][builders.LABEL_JOB] == "tiny"
    [endpoint] = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in sync_service["spec"]["ports"]}
    assert (endpoint["scheme"], endpoint["tlsConfig"]) == ("https", {"insecureSkipVerify": True})
    for other in ("token", "tls"):  # no other Service-like object of a job matches
        assert not selects(sm["spec"]["selector"], builders.labels(job, other))

    # the learners: their pods and the port H1's learner metrics listen on
    pod = builders.build_learner_pod(job, job.spec.learner_groups[0], 0, "team-a")
    pm = c.one(docs, "PodMonitor")
    assert selects(pm["spec"]["selector"], pod["metadata"]["labels"])
    assert not selects(pm["spec"]["selector"], sync_service["metadata"]["labels"])
    assert pm["spec"]["jobLabel"] == builders.LABEL_JOB
    [endpoint] = pm["spec"]["podMetricsEndpoints"]
    ports = {p["name"] for ctr in pod["spec"]["containers"] for p in ctr.get("ports", [])}
    assert endpoint["port"] == "metrics" and endpoint["port"] in ports, ports

    # the dashboard: the chart's JSON, verbatim, for Grafana's sidecar
    cm = c.one(docs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["ddiloco.json"]) == json.loads(DASHBOARD.read_text())


def test_knobs_reach_the_objects(helm: c.Helm) -> None:
    docs = helm.template(
        "--namespace",
        "ddiloco-system",
        *ALL_ON,
        "--set",
        "operator.watchNamespaces={team-a,team-b}",
        "--set",
        "monitoring.serviceMonitor.labels.release=prom",
        "--set",
        "monitoring.serviceMonitor.interval=",
        "--set",
        "monitoring.serviceMonitor.scrapeTimeout=10s",
        "--set",
        "monitoring.serviceMonitor.namespace=monitoring",
        "--set",
        "monitoring.serviceMonitor.synchronizer.scheme=http",
        "--set",
        "monitoring.podMonitor.interval=15s",
        "--set",
        "monitoring.dashboard.namespace=grafana",
        "--set",
        "monitoring.dashboard.annotations.grafana_folder=Training",
    )
    watched = {"matchNames": ["team-a", "team-b"]}
    for sm in c.by_kind(docs, "ServiceMonitor"):
        assert sm["metadata"]["namespace"] == "monitoring"
        assert sm["metadata"]["labels"]["release"] == "prom"
        [endpoint] = sm["spec"]["endpoints"]
        assert "interval" not in endpoint and endpoint["scrapeTimeout"] == "10s"
    sync = named(docs, "ServiceMonitor", "-synchronizers")
    assert sync["spec"]["namespaceSelector"] == watched
    assert sync["spec"]["endpoints"][0]["scheme"] == "http"
    assert "tlsConfig" not in sync["spec"]["endpoints"][0]
    pm = c.one(docs, "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == watched
    assert pm["spec"]["podMetricsEndpoints"][0]["interval"] == "15s"
    assert "release" not in pm["metadata"]["labels"]  # each monitor has its own labels knob
    cm = c.one(docs, "ConfigMap")
    assert cm["metadata"]["namespace"] == "grafana"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Training"}


def test_metrics_port_zero_turns_the_endpoint_and_its_monitor_off(helm: c.Helm) -> None:
    docs = helm.template(*ALL_ON, "--set", "operator.metricsPort=0")
    ctr = c.one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in ctr["ports"]] == ["health"]
    assert [p["name"] for p in c.one(docs, "Service")["spec"]["ports"]] == ["health"]
    assert {"name": "DDILOCO_OPERATOR_METRICS_PORT", "value": "0"} in ctr["env"]
    assert [d["metadata"]["name"] for d in c.by_kind(docs, "ServiceMonitor")] == [
        "ddiloco-synchronizers"
    ]
    bad = helm.run(
        "template",
        "x",
        str(c.CHART),
        *c.KUBE_VERSION,
        "--set",
        "operator.metricsPort=80",
        check=False,
    )
    assert bad.returncode != 0 and "metricsPort" in bad.stderr


def test_remote_region_gets_only_the_learners_pod_monitor(helm: c.Helm) -> None:
    docs = helm.template("--namespace", "team-a", "--set", "remoteRegion.enabled=true", *ALL_ON)
    assert {d["kind"] for d in docs} & MONITORING_KINDS == {"PodMonitor"}
    pm = c.one(docs, "PodMonitor")
    assert pm["metadata"]["namespace"] == "team-a"
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
