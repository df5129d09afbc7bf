"""A region that is down, and kubeconfigs that are hostile, on a real control plane.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_regions.py

Two ways a region goes away: its kubeconfig Secret points at a closed port (connections are
refused at once), and its kube-apiserver is SIGSTOPped (`k8s.frozen`: connections are
accepted by the kernel, nothing ever answers). Either way the home cluster and the other
region go on being reconciled (a deleted learner there is replaced within REPLACE_S), the
job says which cluster is unreachable, and deleting the job ends within DELETE_S, with an
event naming what was left behind. The operator runs with the test default
DDILOCO_OPERATOR_CLEANUP_TIMEOUT_SECONDS=10 and its default 10 s API timeout.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from pathlib import Path
from typing import Any

import k8senv
import operator_helpers as h
import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration
REPLACE_S = 30.0
DELETE_S = 30.0


def region(name: str, replicas: int, secret: str | None = None) -> dict[str, Any]:
    """A learner group in another cluster (pods never run there, so any https URL does)."""
    return {**h.remote(name, replicas, secret), "syncUrl": "https://ddiloco-sync.example:8470"}


def closed_port_kubeconfig(cl: h.Clusters, cluster: str) -> str:
    """The cluster's kubeconfig, its server moved to a loopback port nobody listens on."""
    cfg = yaml.safe_load(h.flat_kubeconfig(cl.plane.clusters[cluster]))
    for entry in cfg["clusters"]:
        entry["cluster"]["server"] = f"https://127.0.0.1:{h.free_port()}"
    return yaml.safe_dump(cfg)


def events(cl: h.Clusters, job: str, reason: str) -> list[Any]:
    found = (
        cl.core().list_namespaced_event(cl.ns, field_selector=f"involvedObject.name={job}").items
    )
    return [e for e in found if e.reason == reason]


def gone(call: Any) -> bool:
    try:
        call()
    except ApiException as e:
        return e.status == 404
    return False


def delete_pod_and_time_replacement(cl: h.Clusters, clusters: list[str], job: str) -> float:
    """Delete the job's learner pod in each of `clusters`; seconds until each slot has a
    new Running pod."""
    before = k8senv.wait_until(
        f"one running learner in each of {clusters}",
        lambda: (u := h.running_uids(cl, clusters, job)) and len(u) == len(clusters) and u,
        REPLACE_S,
    )
    t0 = time.monotonic()
    for name in clusters:
        for pod in cl.pods(name, job):
            cl.core(name).delete_namespaced_pod(pod.metadata.name, cl.ns)

    def replaced() -> bool:
        now = h.running_uids(cl, clusters, job)
        return len(now) == len(before) and all(now[k] != before[k] for k in before)

    k8senv.wait_until(f"learners replaced in {clusters}", replaced, REPLACE_S)
    return time.monotonic() - t0


def delete_job_and_time(cl: h.Clusters, job: str) -> float:
    t0 = time.monotonic()
    cl.custom().delete_namespaced_custom_object(h.GROUP, h.VERSION, cl.ns, h.PLURAL, job)
    k8senv.wait_until("the job to go", lambda: gone(lambda: cl.job(job)), DELETE_S + 15)
    return time.monotonic() - t0


def test_a_refused_region_stops_nothing_elsewhere(cl: h.Clusters, operator: h.Operator) -> None:
    h.kubeconfig_secret(
        cl, "region-a-kubeconfig", None, text=closed_port_kubeconfig(cl, "region-a")
    )
    h.kubeconfig_secret(cl, "region-b-kubeconfig", "region-b")
    groups = [{"name": "home", "replicas": 1}, region("region-a", 1), region("region-b", 1)]
    job = h.create_job(cl, h.job_manifest("refused", groups))

    degraded = h.wait_condition(cl, job, "Degraded", reason="ClusterUnreachable", timeout=30)
    message = h.condition(degraded, "Degraded")["message"]
    assert "region-a-kubeconfig" in message and "region-b" not in message, message
    assert degraded["status"]["phase"] == "Degraded"
    took = delete_pod_and_time_replacement(cl, ["home", "region-b"], job)
    print(f"refused region: learners at home and in region-b replaced in {took:.1f}s")
    assert took < REPLACE_S

    took = delete_job_and_time(cl, job)
    print(f"refused region: job deleted in {took:.1f}s")
    assert took < DELETE_S
    skipped = events(cl, job, "CleanupSkipped")
    assert skipped and "region-a-kubeconfig" in skipped[0].message, skipped
    assert "Left behind" in skipped[0].message
    for name in ("home", "region-b"):  # what could be reached was cleaned
        assert cl.pods(name, job) == [], name
        assert h.job_secret_names(cl, name, job) == set(), name  # key, credentials, TLS
    assert operator.running()


