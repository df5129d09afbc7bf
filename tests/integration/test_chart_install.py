"""The chart installed into the test control plane, and the operator running as the chart's
ServiceAccount, across two clusters.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_chart_install.py

1. `helm install --wait` succeeds (kwok runs the operator pod), the examples validate against
   the installed CRD, and `helm test` creates its pod, which this test plays the kubelet for.
2. Home cluster: the chart with operator.watchNamespaces; region-a: the chart in remote-region
   mode, its kubeconfig Secret made by running the commands its NOTES print. The operator runs
   with the home ServiceAccount's token (nothing more than the chart grants) and reconciles the
   CPU demo plus a learner group in region-a end to end; both identities are refused what the
   chart does not grant them.
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import chart_helpers as c
import k8senv
import operator_helpers as h
import pytest
import yaml
from chart_helpers import helm_fixture  # noqa: F401  (fixture)
from operator_helpers import cl_fixture, crd_fixture  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration
EXAMPLES = c.REPO / "deploy" / "examples"


def release_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:5]}"


def helm_in(helm: c.Helm, k8s: Any, cluster: str, *args: str, **kw: Any) -> Any:
    return helm.run(*args, "--kubeconfig", str(k8s.clusters[cluster].kubeconfig), **kw)


def forbidden(kubeconfig: Path, *args: str) -> bool:
    """True when the apiserver refuses the request with 403 for this identity."""
    proc = subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return proc.returncode != 0 and "forbidden" in proc.stderr.lower()


def allowed(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stderr}"
    return proc


def test_helm_install_and_helm_test(
    k8s: Any, k8s_namespace: str, helm: c.Helm, crd_installed: None
) -> None:
    ns, rel = k8s_namespace, release_name("inst")
    operator = f"{rel}-ddiloco-operator"
    try:
        helm_in(
            helm, k8s, "home", "install", rel, str(c.CHART), "-n", ns, "--set",
            f"operator.watchNamespaces={{{ns}}}", "--wait", "--timeout", "120s",
            timeout=180,
        )  # fmt: skip
        status = helm_in(helm, k8s, "home", "status", rel, "-n", ns).stdout
        assert "STATUS: deployed" in status, status
        notes = helm_in(helm, k8s, "home", "get", "notes", rel, "-n", ns).stdout
        assert f"kubectl -n {ns} rollout status deployment/{operator}" in notes
        assert f"the namespaces {ns}" in notes
        deploy = k8s.kubectl("home", "-n", ns, "get", "deployment", operator, "-o", "json")
        assert yaml.safe_load(deploy.stdout)["status"]["availableReplicas"] == 1
        assert k8s.kubectl("home", "get", "rolebinding", "-n", ns, operator).returncode == 0

        # Every example job is valid for the installed CRD (schema and CEL rules).
        for example in sorted(EXAMPLES.glob("*.yaml")):
            k8s.kubectl("home", "-n", ns, "apply", "--dry-run=server", "-f", str(example))

        # helm test: its pod is created; we play the kubelet and let it succeed.
        test_pod = f"{rel}-ddiloco-test-health"
        runner = subprocess.Popen(
            [str(helm.binary), "test", rel, "-n", ns, "--timeout", "90s",
             "--kubeconfig", str(k8s.home.kubeconfig)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "HELM_CONFIG_HOME": str(helm.home / "config"),
                 "HELM_CACHE_HOME": str(helm.home / "cache"),
                 "HELM_DATA_HOME": str(helm.home / "data")},
        )  # fmt: skip
        try:

            def running() -> dict[str, Any] | None:
                out = k8s.kubectl("home", "-n", ns, "get", "pod", test_pod, "-o", "json")
                pod: dict[str, Any] = yaml.safe_load(out.stdout)
                return pod if pod["status"].get("phase") == "Running" else None

            pod = k8senv.wait_until("the helm test pod Running", running, timeout=60)
            command = pod["spec"]["containers"][0]["command"]
            assert command[-1] == f"http://{operator}.{ns}.svc:8080/healthz"
            assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
            k8s.kubectl(
                "home", "-n", ns, "patch", "pod", test_pod, "--subresource=status",
                "--type=merge", "-p", '{"status": {"phase": "Succeeded"}}',
            )  # fmt: skip
            out, _ = runner.communicate(timeout=90)
        finally:
            if runner.poll() is None:
                runner.kill()
                runner.wait()
        assert runner.returncode == 0, out
        assert f"TEST SUITE:     {rel}" in out and "Phase:          Succeeded" in out, out
    finally:
        helm_in(helm, k8s, "home", "uninstall", rel, "-n", ns, "--wait", check=False)
    gone = k8s.kubectl("home", "get", "clusterrole", operator, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr, "uninstall left the ClusterRole"


def test_operator_with_the_charts_rbac_runs_a_job_across_regions(
    k8s: Any, cl: h.Clusters, helm: c.Helm, tmp_path: Path
) -> None:
    ns = cl.ns
    home_rel, remote_rel = release_name("home"), release_name("region")
    operator_sa = f"{home_rel}-ddiloco-operator"
    remote_sa = f"{remote_rel}-ddiloco-remote"
    unrelated = f"t-unrelated-{uuid.uuid4().hex[:6]}"
    op: h.Operator | None = None
    try:
        helm_in(
            helm, k8s, "home", "install", home_rel, str(c.CHART), "-n", ns,
            "--set", f"operator.watchNamespaces={{{ns}}}",
        )  # fmt: skip
        helm_in(
            helm, k8s, "region-a", "install", remote_rel, str(c.CHART), "-n", ns,
            "--skip-crds", "--set", "remoteRegion.enabled=true",
        )  # fmt: skip
        remote_kinds = helm_in(helm, k8s, "region-a", "get", "manifest", remote_rel, "-n", ns)
        kinds = sorted(d["kind"] for d in yaml.safe_load_all(remote_kinds.stdout) if d)
        assert kinds == ["Role", "RoleBinding", "Secret", "ServiceAccount"]

        # The kubeconfig Secret, made exactly as the remote release's NOTES say.
        k8senv.wait_until(
            "the remote token Secret filled in",
            lambda: (
                k8s.kubectl(
                    "region-a",
                    "-n",
                    ns,
                    "get",
                    "secret",
                    f"{remote_sa}-token",
                    "-o",
                    "jsonpath={.data.token}",
                ).stdout
            ),
            timeout=30,
        )
        notes = helm_in(helm, k8s, "region-a", "get", "notes", remote_rel, "-n", ns).stdout
        script = c.notes_block(notes, "kubeconfig Secret")
        merged = f"{k8s.home.kubeconfig}{os.pathsep}{k8s.clusters['region-a'].kubeconfig}"
        run = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "KUBECONFIG": merged, "REGION_CONTEXT": "region-a",
                 "HOME_CONTEXT": "home", "SECRET": "region-a-kubeconfig"},
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        remote_cfg = tmp_path / "region-a.kubeconfig"
        secret = yaml.safe_load(
            k8s.kubectl(
                "home", "-n", ns, "get", "secret", "region-a-kubeconfig", "-o", "json"
            ).stdout
        )
        remote_cfg.write_bytes(base64.b64decode(secret["data"]["kubeconfig"]))
        assert yaml.safe_load(remote_cfg.read_text())["users"][0]["name"] == remote_sa

        # The operator, as the chart's ServiceAccount and nothing else.
        token = k8s.kubectl("home", "-n", ns, "create", "token", operator_sa).stdout.strip()
        home_cfg = tmp_path / "operator.kubeconfig"
        home_cfg.write_text(c.token_kubeconfig(k8s.home, token, ns))
        home_cfg.chmod(0o600)
        op = h.Operator(home_cfg, ns, tmp_path)
        op.start()

        body = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
        body["spec"]["synchronizer"]["storage"]["storageClassName"] = ""  # the test's PV
        body["spec"]["learnerGroups"].append(h.remote("region-a", 1))
        job = h.create_job(cl, body)
        h.wait_condition(cl, job, "Ready", timeout=90)
        slots = h.running_uids(cl, ["home", "region-a"], job)
        assert sorted(slots) == ["cpu-0", "cpu-1", "region-a-0"], slots
        assert len(cl.pods("region-a", job)) == 1
        # the region holds its learners' own credentials, never the job key
        assert f"{job}-token" not in h.job_secret_names(cl, "region-a", job)
        for pod in cl.pods("region-a", job):
            h.check_own_credential(cl, "region-a", job, pod)

        # What the chart did not grant is refused. First, that the identities work at all:
        allowed(home_cfg, "-n", ns, "get", "secret", "region-a-kubeconfig")
        allowed(remote_cfg, "-n", ns, "get", "pods")
        k8s.kubectl("home", "create", "namespace", unrelated)
        k8s.kubectl("home", "-n", unrelated, "create", "secret", "generic", "private",
                    "--from-literal=password=hunter2")  # fmt: skip
        refused = {
            "Secrets in an unrelated namespace": ("-n", unrelated, "get", "secret", "private"),
            "listing Secrets, even its own": ("-n", ns, "get", "secrets"),
            "nodes": ("get", "nodes"),
            # (listing and watching namespaces is granted: kopf's scan of its namespace list)
            "creating namespaces": ("create", "namespace", "x", "--dry-run=server"),
            "deleting namespaces": ("delete", "namespace", unrelated, "--dry-run=server"),
            "persistent volumes": ("get", "persistentvolumes"),
            "creating ClusterRoles": ("create", "clusterrole", "x", "--verb=get",
                                      "--resource=pods", "--dry-run=server"),
            "deleting the CRD": ("delete", "crd", f"{h.PLURAL}.{h.GROUP}", "--dry-run=server"),
            "pods elsewhere": ("-n", unrelated, "get", "pods"),
        }  # fmt: skip
        for what, args in refused.items():
            assert forbidden(home_cfg, *args), f"the operator may touch {what}"
        for what, args in {
            "pods in another namespace": ("-n", "default", "get", "pods"),
            "nodes": ("get", "nodes"),
            "Deployments": ("-n", ns, "get", "deployments"),
            "ConfigMaps": ("-n", ns, "get", "configmaps"),
        }.items():
            assert forbidden(remote_cfg, *args), f"the region identity may touch {what}"

        h.delete_jobs(cl, op)
        for cluster in ("home", "region-a"):
            assert cl.pods(cluster, job) == []
        log = op.log.read_text()
        assert not h.forbidden(log), op.tail()
        assert token not in log
    finally:
        if op is not None:
            with contextlib.suppress(Exception):
                h.delete_jobs(cl, op)
            op.stop()
        helm_in(helm, k8s, "home", "uninstall", home_rel, "-n", ns, check=False)
        helm_in(helm, k8s, "region-a", "uninstall", remote_rel, "-n", ns, check=False)
        k8s.kubectl("home", "delete", "namespace", unrelated, "--wait=false", check=False)


def readme_commands(readme: Path, section: str) -> list[str]:
    """The ```bash blocks of one `## <section>` of a README, in order."""
    text = readme.read_text()
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start : end if end > 0 else None]
    return [block.split("```", 1)[0].split("\n", 1)[1] for block in body.split("```bash")[1:]]


