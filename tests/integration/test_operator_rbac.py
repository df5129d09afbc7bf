"""The operator needs no more than deploy/rbac/: run it as those ServiceAccounts, end to end.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_rbac.py

Home: the ClusterRole of deploy/rbac/operator.yaml; region-a: the Role of
deploy/rbac/remote-learners.yaml in the job's namespace. The job is created, a pod fails and is
replaced, the job is suspended and resumed (StatefulSet update) and deleted (cleanup), and
the apiservers never answer 403 to the operator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import k8senv
import operator_helpers as h
import pytest
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration
RBAC = h.RBAC


def test_operator_runs_with_the_documented_rbac_only(
    k8s: Any, cl: h.Clusters, tmp_path: Path
) -> None:
    k8s.kubectl("home", "apply", "-f", str(RBAC / "operator.yaml"))
    home_token = k8s.kubectl(
        "home", "-n", "ddiloco-system", "create", "token", "ddiloco-operator"
    ).stdout.strip()
    home_cfg = tmp_path / "operator.kubeconfig"
    home_cfg.write_text(h.token_kubeconfig(k8s.home, home_token, cl.ns))
    home_cfg.chmod(0o600)
    k8s.kubectl("region-a", "-n", cl.ns, "apply", "-f", str(RBAC / "remote-learners.yaml"))
    remote_token = k8s.kubectl(
        "region-a", "-n", cl.ns, "create", "token", "ddiloco-remote"
    ).stdout.strip()
    h.kubeconfig_secret(
        cl,
        "region-a-kubeconfig",
        None,
        text=h.token_kubeconfig(k8s.clusters["region-a"], remote_token, cl.ns),
    )

    op = h.Operator(home_cfg, cl.ns, tmp_path)
    op.start()
    try:
        job = h.create_job(
            cl,
            h.job_manifest(
                "rbac",
                [{"name": "a", "replicas": 1}, h.remote("region-a", 1)],
                failurePolicy={"backoffSeconds": 0},
            ),
        )
        h.wait_condition(cl, job, "Ready", timeout=60)
        before = h.running_uids(cl, ["home", "region-a"], job)
        cl.core("region-a").patch_namespaced_pod_status(
            h.slot_pod(cl, "region-a", job, "region-a-0"),
            cl.ns,
            {"status": {"phase": "Failed", "reason": "Evicted"}},
        )
        k8senv.wait_until(
            "the replacement",
            lambda: (
                (u := h.running_uids(cl, ["home", "region-a"], job)).get(
                    "region-a-0", before["region-a-0"]
                )
                != before["region-a-0"]
                and u
            ),
            timeout=20,
        )
        cl.custom().patch_namespaced_custom_object(
            h.GROUP, h.VERSION, cl.ns, h.PLURAL, job, {"spec": {"suspend": True}}
        )
        h.wait_condition(cl, job, "Ready", "False", reason="Suspended")
        k8senv.wait_until(
            "the synchronizer scaled to 0",
            lambda: (
                cl.apps().read_namespaced_stateful_set(f"{job}-synchronizer", cl.ns).spec.replicas
                == 0
            ),
            timeout=20,
        )
        h.delete_jobs(cl, op)
        for c in ("home", "region-a"):
            assert cl.pods(c, job) == []
        log = op.log.read_text()
        assert not h.forbidden(log), op.tail()
        assert home_token not in log and remote_token not in log
    finally:
        op.stop()
