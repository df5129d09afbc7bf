"""The operator on a real control plane: the CRD, the examples, and what the apiserver refuses.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_apply.py

Three clusters (home, region-a, region-b); the operator runs in a subprocess on home's
kubeconfig and reaches the regions only through kubeconfig Secrets (operator_helpers.py).
"""

from __future__ import annotations

import base64
from typing import Any

import operator_helpers as h
import pydantic
import pytest
import yaml
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

from ddiloco.operator import api

pytestmark = pytest.mark.integration


def env_of(pod: Any) -> dict[str, Any]:
    return {
        e.name: e.value if e.value is not None else e.value_from for e in pod.spec.containers[0].env
    }


def test_three_cluster_example_becomes_ready(cl: h.Clusters, operator: h.Operator) -> None:
    h.kubeconfig_secret(cl, "region-a-kubeconfig", "region-a")
    h.kubeconfig_secret(cl, "region-b-kubeconfig", "region-b")
    cl.pvs.append(h.state_volume(cl, "three-regions"))
    cl.kubectl("apply", "-f", str(h.EXAMPLES / "three-clusters.yaml"))

    job, took = h.timed(lambda: h.wait_condition(cl, "three-regions", "Ready", timeout=90))
    status = job["status"]
    assert status["phase"] == "Running", status
    assert (status["readyLearners"], status["desiredLearners"]) == (4, 4)
    assert {g["name"]: (g["ready"], g["cluster"]) for g in status["groups"]} == {
        "region-a": (2, "region-a-kubeconfig"),
        "region-b": (2, "region-b-kubeconfig"),
    }
    assert status["observedGeneration"] == job["metadata"]["generation"]
    assert h.condition(job, "SynchronizerReady")["reason"] == "SynchronizerAvailable"
    print(f"three-cluster example Ready in {took:.1f}s")

    # home: the synchronizer's StatefulSet, Services and claim, and the token Secret
    dep = cl.apps().read_namespaced_stateful_set("three-regions-synchronizer", cl.ns)
    assert dep.spec.replicas == 1 and dep.spec.update_strategy.type == "RollingUpdate"
    assert dep.spec.service_name == "three-regions-synchronizer-shards"
    container = dep.spec.template.spec.containers[0]
    assert container.command == ["ddiloco", "synchronizer"]
    env = {e.name: e for e in container.env}
    assert env["DDILOCO_QUORUM"].value == "2" and env["DDILOCO_MERGE"].value == "rda"
    assert env["DDILOCO_MERGE_SCALE"].value == "live"
    # the token as a mounted file (it rotates without a restart); TLS: test_operator_tls.py
    assert env["DDILOCO_TOKEN_FILE"].value == "/var/run/ddiloco/token/token"
    assert "DDILOCO_TOKEN" not in env
    assert env["DDILOCO_UPLOAD_PORT"].value == "8471"  # the upload port, HTTP/1.1 over TLS
    assert [(p.name, p.container_port) for p in container.ports] == [
        ("http", 8470),
        ("upload", 8471),
    ]
    svc = cl.core().read_namespaced_service("three-regions-synchronizer", cl.ns)
    assert [(p.name, p.port, p.app_protocol) for p in svc.spec.ports] == [
        ("http", 8470, "https"),
        ("upload", 8471, "https"),
    ]
    claim = cl.core().read_namespaced_persistent_volume_claim(
        "state-three-regions-synchronizer-0", cl.ns
    )  # the StatefulSet's, for its shard 0
    assert claim.status.phase == "Bound"
    token = cl.core().read_namespaced_secret("three-regions-token", cl.ns).data["token"]
    assert len(base64.b64decode(token)) >= 32
    assert not cl.pods("home", "three-regions")  # no learners at home in this example

    # regions: two learner pods each, with stable ids, each holding its own credential only
    seen = set()
    for region in ("region-a", "region-b"):
        pods = cl.pods(region, "three-regions")
        assert sorted(h.untagged(p.metadata.name) for p in pods) == [
            f"three-regions-{region}-0",
            f"three-regions-{region}-1",
        ]
        for p in pods:
            env = env_of(p)
            assert p.spec.restart_policy == "Never"
            assert p.spec.containers[0].command == ["ddiloco", "learner"]
            assert p.spec.containers[0].resources.limits["nvidia.com/gpu"] == "1"
            assert p.spec.node_name.startswith(region)  # scheduled onto that region's nodes
            assert env["DDILOCO_SYNC_URL"] == "https://ddiloco-sync.home.example.com:8470"
            assert env["DDILOCO_LEARNER_ID"] == p.metadata.labels["ddiloco.dev/learner-id"]
            assert env["DDILOCO_NUM_LEARNERS"] == "4" and env["DDILOCO_P"] == "24"
            seen.add(int(env["DDILOCO_LEARNER_INDEX"]))
            h.check_own_credential(cl, region, "three-regions", p)
        # the job key stays home: a region holds its learners' credentials, nothing more
        creds, items = h.learner_credentials(cl, region, "three-regions", region)
        there = h.job_secret_names(cl, region, "three-regions")
        assert creds in there and "three-regions-token" not in there, there
        assert sorted(items) == [f"{region}-0", f"{region}-1"]
        assert base64.b64decode(token).decode() not in "".join(items.values())
    assert seen == {0, 1, 2, 3}  # one data part each

    out = cl.kubectl("get", "ddj", "three-regions").stdout
    assert "Running" in out.splitlines()[1] and "4" in out.splitlines()[1], out


