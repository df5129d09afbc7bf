"""The operator's side of synchronizer shards: StatefulSet, Services, URLs, status.

    .venv/bin/pytest -q tests/unit/test_operator_shards.py

Pure builders and reconcile decisions, plus the status reader against real HTTP servers on
loopback (one per shard). What the apiserver makes of these (the StatefulSet controller's pods
and claims, the CRD's refusals) is tests/integration/test_operator_shards.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from ddiloco.operator import api, builders, names, sync_workload, syncstatus
from ddiloco.operator.config import OperatorSettings
from ddiloco.operator.plan import ClusterView, Observed, Plan, home
from ddiloco.operator.reconcile import reconcile
from ddiloco.wire.protocol import Status

T0 = datetime(2026, 12, 2, 1, 0, 0, tzinfo=UTC)
TOKEN = "tok-shards"


def make_job(shards: int = 1, **spec: Any) -> api.DecoupledDiLoCoJob:
    body: dict[str, Any] = {
        "metadata": {"name": "sh", "namespace": "ns", "uid": "job-s", "generation": 1},
        "spec": {
            "image": "ddiloco:dev",
            "training": {"model": "tiny"},
            "synchronizer": {"shards": shards, "tls": {"enabled": False}},
            "learnerGroups": [{"name": "a", "replicas": 2}],
            **spec,
        },
    }
    return api.DecoupledDiLoCoJob.from_body(body)


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def observe(job: api.DecoupledDiLoCoJob, **kw: Any) -> Observed:
    fields: dict[str, Any] = {"service": True, "shards_service": True, **kw}
    return Observed(now=T0, clusters={home(job): ClusterView(token=TOKEN)}, **fields)


def actions(plan: Plan, kind: str) -> list[tuple[str, str]]:
    return [(a.verb, a.name) for a in plan.actions if a.kind == kind]


# --------------------------------------------------------------------------- builders


def test_two_shards_are_a_statefulset_of_two_with_a_claim_each() -> None:
    job = make_job(2, updateEncoding="int4")
    sts = sync_workload.build_synchronizer_statefulset(job)
    spec = sts["spec"]
    assert (sts["kind"], sts["metadata"]["name"]) == ("StatefulSet", "sh-synchronizer")
    assert spec["replicas"] == 2 and spec["serviceName"] == "sh-synchronizer-shards"
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == builders.STATE_TEMPLATE
    assert claim["metadata"]["labels"][builders.LABEL_JOB_UID] == "job-s"  # made_by sees it
    # a deleted job leaves no claim; a suspended one (replicas 0) keeps its state
    assert spec["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Delete",
        "whenScaled": "Retain",
    }
    (ctr,) = spec["template"]["spec"]["containers"]
    e = env(ctr)
    assert e["DDILOCO_SHARDS"] == "2" and e["DDILOCO_UPDATE_ENCODINGS"] == "int4"
    # every shard serves the upload port too (learners reach it at their shard's host)
    assert e["DDILOCO_UPLOAD_PORT"] == str(builders.SYNC_UPLOAD_PORT) == "8471"
    assert ctr["ports"] == [
        {"name": "http", "containerPort": builders.SYNC_PORT, "protocol": "TCP"},
        {"name": "upload", "containerPort": builders.SYNC_UPLOAD_PORT, "protocol": "TCP"},
    ]
    assert e["DDILOCO_SHARD"] == {
        "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
    }
    assert {"name": "state", "mountPath": builders.STATE_DIR} in ctr["volumeMounts"]
    assert not [v for v in spec["template"]["spec"]["volumes"] if v["name"] == "state"]
    assert builders.shard_claim_name(job, 1) == "state-sh-synchronizer-1"
    suspended = make_job(2, suspend=True)
    assert sync_workload.build_synchronizer_statefulset(suspended)["spec"]["replicas"] == 0


def test_learners_get_every_shards_url_in_order_and_the_encoding() -> None:
    job = make_job(3, updateEncoding="int8")
    pod = builders.build_learner_pod(job, job.spec.learner_groups[0], 0)
    e = env(pod["spec"]["containers"][0])
    assert e["DDILOCO_SYNC_URL"] == ",".join(
        f"http://sh-synchronizer-{i}.sh-synchronizer-shards.ns.svc:8470" for i in range(3)
    )
    assert e["DDILOCO_UPDATE_ENCODING"] == "int8"
    # one shard: the ClusterIP Service's URL
    one = make_job(1)
    e1 = env(
        builders.build_learner_pod(one, one.spec.learner_groups[0], 0)["spec"]["containers"][0]
    )
    assert e1["DDILOCO_SYNC_URL"] == "http://sh-synchronizer.ns.svc:8470"
    assert e1["DDILOCO_UPDATE_ENCODING"] == "bfloat16"


def test_the_services_of_a_sharded_synchronizer() -> None:
    job = make_job(2)
    headless = sync_workload.build_shards_service(job)["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is False
    assert builders.LABEL_POD_INDEX not in headless["selector"]  # every shard
    svc = sync_workload.build_synchronizer_service(job)["spec"]
    assert svc["selector"][builders.LABEL_POD_INDEX] == "0"  # never a mix of shards
    assert (
        builders.LABEL_POD_INDEX
        not in sync_workload.build_synchronizer_service(make_job(1))["spec"]["selector"]
    )  # S = 1: every pod is shard 0
    # both name the main port and the upload port (a learner's shard host, on either)
    for spec in (headless, svc):
        got = [(p["name"], p["port"], p["targetPort"]) for p in spec["ports"]]
        assert got == [("http", 8470, "http"), ("upload", 8471, "upload")]


def test_the_certificate_names_every_shard() -> None:
    job = make_job(2, synchronizer={"shards": 2})
    dns = builders.service_dns_names(job)
    assert "sh-synchronizer-1.sh-synchronizer-shards.ns.svc" in dns
    assert "sh-synchronizer-1.sh-synchronizer-shards.ns.svc.cluster.local" in dns
    assert not [n for n in builders.service_dns_names(make_job(1)) if "shards" in n]


def test_the_longest_job_name_fits_a_statefulset() -> None:
    long = make_job(api.MAX_SHARDS).model_copy(
        update={"metadata": {"name": "j" * api.MAX_JOB_NAME, "namespace": "n" * 63, "uid": "u"}}
    )
    assert names.problems(long) == []
    one_more = long.model_copy(
        update={"metadata": {**long.metadata, "name": "j" * (api.MAX_JOB_NAME + 1)}}
    )
    assert any("StatefulSet" in p and "52" in p for p in names.problems(one_more))


def test_a_remote_groups_sync_url_lists_one_url_per_shard() -> None:
    remote = {
        "name": "r",
        "replicas": 1,
        "cluster": {"kubeconfigSecret": {"name": "r-kubeconfig"}},
        "syncUrl": "https://s0.example:8470",
    }
    job = make_job(2, learnerGroups=[remote])
    (problem,) = api.validate(job.spec)
    assert "one URL per synchronizer shard" in problem
    remote["syncUrl"] = "https://s0.example:8470,https://s1.example:8470"
    job = make_job(2, learnerGroups=[remote])
    assert api.validate(job.spec) == []
    pod = builders.build_learner_pod(job, job.spec.learner_groups[0], 0)
    assert env(pod["spec"]["containers"][0])["DDILOCO_SYNC_URL"] == remote["syncUrl"]
    remote["syncUrl"] = "https://s0.example:8470,http://s1.example:8470"  # one in clear text
    (problem,) = api.validate(make_job(2, learnerGroups=[remote]).spec)
    assert problem.endswith(api.INSECURE_MESSAGE)


# --------------------------------------------------------------------------- reconcile


def test_a_new_job_gets_the_services_and_the_statefulset_but_no_claim() -> None:
    job = make_job(2)
    plan = reconcile(job, observe(job, service=False, shards_service=False), fresh_token=TOKEN)
    assert actions(plan, "Service") == [
        ("create", "sh-synchronizer"),
        ("create", "sh-synchronizer-shards"),
    ]
    assert actions(plan, "StatefulSet") == [("create", "sh-synchronizer")]
    assert actions(plan, "PersistentVolumeClaim") == []  # the StatefulSet controller's


def test_a_replace_keeps_what_a_statefulset_never_changes() -> None:
    job = make_job(2)
    have = sync_workload.build_synchronizer_statefulset(job)
    have["spec"]["volumeClaimTemplates"][0]["status"] = {"phase": "Pending"}  # as read back
    have["status"] = {"availableReplicas": 2}
    resized = make_job(
        2, image="ddiloco:new", synchronizer={"shards": 2, "storage": {"size": "9Gi"}}
    )
    plan = reconcile(resized, observe(resized, statefulset=have), fresh_token=TOKEN)
    (replace,) = [a for a in plan.actions if a.kind == "StatefulSet"]
    assert replace.verb == "replace"
    assert replace.body["spec"]["volumeClaimTemplates"] == have["spec"]["volumeClaimTemplates"]
    assert replace.body["spec"]["template"]["spec"]["containers"][0]["image"] == "ddiloco:new"


def test_the_synchronizer_is_ready_once_every_shard_is() -> None:
    job = make_job(2)
    sts = sync_workload.build_synchronizer_statefulset(job)
    sts["status"] = {"availableReplicas": 1}
    plan = reconcile(job, observe(job, statefulset=sts), fresh_token=TOKEN)
    assert plan.status is not None and plan.status.synchronizer is not None
    cond = next(x for x in plan.status.conditions if x.type == "SynchronizerReady")
    assert cond.status == "False" and "(1 of 2)" in cond.message
    assert (plan.status.synchronizer.shards, plan.status.synchronizer.available_shards) == (2, 1)
    sts["status"] = {"availableReplicas": 2}
    plan = reconcile(
        job, observe(job, statefulset=sts, sync_status={"global_version": 5}), fresh_token=TOKEN
    )
    assert plan.status is not None and plan.status.synchronizer is not None
    cond = next(x for x in plan.status.conditions if x.type == "SynchronizerReady")
    assert cond.status == "True" and "all 2 shard pods" in cond.message
    assert plan.status.global_version == 5
    assert plan.status.synchronizer.endpoint == ",".join(builders.shard_urls(job))


# --------------------------------------------------------------------------- status


def shard_status(shard: int, version: int, learner_tokens: int) -> dict[str, Any]:
    """A shard's /v1/status: one fragment (index = shard) and one learner row."""
    return Status(
        initialized=True,
        global_version=version,
        merges=version,
        tokens_merged=100 * version,
        contributions_merged=version,
        contributions_rejected=0,
        mean_contributors=1.0,
        mean_staleness=0.0,
        bytes_up=10,
        bytes_down=20,
        goodput=None,
        fragments=[
            {
                "index": shard,
                "merge": "rda",
                "version": version,
                "contributors_pending": 0,
                "tokens_merged": 100 * version,
                "shard": shard,
            }
        ],
        learners=[
            {
                "learner_id": "a-0",
                "alive": True,
                "incarnation": 1,
                "step": 5,
                "tokens_total": learner_tokens,
                "step_seconds": 0.1,
                "compute_seconds": 1.0,
                "uptime_seconds": 2.0,
                "contributions": version,
                "last_seen_s": 0.1,
            }
        ],
        xi={"step": 0.1, "quorum": None, "sync": None},
        shard=shard,
        shards=2,
    ).model_dump(mode="json")


