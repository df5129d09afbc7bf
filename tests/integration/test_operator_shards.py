"""Synchronizer shards on a real control plane: StatefulSet, Services, claims, CRD.

python tests/integration/k8senv.py build          # once per machine
.venv/bin/pytest tests/integration/test_operator_shards.py

- a job with synchronizer.shards 2 gets a StatefulSet of 2 pods (kwok runs them), a headless
  Service, one claim per shard; learners get both shards' URLs in order, and both sides the
  job's update encoding; the job status merges the shards' answers; deleting the job leaves
  nothing, claims included;
- the apiserver refuses a change of shards or updateEncoding on an existing job (`kubectl
  apply`), and bad values (shards 0, encoding int3, one syncUrl for 2 shards), each with its
  message;
- Services with the "http" port only get the "upload" port (a patch of their ports,
  clusterIP kept), and a settled job's Services are not written again.
"""

from __future__ import annotations

import json
from typing import Any

import k8senv
import operator_helpers as h
import pytest
from kubernetes.client.exceptions import ApiException
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)
from prometheus_client.parser import text_string_to_metric_families

from ddiloco.operator import api

pytestmark = pytest.mark.integration
POD_INDEX = "apps.kubernetes.io/pod-index"
SYNC_PODS = "ddiloco.dev/job={job},app.kubernetes.io/component=synchronizer"


def gone(call: Any) -> bool:
    try:
        call()
    except ApiException as e:
        return e.status == 404
    return False


def env_of(container: Any) -> dict[str, Any]:
    return {e.name: e.value if e.value_from is None else e.value_from for e in container.env}


def test_two_shards_are_a_statefulset_with_a_headless_service_and_a_claim_each(
    cl: h.Clusters, operator: h.Operator
) -> None:
    body = h.job_manifest("shd", [{"name": "a", "replicas": 2}], updateEncoding="int4")
    body["spec"]["synchronizer"].update(shards=2, tls={"enabled": False})
    job = h.create_job(cl, body)  # and a volume for each shard's claim
    ready = h.wait_condition(cl, job, "Ready", timeout=60)
    sync = f"{job}-synchronizer"

    sts = cl.apps().read_namespaced_stateful_set(sync, cl.ns)
    assert sts.spec.replicas == 2 and sts.spec.service_name == f"{sync}-shards"
    assert sts.spec.persistent_volume_claim_retention_policy.when_deleted == "Delete"
    env = env_of(sts.spec.template.spec.containers[0])
    assert (env["DDILOCO_SHARDS"], env["DDILOCO_UPDATE_ENCODINGS"]) == ("2", "int4")
    assert env["DDILOCO_UPLOAD_PORT"] == "8471"
    assert env["DDILOCO_SHARD"].field_ref.field_path == f"metadata.labels['{POD_INDEX}']"
    pods = (
        cl.core()
        .list_namespaced_pod(
            cl.ns, label_selector=f"ddiloco.dev/job={job},app.kubernetes.io/component=synchronizer"
        )
        .items
    )
    # the label DDILOCO_SHARD comes from, as the StatefulSet controller set it
    assert sorted((p.metadata.name, p.metadata.labels[POD_INDEX]) for p in pods) == [
        (f"{sync}-0", "0"),
        (f"{sync}-1", "1"),
    ]
    assert all(p.status.phase == "Running" for p in pods)
    headless = cl.core().read_namespaced_service(f"{sync}-shards", cl.ns)
    assert headless.spec.cluster_ip == "None"
    assert not headless.spec.publish_not_ready_addresses
    service = cl.core().read_namespaced_service(sync, cl.ns)
    assert service.spec.selector[POD_INDEX] == "0"  # the ClusterIP Service: shard 0 only
    for svc in (headless, service):  # the upload port beside the main one (plain HTTP/1.1)
        assert [(p.name, p.port, p.target_port, p.app_protocol) for p in svc.spec.ports] == [
            ("http", 8470, "http", "kubernetes.io/h2c"),
            ("upload", 8471, "upload", "http"),
        ]
    for i in range(2):
        claim = cl.core().read_namespaced_persistent_volume_claim(f"state-{sync}-{i}", cl.ns)
        assert claim.status.phase == "Bound"
        assert claim.metadata.labels["ddiloco.dev/job-uid"] == cl.job(job)["metadata"]["uid"]
        # whenDeleted: Delete makes the StatefulSet the claim's owner
        assert [r.kind for r in claim.metadata.owner_references or []] == ["StatefulSet"]

    urls = [f"http://{sync}-{i}.{sync}-shards.{cl.ns}.svc:8470" for i in range(2)]
    for pod in cl.pods("home", job):
        learner_env = env_of(pod.spec.containers[0])
        assert learner_env["DDILOCO_SYNC_URL"] == ",".join(urls)  # in shard order
        assert learner_env["DDILOCO_UPDATE_ENCODING"] == "int4"

    # the status merges both shards' answers (the stub: shard i owns fragment i at version
    # i + 1, wire/job_status.merge_statuses adds them up)
    status = ready["status"]
    assert status["globalVersion"] == 1 + 2, status
    assert status["synchronizer"]["shards"] == 2
    assert status["synchronizer"]["availableShards"] == 2
    assert status["synchronizer"]["endpoint"] == ",".join(urls)

    cl.custom().delete_namespaced_custom_object(h.GROUP, h.VERSION, cl.ns, h.PLURAL, job)
    k8senv.wait_until("the job to go", lambda: gone(lambda: cl.job(job)), timeout=30)
    assert gone(lambda: cl.apps().read_namespaced_stateful_set(sync, cl.ns))
    assert gone(lambda: cl.core().read_namespaced_service(f"{sync}-shards", cl.ns))
    k8senv.wait_until(
        "both claims to go",
        lambda: (
            not [
                c
                for c in cl.core().list_namespaced_persistent_volume_claim(cl.ns).items
                if c.metadata.name.startswith(f"state-{sync}-")
            ]
        ),
        timeout=30,
    )
    assert cl.core().list_namespaced_pod(cl.ns, label_selector=f"ddiloco.dev/job={job}").items == []