def test_tiny_cpu_example_runs_at_home(cl: h.Clusters, operator: h.Operator) -> None:
    cl.pvs.append(h.state_volume(cl, "tiny-cpu"))
    cl.kubectl("apply", "-f", str(h.EXAMPLES / "tiny-cpu.yaml"))
    job = h.wait_condition(cl, "tiny-cpu", "Ready", timeout=60)
    assert job["status"]["readyLearners"] == 2
    pods = cl.pods("home", "tiny-cpu")
    assert {h.untagged(p.metadata.name) for p in pods} == {"tiny-cpu-cpu-0", "tiny-cpu-cpu-1"}
    owner = pods[0].metadata.owner_references[0]
    assert (owner.kind, owner.name) == ("DecoupledDiLoCoJob", "tiny-cpu")
    assert env_of(pods[0])["DDILOCO_SYNC_URL"] == f"https://tiny-cpu-synchronizer.{cl.ns}.svc:8470"


INVALID = [
    (
        "quorum above the replicas",
        {"synchronizer": {"quorum": 5}},
        "synchronizer.quorum must not exceed the total replicas of learnerGroups",
    ),
    ("no image", {"image": None}, "spec.image: Required value"),
    (
        "negative replicas",
        {"learnerGroups": [{"name": "a", "replicas": -1}]},
        "should be greater than or equal to 0",
    ),
    ("unknown field", {"gpusPlease": 8}, 'unknown field "spec.gpusPlease"'),
    (
        "H not divisible by P",
        {"training": {"model": "tiny", "innerSteps": 10, "fragments": 4}},
        "training.innerSteps (H) must be a multiple of training.fragments (P)",
    ),
    (
        "model and modelEntry",
        {"training": {"model": "tiny", "modelEntry": "a.b:c"}},
        "set exactly one of training.model",
    ),
    (
        "a decaying schedule without a budget",
        {"training": {"model": "tiny", "schedule": {"decay": "cosine"}}},
        "training.schedule.decay decays over a budget",
    ),
    (
        "a tokenizer with a model entry",
        {"training": {"modelEntry": "a.b:c", "tokenizer": "/t"}},
        "training.tokenizer and training.sequenceLength are not used with training.modelEntry",
    ),
    (
        "an unknown precision",
        {"training": {"model": "tiny", "precision": "fp8"}},
        'spec.training.precision: Unsupported value: "fp8"',
    ),
    (
        "remote group without syncUrl",
        {
            "learnerGroups": [
                {"name": "r", "replicas": 1, "cluster": {"kubeconfigSecret": {"name": "k"}}}
            ]
        },
        "a learner group in another cluster needs a syncUrl",
    ),
]


