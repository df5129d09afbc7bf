"""Pod template fields and the job's budget on a real control plane.

python tests/integration/k8senv.py build          # once per machine
.venv/bin/pytest tests/integration/test_operator_template.py

A job whose learner group mounts a PersistentVolumeClaim through its pod template, and sets
training.initFrom and training.totalTokens, gets learner and hot spare pods that carry the
claim and DDILOCO_INIT_FROM, and a synchronizer whose pods carry DDILOCO_TOTAL_TOKENS: the
apiserver admits every pod as built. A template that would override what the operator owns
is refused by the apiserver (CEL), naming the field.
"""

from __future__ import annotations

from typing import Any

import k8senv
import operator_helpers as h
import pytest
from kubernetes.client.exceptions import ApiException
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration

VOLUME = {"name": "corpus", "persistentVolumeClaim": {"claimName": "corpus", "readOnly": True}}
MOUNT = {"name": "corpus", "mountPath": "/data", "readOnly": True}


def _env(container: Any) -> dict[str, str | None]:
    return {e.name: e.value for e in container.env or []}


def test_template_volumes_and_the_budget_reach_every_pod(
    cl: h.Clusters, operator: h.Operator
) -> None:
    group = {
        "name": "a",
        "replicas": 2,
        "volumes": [VOLUME],
        "volumeMounts": [MOUNT],
        "env": [{"name": "HF_HOME", "value": "/data/hf"}],
    }
    training = {"model": "tiny", "initFrom": "/data/model", "totalTokens": 5_000_000}
    job = h.create_job(
        cl, h.job_manifest("tpl", [group], training=training, failurePolicy={"hotSpares": 1})
    )
    pods = k8senv.wait_until(
        "two learner pods and a spare",
        lambda: len(found := cl.pods("home", job)) == 3 and found,
        timeout=60,
    )
    for pod in pods:
        volumes = {v.name: v for v in pod.spec.volumes}
        assert volumes["corpus"].persistent_volume_claim.claim_name == "corpus"
        (container,) = pod.spec.containers
        mounts = {m.name: m for m in container.volume_mounts}
        assert mounts["corpus"].mount_path == "/data" and mounts["corpus"].read_only
        assert "token" in volumes and "token" in mounts  # the operator's, beside the user's
        env = _env(container)
        assert env["DDILOCO_INIT_FROM"] == "/data/model"
        assert env["HF_HOME"] == "/data/hf"
    sts = k8senv.wait_until(
        "the synchronizer StatefulSet",
        lambda: cl.apps().read_namespaced_stateful_set(f"{job}-synchronizer", cl.ns),
        timeout=30,
    )
    (container,) = sts.spec.template.spec.containers
    assert _env(container)["DDILOCO_TOTAL_TOKENS"] == "5000000"
    # the printer columns exist (empty until the synchronizer reports progress)
    out = cl.kubectl("get", "ddj", job).stdout
    assert "PROGRESS" in out and "REMAINING" in out


@pytest.mark.parametrize(
    ("group", "field", "needle"),
    [
        (
            {"env": [{"name": "DDILOCO_SYNC_URL", "value": "http://elsewhere:8470"}]},
            "spec.learnerGroups[0].env[0]",
            "env DDILOCO_SYNC_URL is set by the operator",
        ),
        (
            {"volumes": [VOLUME], "volumeMounts": [{"name": "corpus", "mountPath": "/dev/shm"}]},
            "spec.learnerGroups[0].volumeMounts[0]",
            "volumeMount mountPath /dev/shm is at or below a path the operator mounts",
        ),
        (
            {"volumes": [{"name": "token", "emptyDir": {}}]},
            "spec.learnerGroups[0].volumes[0]",
            "volume name token is a name the operator",
        ),
    ],
)
def test_a_template_overriding_an_owned_field_is_refused_naming_it(
    cl: h.Clusters, group: dict[str, Any], field: str, needle: str
) -> None:
    body = h.job_manifest("owned", [{"name": "a", "replicas": 1, **group}])
    with pytest.raises(ApiException) as refused:
        cl.custom().create_namespaced_custom_object(
            h.GROUP, h.VERSION, cl.ns, h.PLURAL, body, field_validation="Strict"
        )
    assert refused.value.status == 422, refused.value
    text = refused.value.body or ""
    assert field in text and needle in text, text