def apply(cl: h.Clusters, body: dict[str, Any]) -> tuple[int, str]:
    out = cl.kubectl("apply", "-f", "-", input=json.dumps(body), check=False)
    return out.returncode, out.stderr


def test_changing_shards_or_the_encoding_is_refused_by_the_apiserver(cl: h.Clusters) -> None:
    body = h.job_manifest("fixed", [{"name": "a", "replicas": 1}])  # shards unset: 1
    rc, err = apply(cl, body)
    assert rc == 0, err
    two = json.loads(json.dumps(body))
    two["spec"]["synchronizer"]["shards"] = 2
    rc, err = apply(cl, two)
    assert rc != 0 and api.SHARDS_IMMUTABLE_MESSAGE in err, err
    int4 = json.loads(json.dumps(body))
    int4["spec"]["updateEncoding"] = "int4"
    rc, err = apply(cl, int4)
    assert rc != 0 and api.ENCODING_IMMUTABLE_MESSAGE in err, err
    # the same values are fine on a new job, and an unrelated change still is on this one
    assert cl.job("fixed")["spec"]["synchronizer"]["shards"] == 1
    other = json.loads(json.dumps(body))
    other["spec"]["learnerGroups"][0]["replicas"] = 2
    rc, err = apply(cl, other)
    assert rc == 0, err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"synchronizer": {"shards": 0}}, "spec.synchronizer.shards: Invalid value: 0"),
        ({"synchronizer": {"shards": api.MAX_SHARDS + 1}}, "spec.synchronizer.shards"),
        ({"updateEncoding": "int3"}, 'spec.updateEncoding: Unsupported value: "int3"'),
        (
            {
                "synchronizer": {"shards": 2},
                "learnerGroups": [
                    {
                        "name": "r",
                        "cluster": {"kubeconfigSecret": {"name": "r-kubeconfig"}},
                        "syncUrl": "https://one.example:8470",
                    }
                ],
            },
            api.SYNC_URLS_MESSAGE,
        ),
    ],
    ids=["shards-0", "shards-too-many", "encoding-int3", "one-url-two-shards"],
)
def test_bad_values_are_refused_by_the_crd(
    cl: h.Clusters, change: dict[str, Any], message: str
) -> None:
    body = h.job_manifest("bad", [{"name": "a", "replicas": 1}], **change)
    with pytest.raises(ApiException) as e:
        cl.custom().create_namespaced_custom_object(h.GROUP, h.VERSION, cl.ns, h.PLURAL, body)
    assert e.value.status == 422
    assert message in json.loads(e.value.body)["message"]