def test_the_documented_remote_region_commands_work_as_written(
    k8s: Any, cl: h.Clusters, helm: c.Helm, tmp_path: Path
) -> None:
    # charts/ddiloco/README.md "Across regions", steps 1 and 2, run as a user would: from the
    # repository root, contexts "home" and "region-a" in one KUBECONFIG, namespace team-a
    # replaced by the test's. Then the NOTES that release prints, for another Secret name.
    ns = cl.ns
    install, script = readme_commands(c.CHART / "README.md", "Across regions")[:2]
    assert "helm install ddiloco-remote charts/ddiloco" in install
    top = (c.REPO / "README.md").read_text()
    assert "helm install ddiloco-remote charts/ddiloco --kube-context region-a -n team-a" in top
    merged = f"{k8s.home.kubeconfig}{os.pathsep}{k8s.clusters['region-a'].kubeconfig}"
    env = {
        **os.environ,
        "KUBECONFIG": merged,
        "PATH": f"{k8s.bindir}{os.pathsep}{os.environ.get('PATH', '')}",
        "HELM_CONFIG_HOME": str(helm.home / "config"),
        "HELM_CACHE_HOME": str(helm.home / "cache"),
        "HELM_DATA_HOME": str(helm.home / "data"),
    }

    def bash(text: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-euo", "pipefail", "-c", text.replace("team-a", ns)],
            capture_output=True, text=True, timeout=120, cwd=c.REPO, env={**env, **extra},
        )  # fmt: skip

    try:
        run = bash(install)
        assert run.returncode == 0, run.stdout + run.stderr
        get = ("-n", ns, "get", "secret", "ddiloco-remote-token", "-o", "jsonpath={.data.token}")
        k8senv.wait_until(
            "the ddiloco-remote token", lambda: k8s.kubectl("region-a", *get).stdout, timeout=30
        )
        run = bash(script)
        assert run.returncode == 0, run.stdout + run.stderr
        data = cl.core().read_namespaced_secret("region-a-kubeconfig", ns).data["kubeconfig"]
        cfg = tmp_path / "region-a-kubeconfig.yaml"
        cfg.write_bytes(base64.b64decode(data))
        assert yaml.safe_load(cfg.read_text())["users"][0]["name"] == "ddiloco-remote"
        assert allowed(cfg, "-n", ns, "auth", "can-i", "create", "pods").stdout.strip() == "yes"

        # The release's NOTES: the same names, and no region's values assumed.
        notes = helm_in(helm, k8s, "region-a", "get", "notes", "ddiloco-remote", "-n", ns).stdout
        assert "ddiloco-remote-remote" not in notes and "region-a" not in notes, notes
        block = c.notes_block(notes, "kubeconfig Secret")
        unset = bash(block)
        assert unset.returncode != 0 and "REGION_CONTEXT" in unset.stderr
        run = bash(block, REGION_CONTEXT="region-a", HOME_CONTEXT="home", SECRET="ra-2")
        assert run.returncode == 0, run.stdout + run.stderr
        cl.core().read_namespaced_secret("ra-2", ns)
    finally:
        helm_in(helm, k8s, "region-a", "uninstall", "ddiloco-remote", "-n", ns, check=False)
