"""`spec.evaluation` on a real control plane: the operator makes the evaluator's Deployment and
credential, copies the synchronizer's latest evaluation into the job status, and removes both
objects when the spec drops the evaluation, and when the job is deleted.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_evaluation.py

The synchronizer is the session's status stub (operator_helpers.py), answering this job's
status with an evaluation; kwok runs no pod, so the Deployment is checked as the apiserver
admitted it.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import k8senv
import operator_helpers as h
import pytest
from kubernetes.client.exceptions import ApiException
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

from ddiloco.wire.auth import Principal, StaticTokens, authenticate

pytestmark = pytest.mark.integration

VOLUME = {"name": "corpus", "persistentVolumeClaim": {"claimName": "corpus", "readOnly": True}}
MOUNT = {"name": "corpus", "mountPath": "/data", "readOnly": True}
EVALUATION = {
    "data": "/data/heldout.txt",
    "everyVersions": 10,
    "everySeconds": 120,
    "evalBatches": 3,
    "volumes": [VOLUME],
    "volumeMounts": [MOUNT],
    "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
    "nodeSelector": {"pool": "eval"},
}
EVALUATED = {
    "global_version": 12,
    "merges": 12,
    "tokens_merged": 4800,
    "evaluation": {
        "loss": 3.14159,
        "perplexity": 23.1406,
        "global_version": 10,
        "tokens": 6144,
        "time": 1_800_000_000.0,
        "evaluator": "ev-evaluator",
    },
}


def _deployment(cl: h.Clusters, name: str) -> Any:
    try:
        return cl.apps().read_namespaced_deployment(name, cl.ns)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _secret(cl: h.Clusters, name: str) -> Any:
    try:
        return cl.core().read_namespaced_secret(name, cl.ns)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def test_the_evaluator_is_made_reported_and_removed(cl: h.Clusters, operator: h.Operator) -> None:
    training = {"model": "tiny", "data": "/data/train.txt", "batchSize": 4}
    body = h.job_manifest(
        "ev", [{"name": "a", "replicas": 1}], training=training, evaluation=EVALUATION
    )
    h.STATUS_OVERRIDES[f"/{cl.ns}/ev/"] = json.dumps(EVALUATED).encode()
    try:
        job = h.create_job(cl, body)
        dep = k8senv.wait_until(
            "the evaluator Deployment", lambda: _deployment(cl, f"{job}-evaluator"), timeout=60
        )
        owner = dep.metadata.owner_references[0]
        assert (owner.kind, owner.name, owner.controller) == ("DecoupledDiLoCoJob", job, True)
        assert dep.spec.replicas == 1
        pod = dep.spec.template.spec
        (container,) = pod.containers
        assert container.command == ["ddiloco", "evaluate"]
        args = container.args
        flags = dict(zip(args[::2], args[1::2], strict=True))
        assert flags == {
            "--model": "tiny",
            "--data": "/data/heldout.txt",
            "--batch-size": "4",
            "--every-versions": "10",
            "--every-seconds": "120",
            "--eval-batches": "3",
        }
        env = {e.name: e.value for e in container.env}
        assert env["DDILOCO_TOKEN_FILE"] == "/var/run/ddiloco/token/token"
        assert env["DDILOCO_SYNC_URL"].startswith(f"https://{job}-synchronizer.{cl.ns}.svc:")
        assert env["DDILOCO_CA_FILE"] == "/var/run/ddiloco/trust/ca.crt"
        volumes = {v.name: v for v in pod.volumes}
        mounts = {m.name: m for m in container.volume_mounts}
        assert volumes["token"].secret.secret_name == f"{job}-evaluator-token"
        assert mounts["token"].mount_path == "/var/run/ddiloco/token" and mounts["token"].read_only
        assert volumes["trust"].secret.secret_name == f"{job}-trust"
        assert volumes["corpus"].persistent_volume_claim.claim_name == "corpus"
        assert mounts["corpus"].mount_path == "/data"
        assert container.resources.requests == {"cpu": "1", "memory": "2Gi"}
        assert pod.node_selector == {"pool": "eval"}

        # the credential: an evaluator's, derived from the job key, nothing more
        secret = k8senv.wait_until(
            "the evaluator credential", lambda: _secret(cl, f"{job}-evaluator-token"), 30
        )
        key = base64.b64decode(_secret(cl, f"{job}-token").data["token"]).decode().strip()
        credential = base64.b64decode(secret.data["token"]).decode().strip()
        assert key not in credential
        who = authenticate(f"Bearer {credential}", StaticTokens(key))
        assert who == Principal("evaluator", f"{job}-evaluator")
        assert secret.metadata.owner_references[0].name == job

        # the synchronizer's latest evaluation, in the job status and kubectl get ddj
        evaluation = k8senv.wait_until(
            "status.evaluation", lambda: cl.job(job)["status"].get("evaluation"), timeout=60
        )
        assert evaluation == {
            "loss": 3.142,
            "perplexity": 23.14,
            "globalVersion": 10,
            "time": "2027-01-15T08:00:00Z",
        }
        table = cl.kubectl("get", "ddj", job).stdout.splitlines()
        assert "EVAL LOSS" in table[0]
        at = table[0].index("EVAL LOSS")
        assert table[1][at:].split()[0] == "3.142", table

        # dropping spec.evaluation removes the Deployment and its credential
        cl.custom().patch_namespaced_custom_object(
            h.GROUP, h.VERSION, cl.ns, h.PLURAL, job, {"spec": {"evaluation": None}}
        )
        k8senv.wait_until(
            "the evaluator gone",
            lambda: (
                _deployment(cl, f"{job}-evaluator") is None
                and _secret(cl, f"{job}-evaluator-token") is None
            ),
            timeout=60,
        )
    finally:
        h.STATUS_OVERRIDES.pop(f"/{cl.ns}/ev/", None)


def test_deleting_the_job_deletes_the_evaluator(cl: h.Clusters, operator: h.Operator) -> None:
    body = h.job_manifest("evdel", [{"name": "a", "replicas": 1}], evaluation={"everySeconds": 60})
    job = h.create_job(cl, body)
    k8senv.wait_until("the evaluator", lambda: _deployment(cl, f"{job}-evaluator"), timeout=60)
    k8senv.wait_until("its credential", lambda: _secret(cl, f"{job}-evaluator-token"), 30)
    cl.custom().delete_namespaced_custom_object(h.GROUP, h.VERSION, cl.ns, h.PLURAL, job)

    def gone() -> bool:
        try:
            cl.job(job)
        except ApiException as e:
            return e.status == 404
        return False

    k8senv.wait_until("the job to go", gone, timeout=30)
    # the finalizer deleted both before it let the job go (the garbage collector acts after)
    assert _deployment(cl, f"{job}-evaluator") is None
    assert _secret(cl, f"{job}-evaluator-token") is None