def reconciles(op: h.Operator, namespace: str, job: str) -> float:
    """How many reconciles of the job the operator finished (its /metrics)."""
    ours = {"namespace": namespace, "job": job, "result": "ok"}
    return sum(
        s.value
        for f in text_string_to_metric_families(op.scrape())
        for s in f.samples
        if s.name == "ddiloco_operator_reconciles_total" and ours.items() <= s.labels.items()
    )


def ports_of(svc: Any) -> list[tuple[str, int, Any, str]]:
    return [(p.name, p.port, p.target_port, p.app_protocol) for p in svc.spec.ports]


def test_services_missing_the_upload_port_get_it(cl: h.Clusters, operator: h.Operator) -> None:
    body = h.job_manifest("ports", [{"name": "a", "replicas": 1}])
    body["spec"]["synchronizer"]["tls"] = {"enabled": False}
    job = h.create_job(cl, body)
    h.wait_condition(cl, job, "SynchronizerReady", timeout=60)
    names = [f"{job}-synchronizer", f"{job}-synchronizer-shards"]
    want = [("http", 8470, "http", "kubernetes.io/h2c"), ("upload", 8471, "upload", "http")]
    core = cl.core()
    # Services with "http" only: stop the operator, take "upload" out of both, then start it
    # again. The headless one
    # also gets a port nobody wants, which must go (the ports are replaced, not merged).
    operator.stop()
    stale = {"name": "stale", "port": 9000, "targetPort": 9000, "protocol": "TCP"}
    before = {}
    for name in names:
        assert ports_of(core.read_namespaced_service(name, cl.ns)) == want
        drop: list[dict[str, Any]] = [
            {"op": "test", "path": "/spec/ports/1/name", "value": "upload"},
            {"op": "remove", "path": "/spec/ports/1"},
        ]
        if name.endswith("-shards"):
            drop.append({"op": "add", "path": "/spec/ports/-", "value": stale})
        before[name] = core.patch_namespaced_service(name, cl.ns, drop)  # a JSON patch
        assert ports_of(before[name])[0] == want[0] and len(before[name].spec.ports) <= 2
    operator.start()

    def patched() -> dict[str, Any] | None:
        got = {name: core.read_namespaced_service(name, cl.ns) for name in names}
        return got if all(ports_of(svc) == want for svc in got.values()) else None

    after = k8senv.wait_until("the upload port on both Services", patched, timeout=30)
    for name in names:
        old, new = before[name].spec, after[name].spec
        assert after[name].metadata.uid == before[name].metadata.uid  # patched, not re-created
        assert (new.cluster_ip, new.cluster_ips, new.type, new.selector) == (
            old.cluster_ip,
            old.cluster_ips,
            old.type,
            old.selector,
        )
    events = core.list_namespaced_event(cl.ns, field_selector=f"involvedObject.name={job}")
    assert "ServicePortsUpdated" in {e.reason for e in events.items}
    # settled: the reconciles that follow (one each RESYNC_S) write neither Service again
    done = reconciles(operator, cl.ns, job)
    k8senv.wait_until("3 more reconciles", lambda: reconciles(operator, cl.ns, job) >= done + 3)
    for name in names:
        again = core.read_namespaced_service(name, cl.ns)
        assert again.metadata.resource_version == after[name].metadata.resource_version, name
    assert "Could not patch" not in operator.log.read_text(errors="replace")
