"""Helpers for the chart's tests (tests/integration/test_chart_*.py): run helm, parse renders.

helm is the test control plane's (`python tests/integration/k8senv.py build`), found through
the `k8s_bindir` fixture; $HELM overrides it. Every helm call gets its own config, cache and
data directories, so a developer's repositories and plugins never leak into a test.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "ddiloco"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RBAC = REPO / "deploy" / "rbac"
# The k8senv helm lacks helm's Kubernetes version stamp (see charts/hack/generate.py).
KUBE_VERSION = ("--kube-version", "v1.37.2")


def load_generator() -> Any:
    """charts/hack/generate.py, loaded by path (it is a script)."""
    if "chart_generate" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "chart_generate", REPO / "charts" / "hack" / "generate.py"
        )
        assert spec is not None and spec.loader is not None
        sys.modules["chart_generate"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["chart_generate"])
    return sys.modules["chart_generate"]


@dataclass(frozen=True)
class Helm:
    binary: Path
    home: Path

    def run(
        self, *args: str, check: bool = True, timeout: float = 120.0, **env: str
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.binary), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={
                **os.environ,
                "HELM_CONFIG_HOME": str(self.home / "config"),
                "HELM_CACHE_HOME": str(self.home / "cache"),
                "HELM_DATA_HOME": str(self.home / "data"),
                **env,
            },
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
        return proc

    def template(self, *args: str, release: str = "ddiloco") -> list[dict[str, Any]]:
        """Render the chart; the documents, without empty ones."""
        out = self.run("template", release, str(CHART), *KUBE_VERSION, *args).stdout
        return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="session", name="helm")
def helm_fixture(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """$HELM, else the k8senv build's helm (skips, or fails in CI, when it is not built)."""
    explicit = os.environ.get("HELM")
    binary = Path(explicit or request.getfixturevalue("k8s_bindir") / "helm")
    assert binary.is_file(), f"no helm at {binary}"
    return Helm(binary, tmp_path_factory.mktemp("helm"))


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def rule_triples(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """RBAC rules as (apiGroup, resource, verb) triples, to compare rule sets however grouped."""
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule.get("verbs", [])
    }


def documented_rules(file: str, kind: str) -> set[tuple[str, str, str]]:
    docs = [d for d in yaml.safe_load_all((RBAC / file).read_text()) if d]
    return rule_triples(one(docs, kind)["rules"])


def token_kubeconfig(cluster: Any, token: str, namespace: str) -> str:
    """A kubeconfig that authenticates with a ServiceAccount token (the CA inlined)."""
    ca = base64.b64encode(Path(cluster.ca_file).read_bytes()).decode()
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": cluster.name,
                    "cluster": {"server": cluster.server, "certificate-authority-data": ca},
                }
            ],
            "users": [{"name": "sa", "user": {"token": token}}],
            "contexts": [
                {
                    "name": "sa",
                    "context": {"cluster": cluster.name, "user": "sa", "namespace": namespace},
                }
            ],
            "current-context": "sa",
        }
    )


def notes_block(notes: str, name: str) -> str:
    """The shell lines between '# --- <name> (begin)' and '# --- <name> (end)' in NOTES."""
    begin, end = f"# --- {name} (begin)", f"# --- {name} (end)"
    assert begin in notes and end in notes, f"NOTES lost its {name!r} block:\n{notes}"
    return notes.split(begin, 1)[1].split(end, 1)[0]


# --------------------------------------------------------------------------- the dashboard

DASHBOARD = CHART / "dashboards" / "ddiloco.json"
_PROMQL_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_PROMQL_BRACES = re.compile(r"\{[^{}]*\}")
_PROMQL_RANGE = re.compile(r"\[[^\[\]]*\]")
_PROMQL_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_PROMQL_IDENT = re.compile(r"(?<![\w:$.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
PROMQL_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless"}
    | {"bool", "offset", "inf", "nan"}
)


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads, as written (`x_bucket` stays `x_bucket`):
    identifiers that are not functions or aggregations (followed by "("), keywords, label
    names (inside {...} or a by/without/on/ignoring list), strings or durations."""
    text = _PROMQL_STRING.sub('""', expr)
    text = _PROMQL_BRACES.sub(" ", text)
    text = _PROMQL_RANGE.sub(" ", text)
    text = _PROMQL_GROUPING.sub(" ", text)
    return {
        m[1]
        for m in _PROMQL_IDENT.finditer(text)
        if not m[2] and m[1].lower() not in PROMQL_KEYWORDS
    }


def dashboard_exprs(dashboard: dict[str, Any] | None = None) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets (rows' nested panels too) and
    query variables."""
    dash = dashboard if dashboard is not None else json.loads(DASHBOARD.read_text())
    out: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            out.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(dash.get("panels", []))
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        if var.get("type") == "query" and query:
            inner = re.fullmatch(r"\s*label_values\((.*),\s*\w+\)\s*", query)
            out.append(inner[1] if inner else query)
    return out


def dashboard_metric_names() -> set[str]:
    return {name for expr in dashboard_exprs() for name in promql_metric_names(expr)}


def exported_names(exposition: str) -> set[str]:
    """Every name a Prometheus text exposition lets a query use: its samples' names and, for
    families without samples yet, the names their type implies (x_total, x_bucket ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("_sum", "_count"),
        "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    }
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.add(family.name)
        names.update(family.name + s for s in suffixes.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names