def test_a_frozen_region_stops_nothing_elsewhere_and_recovers(
    k8s: Any, cl: h.Clusters, operator: h.Operator
) -> None:
    for name in ("region-a", "region-b"):
        h.kubeconfig_secret(cl, f"{name}-kubeconfig", name)
    groups = [{"name": "home", "replicas": 1}, region("region-a", 1), region("region-b", 1)]
    job = h.create_job(cl, h.job_manifest("frozen", groups))
    h.wait_condition(cl, job, "Ready", timeout=60)

    with k8s.frozen("region-b"):
        took = delete_pod_and_time_replacement(cl, ["home", "region-a"], job)
        print(f"frozen region: learners at home and in region-a replaced in {took:.1f}s")
        assert took < REPLACE_S
        degraded = h.wait_condition(cl, job, "Degraded", reason="ClusterUnreachable", timeout=40)
        message = h.condition(degraded, "Degraded")["message"]
        assert "region-b-kubeconfig" in message and "region-a" not in message, message

        # the status keeps moving: the replacements at home and in region-a are counted
        # (within a few passes: the pass that noticed the replacement may predate its Ready)
        def counted() -> bool:
            groups_now = {g["name"]: g for g in cl.job(job)["status"]["groups"]}
            return groups_now["home"]["ready"] == 1 and groups_now["region-a"]["ready"] == 1

        k8senv.wait_until("the replacements counted while region-b is frozen", counted, 20)
    t0 = time.monotonic()
    h.wait_condition(cl, job, "Ready", timeout=60)
    print(f"frozen region: Ready again {time.monotonic() - t0:.1f}s after the thaw")
    assert h.condition(cl.job(job), "Degraded")["status"] == "False"
    assert operator.running()


def test_deleting_a_job_while_its_region_is_frozen_ends_in_bounded_time(
    k8s: Any, cl: h.Clusters, operator: h.Operator
) -> None:
    for name in ("region-a", "region-b"):
        h.kubeconfig_secret(cl, f"{name}-kubeconfig", name)
    groups = [{"name": "home", "replicas": 1}, region("region-a", 1), region("region-b", 1)]
    job = h.create_job(cl, h.job_manifest("frozen-del", groups))
    h.wait_condition(cl, job, "Ready", timeout=60)
    uid = cl.job(job)["metadata"]["uid"]

    with k8s.frozen("region-b"):
        took = delete_job_and_time(cl, job)
        print(f"frozen region: job deleted in {took:.1f}s")
        assert took < DELETE_S
        skipped = events(cl, job, "CleanupSkipped")
        assert skipped, "no CleanupSkipped event"
        assert "region-b-kubeconfig" in skipped[0].message and uid in skipped[0].message
        for name in ("home", "region-a"):
            assert cl.pods(name, job) == [], name
    # what the event says was left behind is there, and is found by the label it names
    left = cl.core("region-b").list_namespaced_pod(
        cl.ns, label_selector=f"ddiloco.dev/job-uid={uid}"
    )
    assert len(left.items) == 1
    assert operator.running()


# -- credentials never reach the log (§1.5) ------------------------------------------------


def hostile_kubeconfig(cl: h.Clusters, user: dict[str, Any], server: str | None = None) -> str:
    cfg = yaml.safe_load(h.flat_kubeconfig(cl.plane.clusters["region-a"]))
    for entry in cfg["users"]:
        entry["user"] = user
    if server is not None:
        for entry in cfg["clusters"]:
            entry["cluster"]["server"] = server
    return yaml.safe_dump(cfg)


def test_hostile_kubeconfigs_never_put_a_credential_in_the_log(
    k8s: Any, cl: h.Clusters, operator: h.Operator, tmp_path: Path
) -> None:
    nonce = secrets.token_hex(8)
    newline_token = f"bad-token-newline-{nonce}"
    control_token = f"ctl-token-{nonce}"
    file_token = f"file-token-{nonce}"
    exec_token = f"exec-token-{nonce}"
    token_file = tmp_path / "token"
    token_file.write_text(file_token + "\n")
    marker = tmp_path / "exec-ran"
    admin = k8s.home.token  # the operator's own credential (the same in every cluster here)
    cases = {
        # a bad token with a trailing newline: trimmed, then refused by the apiserver (401)
        "nl": {"token": newline_token + "\n"},
        # control characters inside: refused before any request
        "ctl": {"token": control_token + "\x07\r\nX-Injected: 1"},
        "file": {"tokenFile": str(token_file)},
        "exec": {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1",
                "command": "sh",
                "args": [
                    "-c",
                    f"touch {marker}; echo '{json.dumps({'status': {'token': exec_token}})}'",
                ],
            }
        },
        # a server that refuses connections, with a valid credential
        "refused": {"token": admin},
    }
    for name, user in cases.items():
        server = f"https://127.0.0.1:{h.free_port()}" if name == "refused" else None
        h.kubeconfig_secret(
            cl, f"{name}-kubeconfig", None, text=hostile_kubeconfig(cl, user, server)
        )
    groups = [{"name": "home", "replicas": 1}] + [
        region(name, 1, f"{name}-kubeconfig") for name in cases
    ]
    job = h.create_job(cl, h.job_manifest("hostile", groups))

    # (the Degraded message is bounded in length, so it may not name all five)
    h.wait_condition(cl, job, "Degraded", timeout=40)
    time.sleep(5 * float(h.RESYNC_S) + 2)  # several more passes: retries are where it leaked
    job_token = base64.b64decode(
        cl.core().read_namespaced_secret(f"{job}-token", cl.ns).data["token"]
    ).decode()
    took = delete_job_and_time(cl, job)
    assert took < DELETE_S
    operator.stop()

    log = operator.log.read_text(errors="replace")
    for name in cases:  # each hostile Secret was used (and refused or failed) meanwhile
        assert f"{name}-kubeconfig" in log, name
    values = {
        "newline token": newline_token,
        "control-char token": control_token,
        "tokenFile content": file_token,
        "exec token": exec_token,
        "the operator's own token": admin,
        "the job's bearer token": job_token,
    }
    for what, value in values.items():
        for form in (value, base64.b64encode(value.encode()).decode()):
            assert form not in log, f"{what} is in the operator's log"
    assert "Bearer " + admin[:8] not in log
    assert not marker.exists(), "the exec plugin of a kubeconfig Secret ran"
