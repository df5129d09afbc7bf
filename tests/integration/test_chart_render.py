"""The chart through helm itself: lint and template for the defaults and every ci/ value set,
the strict schema refusing typos, RBAC equal to deploy/rbac/, deploy/manifests/ fresh.

    python tests/integration/k8senv.py build          # once per machine (it builds helm)
    .venv/bin/pytest tests/integration/test_chart_render.py

No apiserver is started here; test_chart_install.py installs the chart into one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import chart_helpers as c
import pytest
import yaml
from chart_helpers import helm_fixture  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration
SCENARIOS = [None, *c.CI_VALUES]


def scenario_args(values: Path | None) -> list[str]:
    return [] if values is None else ["-f", str(values)]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return c.one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("values", SCENARIOS, ids=lambda v: "defaults" if v is None else v.name)
def test_lint_and_template_pass(helm: c.Helm, values: Path | None) -> None:
    lint = helm.run("lint", "--strict", str(c.CHART), *c.KUBE_VERSION, *scenario_args(values))
    assert "1 chart(s) linted, 0 chart(s) failed" in lint.stdout, lint.stdout
    docs = helm.template(*scenario_args(values))
    assert docs, "nothing rendered"
    for doc in docs:
        assert doc["metadata"]["name"], doc
        labels = doc["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/instance") == "ddiloco", doc["metadata"]


def test_defaults_run_one_operator_for_all_namespaces(helm: c.Helm) -> None:
    docs = helm.template("--namespace", "ddiloco-system")
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        ["ServiceAccount", "ClusterRole", "ClusterRole", "ClusterRoleBinding",
         "ClusterRoleBinding", "Service", "Deployment", "Pod"]
    )  # fmt: skip
    deploy = c.one(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    ctr = container(docs)
    assert ctr["command"] == ["ddiloco", "operator"]
    assert ctr["args"] == ["--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]
    assert ctr["image"] == "ddiloco:0.1.0"  # what deploy/build-image.sh tags locally
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert ctr[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    assert ctr["ports"] == [
        {"name": "health", "containerPort": 8080, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 8081, "protocol": "TCP"},
    ]
    assert ctr["securityContext"]["readOnlyRootFilesystem"] is True
    pod = deploy["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["serviceAccountName"] == c.one(docs, "ServiceAccount")["metadata"]["name"]
    test = c.one(docs, "Pod")
    assert test["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert test["spec"]["containers"][0]["command"][-1] == (
        "http://ddiloco-operator.ddiloco-system.svc:8080/healthz"
    )


def test_rbac_is_exactly_deploy_rbac(helm: c.Helm) -> None:
    documented = c.documented_rules("operator.yaml", "ClusterRole")
    scan = {("", "namespaces", "list"), ("", "namespaces", "watch")}
    namespaced = helm.template("-f", str(c.CHART / "ci" / "01-namespaced-values.yaml"))
    roles = c.by_kind(namespaced, "ClusterRole")
    assert c.rule_triples([r for role in roles for r in role["rules"]]) == documented
    cluster = next(r for r in roles if r["metadata"]["name"].endswith("-cluster"))
    assert c.rule_triples(cluster["rules"]) == scan | {
        ("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("get", "list", "watch")
    } | {
        ("kueue.x-k8s.io", kind, "get") for kind in ("resourceflavors", "workloadpriorityclasses")
    }, (
        "the only cluster-scoped needs: reading CRDs and Kueue's cluster objects, scanning namespaces"
    )
    # Watching every namespace, kopf scans none: that right is left out.
    roles = c.by_kind(helm.template(), "ClusterRole")
    assert c.rule_triples([r for role in roles for r in role["rules"]]) == documented - scan
    remote = helm.template("--set", "remoteRegion.enabled=true")
    assert c.rule_triples(c.one(remote, "Role")["rules"]) == c.documented_rules(
        "remote-learners.yaml", "Role"
    )


def test_watched_namespaces_get_role_bindings_not_cluster_wide_rights(helm: c.Helm) -> None:
    docs = helm.template("-f", str(c.CHART / "ci" / "01-namespaced-values.yaml"))
    bindings = c.by_kind(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert all(b["roleRef"]["name"] == "ddiloco-operator" for b in bindings)
    cluster_wide = [b["roleRef"]["name"] for b in c.by_kind(docs, "ClusterRoleBinding")]
    assert cluster_wide == ["ddiloco-operator-cluster"]
    args = container(docs)["args"]
    assert args[:2] == ["--namespace=team-a", "--namespace=team-b"]
    assert "--all-namespaces" not in args
    env = {e["name"]: e["value"] for e in container(docs)["env"]}
    assert env["DDILOCO_OPERATOR_RESYNC_SECONDS"] == "0.5"
    assert env["DDILOCO_OPERATOR_STATUS_POLL_SECONDS"] == "5"


def test_remote_region_installs_only_the_identity(helm: c.Helm) -> None:
    docs = helm.template("-f", str(c.CHART / "ci" / "02-remote-region-values.yaml"))
    assert sorted(d["kind"] for d in docs) == ["Role", "RoleBinding", "Secret", "ServiceAccount"]
    for doc in docs:
        assert "namespace" not in doc["metadata"], "plain render must apply to any namespace"
    secret = c.one(docs, "Secret")
    assert secret["type"] == "kubernetes.io/service-account-token"
    sa = c.one(docs, "ServiceAccount")["metadata"]["name"]
    assert sa == "ddiloco-remote"
    assert secret["metadata"]["annotations"]["kubernetes.io/service-account.name"] == sa
    assert c.one(docs, "RoleBinding")["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
    no_token = helm.template("--set", "remoteRegion.enabled=true,remoteRegion.tokenSecret=false")
    assert not c.by_kind(no_token, "Secret")


def test_production_values_reach_the_pod(helm: c.Helm) -> None:
    docs = helm.template("-f", str(c.CHART / "ci" / "03-production-values.yaml"))
    ctr = container(docs)
    assert ctr["image"].endswith("@sha256:" + "0123456789abcdef" * 4)
    assert "--liveness=http://0.0.0.0:9090/healthz" in ctr["args"]
    assert c.one(docs, "Service")["spec"]["ports"][0]["port"] == 9090
    assert c.one(docs, "Namespace")["metadata"]["name"] == "default"
    pod = c.one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "diloco-controller"
    assert pod["nodeSelector"] == {"pool": "system"}
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    test_pod = c.one(docs, "Pod")["spec"]
    assert test_pod["containers"][0]["command"][-2:] == [
        "http://diloco-operator.default.svc:9090/healthz",
        "https://tiny-cpu-synchronizer.default.svc:8470/healthz",
    ]
    # the https synchronizer is verified against the job's CA, from its trust Secret
    assert test_pod["volumes"][0]["secret"]["secretName"] == "tiny-cpu-trust"
    mount = test_pod["containers"][0]["volumeMounts"][0]
    assert mount["mountPath"] == "/etc/ddiloco/trust" and mount["readOnly"]


def test_bring_your_own_rbac_renders_none(helm: c.Helm) -> None:
    docs = helm.template("-f", str(c.CHART / "ci" / "04-bring-your-own-rbac-values.yaml"))
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "RoleBinding"}
    pod = c.one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ddiloco-operator"


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--set", "operator.resyncSecond=3"], "resyncSecond"),
        (["--set", "remoteRegion.enable=true"], "enable"),
        (["--set", "imag.tag=x"], "imag"),
        (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
        (["--set", "operator.watchNamespaces[0]=Team_A"], "watchNamespaces"),
        (["--set", "operator.resyncSeconds=0"], "resyncSeconds"),
    ],
)
def test_schema_refuses_typos_and_nonsense(helm: c.Helm, args: list[str], complaint: str) -> None:
    proc = helm.run("template", "x", str(c.CHART), *c.KUBE_VERSION, *args, check=False)
    assert proc.returncode != 0, f"helm accepted {args}"
    assert "schema" in proc.stderr and complaint in proc.stderr, proc.stderr
    lint = helm.run("lint", str(c.CHART), *c.KUBE_VERSION, *args, check=False)
    assert lint.returncode != 0, f"helm lint accepted {args}"


def test_a_misspelt_key_in_a_values_file_is_refused(helm: c.Helm, tmp_path: Path) -> None:
    values = tmp_path / "typo.yaml"
    values.write_text(yaml.safe_dump({"operator": {"watchNamespace": ["team-a"]}}))
    proc = helm.run("template", "x", str(c.CHART), *c.KUBE_VERSION, "-f", str(values), check=False)
    assert proc.returncode != 0 and "watchNamespace" in proc.stderr, proc.stderr


def test_deploy_manifests_equal_a_fresh_render(helm: c.Helm) -> None:
    gen = c.load_generator()
    rendered = gen.render_manifests(str(helm.binary))
    assert {p.name for p in rendered} == {"ddiloco.yaml", "remote-region.yaml"}
    for path, text in rendered.items():
        assert path.is_file(), f"{path} missing: run python charts/hack/generate.py"
        assert path.read_text() == text, f"{path} is stale: run python charts/hack/generate.py"
    home = [d for d in yaml.safe_load_all(rendered[gen.MANIFESTS / "ddiloco.yaml"]) if d]
    assert [d["kind"] for d in home[:2]] == ["CustomResourceDefinition", "Namespace"]
    assert not c.by_kind(home, "Pod"), "no helm test pod in plain manifests"


@pytest.mark.parametrize(
    ("release", "name"),
    [
        ("ddiloco-remote", "ddiloco-remote"),  # the READMEs' release: no "-remote-remote"
        ("ddiloco", "ddiloco-remote"),
        ("region-a", "region-a-ddiloco-remote"),
        ("eu-west-remote", "eu-west-remote-ddiloco-remote"),
    ],
)
def test_remote_region_names_follow_the_release(helm: c.Helm, release: str, name: str) -> None:
    docs = helm.template("--set", "remoteRegion.enabled=true", release=release)
    assert c.one(docs, "ServiceAccount")["metadata"]["name"] == name
    assert c.one(docs, "Secret")["metadata"]["name"] == f"{name}-token"
    assert c.one(docs, "Role")["metadata"]["name"] == name