class _Shard(BaseHTTPRequestHandler):
    answers: ClassVar[dict[str, dict[str, Any] | None]] = {}

    def do_GET(self) -> None:
        answer = self.answers.get(self.path.split("/v1/status")[0])
        body = json.dumps(answer).encode()
        self.send_response(200 if answer is not None else 503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def shard_server() -> Iterator[tuple[str, type[_Shard]]]:
    handler = type("Handler", (_Shard,), {"answers": {}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()


def test_the_job_status_merges_every_shards_answer(
    shard_server: tuple[str, type[_Shard]],
) -> None:
    base, handler = shard_server
    handler.answers["/sh/0"] = shard_status(0, 3, 1000)
    handler.answers["/sh/1"] = shard_status(1, 4, 1000)
    settings = OperatorSettings(
        shard_url_template=base + "/{name}/{shard}", status_poll_seconds=0.001
    )  # type: ignore[call-arg]
    reader = syncstatus.StatusReader(settings)
    job = make_job(2)
    assert reader.urls(job) == [f"{base}/sh/0", f"{base}/sh/1"]
    answer = reader.read(job, TOKEN)
    assert answer is not None
    assert (answer["global_version"], answer["merges"], answer["shards"]) == (7, 7, 2)
    assert [f["index"] for f in answer["fragments"]] == [0, 1]
    assert len(answer["learners"]) == 1  # one learner, seen by both shards
    handler.answers["/sh/1"] = None  # a shard that does not answer: no job-wide answer
    reader.forget(job.uid)
    assert reader.read(job, TOKEN) is None


def test_combine_passes_one_answer_and_falls_back_on_partial_ones() -> None:
    assert syncstatus.combine([{"global_version": 1}]) == {"global_version": 1}
    # answers that are not whole Status objects (a stub's): shard 0's
    assert syncstatus.combine([{"global_version": 1}, {"global_version": 2}]) == {
        "global_version": 1
    }


def test_the_synchronizer_keeps_room_for_the_jobs_learner_ids_and_no_more() -> None:
    """DDILOCO_MAX_LEARNERS: twice the slots (or dataParts, if more) and hot spares, plus 16,
    rounded up to a power of two (scaling within it keeps the synchronizer running); the
    tokens-per-step bound keeps the synchronizer's default (the spec knows no batch size)."""

    def env_of(job: api.DecoupledDiLoCoJob) -> dict[str, Any]:
        (ctr,) = sync_workload.build_synchronizer_statefulset(job)["spec"]["template"]["spec"][
            "containers"
        ]
        return env(ctr)

    job = make_job(1)  # one group of two (make_job's), no spares: 2 * 2 + 16 = 20 -> 32
    e = env_of(job)
    assert e["DDILOCO_MAX_LEARNERS"] == "32" and "DDILOCO_MAX_TOKENS_PER_STEP" not in e
    groups = [{"name": "a", "replicas": 300}, {"name": "b", "replicas": 100}]
    big = make_job(1, learnerGroups=groups, failurePolicy={"hotSpares": 4})
    assert env_of(big)["DDILOCO_MAX_LEARNERS"] == str(1024)  # 2 * (400 + 8) + 16 = 832
    scaled = make_job(1, learnerGroups=[{"name": "a", "replicas": 301}, groups[1]])
    assert env_of(scaled)["DDILOCO_MAX_LEARNERS"] == "1024"  # same: no rolling restart
    shards = make_job(1, training={"model": "tiny", "dataParts": 600})
    assert env_of(shards)["DDILOCO_MAX_LEARNERS"] == "2048"  # 2 * 600 + 16
    most = make_job(
        1,
        learnerGroups=[{"name": f"g{i}", "replicas": 512} for i in range(16)],
        failurePolicy={"hotSpares": 16},
    )
    cap = sync_workload.max_learners(most)
    assert 2 * (16 * 512 + 16 * 16) < cap <= 1 << 20  # within the synchronizer's bound
