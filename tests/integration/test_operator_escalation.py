"""A namespace user reaches nothing through the operator that their own ServiceAccount cannot.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_escalation.py

The operator runs as the ServiceAccount of deploy/rbac/operator.yaml (cluster-wide rights).
`alice` holds only a Role in her namespace: she may create jobs and Secrets there, nothing
else, nowhere else. She writes, with her own token, kubeconfig Secrets that try to make the
operator act in `kube-system` of the home cluster: with the operator's own token through
`tokenFile`, through an exec plugin, anonymously, and with her own token. Each job is refused
with a Degraded condition naming its Secret, nothing of the job appears in `kube-system`,
the exec plugin never ran, her home learner still runs in her namespace, and no credential
reaches the operator's log.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import k8senv
import operator_helpers as h
import pytest
import yaml
from operator_helpers import cl_fixture, crd_fixture  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration


def alice_role(ns: str) -> str:
    return yaml.safe_dump_all(
        [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "alice"}},
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "alice"},
                "rules": [
                    {
                        "apiGroups": [h.GROUP],
                        "resources": [h.PLURAL],
                        "verbs": ["create", "get", "list", "delete"],
                    },
                    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "get"]},
                ],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "alice"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "alice",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "alice", "namespace": ns}],
            },
        ]
    )


def hostile_kubeconfig(cluster: Any, user: dict[str, Any]) -> str:
    """A kubeconfig for the home apiserver, namespace kube-system, with `user` as its user."""
    cfg = yaml.safe_load(h.token_kubeconfig(cluster, "placeholder", "kube-system"))
    cfg["users"] = [{"name": "sa", "user": user}]
    return yaml.safe_dump(cfg)


def kube_system_objects(cl: h.Clusters, job: str) -> list[str]:
    core = cl.core()
    selector = f"ddiloco.dev/job={job}"
    pods = core.list_namespaced_pod("kube-system", label_selector=selector).items
    secrets = core.list_namespaced_secret("kube-system", label_selector=selector).items
    named = [
        s.metadata.name
        for s in core.list_namespaced_secret("kube-system").items
        if s.metadata.name.startswith(job)
    ]
    return [p.metadata.name for p in pods] + [s.metadata.name for s in secrets] + named


def test_a_namespace_user_gains_nothing_through_the_operator(
    k8s: Any, cl: h.Clusters, tmp_path: Path
) -> None:
    k8s.kubectl("home", "apply", "-f", str(h.RBAC / "operator.yaml"))
    op_token = k8s.kubectl(
        "home", "-n", "ddiloco-system", "create", "token", "ddiloco-operator"
    ).stdout.strip()
    op_cfg = tmp_path / "operator.kubeconfig"
    op_cfg.write_text(h.token_kubeconfig(k8s.home, op_token, cl.ns))
    op_cfg.chmod(0o600)
    # where a pod's mounted ServiceAccount token would be: the operator runs on this host
    op_token_file = tmp_path / "serviceaccount-token"
    op_token_file.write_text(op_token)
    k8s.kubectl("home", "-n", cl.ns, "apply", "-f", "-", input=alice_role(cl.ns))
    alice = k8s.kubectl("home", "-n", cl.ns, "create", "token", "alice").stdout.strip()

    def as_alice(*args: str, input: str | None = None, check: bool = True) -> Any:
        return k8s.kubectl("home", "--token", alice, "-n", cl.ns, *args, input=input, check=check)

    # alice herself may not touch kube-system: the baseline the operator must not exceed
    assert (
        as_alice("auth", "can-i", "create", "pods", "-n", "kube-system", check=False)
        .stdout.strip()
        .startswith("no")
    )
    marker = tmp_path / "owned"
    cases = {
        "tokenfile": {"tokenFile": str(op_token_file)},
        "exec": {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1",
                "command": "/bin/sh",
                "args": ["-c", f"id > {marker}; echo '{{}}'"],
            }
        },
        "anonymous": {},
        "own-token": {"token": alice},
    }
    op = h.Operator(op_cfg, cl.ns, tmp_path)
    op.start()
    jobs: dict[str, str] = {}
    try:
        for case, user in cases.items():
            secret = {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": f"{case}-kubeconfig"},
                "stringData": {"kubeconfig": hostile_kubeconfig(k8s.home, user)},
            }
            as_alice("apply", "-f", "-", input=json.dumps(secret))
            manifest = h.job_manifest(
                f"esc-{case}",
                [
                    {"name": "a", "replicas": 1},
                    {
                        "name": "ks",
                        "replicas": 1,
                        "cluster": {
                            "kubeconfigSecret": {"name": f"{case}-kubeconfig"},
                            "namespace": "kube-system",
                        },
                        "syncUrl": "https://ddiloco-sync.home.example:8470",
                    },
                ],
            )
            as_alice("create", "-f", "-", input=json.dumps(manifest))
            jobs[case] = f"esc-{case}"
        for case, job in jobs.items():
            degraded = h.wait_condition(cl, job, "Degraded", timeout=60)
            message = h.condition(degraded, "Degraded")["message"]
            assert f"{case}-kubeconfig" in message, (case, message)
            # her own part of the job goes on in her namespace
            k8senv.wait_until(
                f"the home learner of {job}", lambda j=job: h.running_uids(cl, ["home"], j), 30
            )
        for job in jobs.values():
            assert kube_system_objects(cl, job) == [], job
        assert not marker.exists(), "the exec plugin ran as the operator"
        for job in jobs.values():
            as_alice("delete", h.PLURAL, job, "--wait=false")
        k8senv.wait_until(
            "the jobs gone",
            lambda: (
                not cl.custom().list_namespaced_custom_object(h.GROUP, h.VERSION, cl.ns, h.PLURAL)[
                    "items"
                ]
            ),
            timeout=60,
        )
    finally:
        op.stop()
    log = op.log.read_text()
    for secret_value in (op_token, alice, k8s.home.token):
        assert secret_value not in log
        assert base64.b64encode(secret_value.encode()).decode() not in log
