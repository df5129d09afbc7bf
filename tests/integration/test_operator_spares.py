"""Hot spares (failurePolicy.hotSpares) on a real control plane, with a real synchronizer.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_spares.py

The operator runs as in production and reaches the job's synchronizer at a REAL `ddiloco
synchronizer` process on loopback (DDILOCO_OPERATOR_STATUS_URL_TEMPLATE), which reads its
tokens from a file: once the operator has made the job's token Secret, the test writes that
token there (the synchronizer re-reads the file), as the mounted Secret would be in a pod.
Pods never run (kwok marks them Running and Ready), so a slot's failure is the kubelet's
status write, and the test itself plays the spare's long poll against the synchronizer, with
the one credential the spare pod mounts (its item of the group's credentials Secret).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import k8senv
import operator_helpers as h
import pytest
from kubernetes.client.exceptions import ApiException
from operator_helpers import cl_fixture, crd_fixture  # noqa: F401  (fixtures)

from ddiloco.learner.sync_client import SyncClient
from ddiloco.local.processes import Child, ddiloco_command, env_with, free_port, terminate_all
from ddiloco.wire import auth

pytestmark = pytest.mark.integration
ROLE, SLOT, LID, ATTEMPT = (
    "ddiloco.dev/role",
    "ddiloco.dev/slot",
    "ddiloco.dev/learner-id",
    "ddiloco.dev/attempt",
)
PLACEHOLDER = "not-the-job-token-yet"


class Sync:
    """A `ddiloco synchronizer` on loopback whose token file the test fills in."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token_file = tmp / "token"
        self.token_file.write_text(PLACEHOLDER + "\n")
        argv = ddiloco_command(
            "synchronizer", "--port", str(self.port), "--state-dir", str(tmp / "state")
        )
        env = env_with(DDILOCO_TOKEN_FILE=str(self.token_file))
        env.pop("DDILOCO_TOKEN", None)
        self.child = Child("synchronizer", argv, env, tmp / "sync.log")
        self.token = PLACEHOLDER

    def start(self) -> None:
        self.child.start()
        probe = SyncClient(self.url, PLACEHOLDER, timeout=2)
        k8senv.wait_until("the synchronizer's /healthz", probe.healthy, timeout=60)
        probe.close()

    def client(self, timeout: float = 30.0) -> SyncClient:
        return SyncClient(self.url, self.token, timeout=timeout)


@pytest.fixture(name="sync")
def sync_fixture(tmp_path: Path) -> Iterator[Sync]:
    s = Sync(tmp_path)
    s.start()
    try:
        yield s
    finally:
        terminate_all([s.child])


@pytest.fixture(name="operator")
def operator_fixture(k8s: Any, cl: h.Clusters, sync: Sync, tmp_path: Path) -> Iterator[h.Operator]:
    op = h.Operator(
        k8s.home.kubeconfig,
        cl.ns,
        tmp_path,
        env={"DDILOCO_OPERATOR_STATUS_URL_TEMPLATE": sync.url},
    )
    op.start()
    yield op
    try:
        h.delete_jobs(cl, op)
    finally:
        op.stop()


def all_pods(cl: h.Clusters, cluster: str, job: str) -> list[Any]:
    return list(cl.pods(cluster, job))


def spares_of(cl: h.Clusters, cluster: str, job: str) -> list[Any]:
    return [p for p in all_pods(cl, cluster, job) if p.metadata.labels.get(ROLE) == "spare"]


def slot_pod(cl: h.Clusters, cluster: str, job: str, lid: str) -> str:
    """The name of a slot's pod (h.slot_pod reads a learner id every pod has; spares have none)."""
    (pod,) = [p for p in all_pods(cl, cluster, job) if p.metadata.labels.get(LID) == lid]
    return str(pod.metadata.name)


def events(cl: h.Clusters, job: str, reason: str) -> list[Any]:
    found = cl.core().list_namespaced_event(cl.ns, field_selector=f"involvedObject.name={job}")
    return [e for e in found.items if e.reason == reason]


def give_token(cl: h.Clusters, sync: Sync, job: str) -> None:
    """What mounting the job's token Secret into the synchronizer pod would do."""
    secret = k8senv.wait_until(
        "the job's token Secret", lambda: cl.core().read_namespaced_secret(f"{job}-token", cl.ns)
    )
    token = base64.b64decode(secret.data["token"]).decode().splitlines()[0]
    sync.token_file.write_text(token + "\n")
    sync.token = token