def test_every_training_setting_is_admitted(cl: h.Clusters) -> None:
    """The training settings at their bounds pass the apiserver's schema and rules as typed."""
    body = h.job_manifest("settings", [{"name": "a", "replicas": 1}])
    body["spec"]["training"] = {
        "model": "hf:/models/m", "data": "/data/tokens", "tokenizer": "/models/m",
        "dataField": "content", "sequenceLength": 4096, "batchSize": 16,
        "gradientAccumulation": 8, "precision": "bf16", "parallel": "fsdp2",
        "seed": 4294967295, "totalTokens": 20_000_000_000,
        "innerOptimizer": {"learningRate": 3e-4, "weightDecay": 0.1, "beta1": 0.9,
                           "beta2": 0.95, "gradientClip": 1.0},
        "schedule": {"warmupSteps": 1000, "decay": "wsd", "decayFraction": 0.2, "minRatio": 0.1},
    }  # fmt: skip
    cl.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))
    stored = cl.job("settings")["spec"]["training"]
    assert stored["seed"] == 4294967295 and stored["schedule"]["decay"] == "wsd"
    assert stored["innerOptimizer"]["beta2"] == 0.95


@pytest.mark.parametrize(("what", "spec", "message"), INVALID, ids=[i[0] for i in INVALID])
def test_invalid_jobs_are_refused_with_the_rules_message(
    cl: h.Clusters, what: str, spec: dict[str, Any], message: str
) -> None:
    body = h.job_manifest("bad", [{"name": "a", "replicas": 2}])
    for key, value in spec.items():
        if value is None:
            body["spec"].pop(key)
        else:
            body["spec"][key] = value
    done = cl.kubectl("apply", "-f", "-", input=yaml.safe_dump(body), check=False)
    assert done.returncode != 0, f"{what}: accepted"
    assert message in done.stderr, done.stderr
    assert "bad" not in cl.kubectl("get", "ddj", "-o", "name").stdout
    # the operator's own check of a body that skipped the apiserver's: the same rule, the
    # same words (operator/rules.py evaluates the CRD's CEL), unless the schema refuses it
    try:
        job = api.DecoupledDiLoCoJob.from_body({**body, "metadata": {"name": "bad", "uid": "u"}})
    except pydantic.ValidationError:
        return  # a type or bound: the models refuse it before any rule runs
    assert any(message in p for p in api.validate(job.spec)), api.validate(job.spec)


def test_managed_by_is_immutable(cl: h.Clusters) -> None:
    body = h.job_manifest(
        "kueued", [{"name": "a", "replicas": 1}], managedBy="kueue.x-k8s.io/multikueue"
    )
    h.create_job(cl, body, volume=False)
    done = cl.kubectl(
        "patch",
        "ddj",
        "kueued",
        "--type=merge",
        "-p",
        '{"spec": {"managedBy": "ddiloco.dev/operator"}}',
        check=False,
    )
    assert done.returncode != 0 and "managedBy is immutable" in done.stderr


def test_a_job_managed_by_another_controller_is_left_alone(
    cl: h.Clusters, operator: h.Operator
) -> None:
    h.create_job(
        cl,
        h.job_manifest(
            "elsewhere", [{"name": "a", "replicas": 1}], managedBy="kueue.x-k8s.io/multikueue"
        ),
        volume=False,
    )
    h.create_job(cl, h.job_manifest("here", [{"name": "a", "replicas": 1}]))
    h.wait_condition(cl, "here", "Ready")  # the operator is working on this namespace...
    job = cl.job("elsewhere")  # ...and has not touched the other job
    assert "status" not in job or not job["status"]
    assert not cl.pods("home", "elsewhere")
    assert not job["metadata"].get("finalizers")