def test_a_failed_slot_is_taken_over_by_its_groups_hot_spare(
    cl: h.Clusters, operator: h.Operator, sync: Sync
) -> None:
    h.kubeconfig_secret(cl, "region-a-kubeconfig", "region-a")
    body = h.job_manifest(
        "hot",
        [{"name": "a", "replicas": 2}, h.remote("region-a", 1)],
        failurePolicy={"backoffSeconds": 0, "maxReplacementsPerSlot": 5, "hotSpares": 1},
    )
    job = h.create_job(cl, body)
    give_token(cl, sync, job)
    h.wait_condition(cl, job, "Ready", timeout=90)  # the real synchronizer answered its status

    # hotSpares: 1 makes one spare per group, in the group's cluster, counted in the status
    def one_spare_each() -> dict[str, Any] | None:
        home, remote = spares_of(cl, "home", job), spares_of(cl, "region-a", job)
        groups = {g["name"]: g for g in (cl.job(job).get("status") or {}).get("groups", [])}
        ok = (
            len(home) == len(remote) == 1
            and all(p.status.phase == "Running" for p in home + remote)
            and all(groups.get(g, {}).get("sparesReady") == 1 for g in ("a", "region-a"))
        )
        return {"home": home[0], "region-a": remote[0]} if ok else None

    spare = k8senv.wait_until("one Ready spare per group", one_spare_each, timeout=60)
    # each pod mounts its own credential: the slots their learner's, the spares their own
    own = {}
    for cluster in ("home", "region-a"):
        for pod in all_pods(cl, cluster, job):
            own[pod.metadata.name] = h.check_own_credential(cl, cluster, job, pod)
    assert own[spare["home"].metadata.name] == f"spare.{spare['home'].metadata.name}"
    assert spare["home"].metadata.name.startswith("hot-a-spare-0-")
    assert spare["region-a"].metadata.name.startswith("hot-region-a-spare-0-")
    assert SLOT not in spare["home"].metadata.labels
    assert len(all_pods(cl, "home", job)) == 3  # two slots and the spare
    # the promotion's preconditions are the apiserver's: a patch for another uid is refused
    with pytest.raises(ApiException) as refused:
        cl.core().patch_namespaced_pod(
            spare["home"].metadata.name,
            cl.ns,
            [
                {"op": "test", "path": "/metadata/uid", "value": "not-this-pod"},
                {"op": "replace", "path": "/metadata/labels/ddiloco.dev~1role", "value": "x"},
            ],
        )
    assert refused.value.status == 422, refused.value
    assert spares_of(cl, "home", job)[0].metadata.labels[ROLE] == "spare"

    # fail slot a-0 (and the remote slot): the spare of each group takes it over, same pod
    failed = {
        "home": slot_pod(cl, "home", job, "a-0"),
        "region-a": slot_pod(cl, "region-a", job, "region-a-0"),
    }
    t0 = time.monotonic()
    for cluster, name in failed.items():
        cl.core(cluster).patch_namespaced_pod_status(
            name, cl.ns, {"status": {"phase": "Failed", "reason": "Evicted", "message": "x"}}
        )

    def promoted(cluster: str, lid: str) -> Any:
        pods = (
            cl.core(cluster)
            .list_namespaced_pod(
                cl.ns, field_selector=f"metadata.name={spare[cluster].metadata.name}"
            )
            .items
        )
        if len(pods) == 1 and pods[0].metadata.labels.get(LID) == lid:
            return pods[0]
        return None

    home_pod = k8senv.wait_until("a-0 promoted", lambda: promoted("home", "a-0"), timeout=30)
    took = time.monotonic() - t0
    remote_pod = k8senv.wait_until(
        "region-a-0 promoted", lambda: promoted("region-a", "region-a-0"), timeout=30
    )
    print(
        f"failed slot pod -> spare's labels patched: {took:.2f}s (home), "
        f"{time.monotonic() - t0:.2f}s (both)"
    )
    for pod, cluster, index in ((home_pod, "home", "0"), (remote_pod, "region-a", "0")):
        labels = pod.metadata.labels
        assert pod.metadata.uid == spare[cluster].metadata.uid  # the very same pod
        assert (labels[ROLE], labels[SLOT], labels[ATTEMPT]) == ("learner", index, "1")
        assert labels["ddiloco.dev/data-part"].endswith("-of-3")
        assert pod.metadata.annotations["ddiloco.dev/promoted-at"]
    assert home_pod.metadata.labels["ddiloco.dev/data-part"] == "0-of-3"
    assert remote_pod.metadata.labels["ddiloco.dev/data-part"] == "2-of-3"
    for cluster, name in failed.items():  # the failed pods went; no cold pod took their name
        k8senv.wait_until(
            f"{name} gone",
            lambda c=cluster, n=name: n not in {p.metadata.name for p in all_pods(cl, c, job)},
            timeout=20,
        )

    # the synchronizer keeps assignments in memory only: SIGKILL it and start it again; the
    # operator re-sends what it promoted recently (from the pods' labels), so the real
    # synchronizer then holds each assignment: what the spare's long poll receives
    sync.child.kill()
    sync.start()
    for pod, cluster, lid, shard in (
        (home_pod, "home", "a-0", 0),
        (remote_pod, "region-a", "region-a-0", 2),
    ):
        # promoted, the spare's own item of its group's credentials now holds its slot's
        # learner credential (what the learner re-reads after a 401); the spare polls with
        # the spare credential it read at its start
        group = pod.metadata.labels["ddiloco.dev/group"]
        item = h.check_own_credential(cl, cluster, job, pod)
        now = h.learner_credentials(cl, cluster, job, group)[1][item].splitlines()[0]
        assert now == auth.learner_token(sync.token, lid) != sync.token
        mine = auth.spare_token(sync.token, pod.metadata.name)
        client = SyncClient(sync.url, mine, timeout=30)
        status, _, answer = client.request("GET", f"/v1/spares/{pod.metadata.name}?wait_s=10")
        got = json.loads(answer)
        assert status == 200, answer
        assert (got["learner_id"], got["learner_index"], got["num_learners"]) == (lid, shard, 3)
        assert got["attempt"] == 1
        # with it the slot's learner credential, which speaks for that slot alone
        assert got["token"] == auth.learner_token(sync.token, lid)
        client.close()

    # a new spare stands by in each group; the books count one promoted replacement each
    def refilled() -> dict[str, Any] | None:
        status = cl.job(job).get("status") or {}
        groups = {g["name"]: g for g in status.get("groups", [])}
        fresh = {c: spares_of(cl, c, job) for c in ("home", "region-a")}
        ok = all(
            len(fresh[c]) == 1 and fresh[c][0].metadata.uid != spare[c].metadata.uid for c in fresh
        ) and all(
            (groups[g].get("replaced"), groups[g].get("promoted"), groups[g].get("sparesReady"))
            == (1, 1, 1)
            for g in ("a", "region-a")
        )
        return status if ok else None

    status = k8senv.wait_until("new spares and the books", refilled, timeout=30)
    assert {g["name"]: g.get("slotReplacements") for g in status["groups"]} == {
        "a": [1, 0],
        "region-a": [1],
    }
    assert status["readyLearners"] == 3
    promoted_events = k8senv.wait_until(
        "SparePromoted events", lambda: len(e := events(cl, job, "SparePromoted")) >= 2 and e, 10
    )
    assert any(
        spare["home"].metadata.name in e.message and "a-0" in e.message for e in promoted_events
    )
    # the operator stops re-sending once the spare has fetched it (its PUT says delivered)
    name = home_pod.metadata.name

    def sends() -> int:
        return operator.log.read_text().count(f"Sent the assignment of spare {name}")

    k8senv.wait_until("the delivered answer", lambda: f"{name} (delivered: True)" in
                      operator.log.read_text(), timeout=10)  # fmt: skip
    before = sends()
    time.sleep(3)  # six resync ticks
    assert sends() == before

    # the job's deletion removes the spares too, in every cluster
    cl.custom().delete_namespaced_custom_object(h.GROUP, h.VERSION, cl.ns, h.PLURAL, job)
    k8senv.wait_until(
        "every pod gone",
        lambda: not all_pods(cl, "home", job) and not all_pods(cl, "region-a", job),
        timeout=60,
    )


def test_without_hot_spares_nothing_changes(
    cl: h.Clusters, operator: h.Operator, sync: Sync
) -> None:
    job = h.create_job(cl, h.job_manifest("cold", [{"name": "a", "replicas": 1}]))
    give_token(cl, sync, job)
    h.wait_condition(cl, job, "Ready", timeout=90)
    assert spares_of(cl, "home", job) == []
    (group,) = cl.job(job)["status"]["groups"]
    assert (group.get("spares", 0), group.get("promoted", 0)) == (0, 0)
