"""`spec.checkpoints` and `training.initFrom` on a real control plane.

python tests/integration/k8senv.py build          # once per machine
.venv/bin/pytest tests/integration/test_operator_checkpoints.py

A job whose synchronizer mounts the user's volume through its pod template and names it in
`spec.checkpoints` gets a synchronizer StatefulSet whose pods carry the checkpoint settings
and DDILOCO_INIT_FROM (synchronizer/checkpoints.py reads them), beside the user's volume and
envFrom. A checkpoint destination the synchronizer could not use is refused by the apiserver
(CEL), naming the rule.
"""

from __future__ import annotations

from typing import Any

import k8senv
import operator_helpers as h
import pytest
from kubernetes.client.exceptions import ApiException
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

from ddiloco.operator import api

pytestmark = pytest.mark.integration

VOLUME = {"name": "ckpt", "persistentVolumeClaim": {"claimName": "my-checkpoints"}}
MOUNT = {"name": "ckpt", "mountPath": "/ckpt"}


def test_checkpoint_settings_and_init_from_reach_the_synchronizer(
    cl: h.Clusters, operator: h.Operator
) -> None:
    synchronizer = {
        "storage": {"size": "1Gi", "storageClassName": ""},
        "volumes": [VOLUME],
        "volumeMounts": [MOUNT],
        "envFrom": [{"secretRef": {"name": "s3-creds"}}],
    }
    job = h.create_job(
        cl,
        h.job_manifest(
            "ckpt",
            [{"name": "a", "replicas": 1, "volumes": [VOLUME], "volumeMounts": [MOUNT]}],
            training={"model": "tiny", "initFrom": "/ckpt/run-0/latest-ckpt"},
            synchronizer=synchronizer,
            checkpoints={"path": "/ckpt/run-1", "everyVersions": 100, "keep": 5},
        ),
    )
    sts = k8senv.wait_until(
        "the synchronizer StatefulSet",
        lambda: cl.apps().read_namespaced_stateful_set(f"{job}-synchronizer", cl.ns),
        timeout=30,
    )
    (container,) = sts.spec.template.spec.containers
    env = {e.name: e.value for e in container.env or []}
    assert env["DDILOCO_CHECKPOINT_DEST"] == "/ckpt/run-1"
    assert env["DDILOCO_CHECKPOINT_EVERY_VERSIONS"] == "100"
    assert env["DDILOCO_CHECKPOINT_KEEP"] == "5"
    assert "DDILOCO_CHECKPOINT_EVERY_SECONDS" not in env
    assert env["DDILOCO_INIT_FROM"] == "/ckpt/run-0/latest-ckpt"
    mounts = {m.name: m.mount_path for m in container.volume_mounts}
    assert mounts["ckpt"] == "/ckpt" and "state" in mounts  # the user's, beside the operator's
    volumes = {v.name: v for v in sts.spec.template.spec.volumes}
    assert volumes["ckpt"].persistent_volume_claim.claim_name == "my-checkpoints"
    assert [s.secret_ref.name for s in container.env_from] == ["s3-creds"]


@pytest.mark.parametrize(
    ("checkpoints", "sync", "needle"),
    [
        ({"path": "ckpt/run", "everyVersions": 10}, {}, api.CHECKPOINT_PATH_MESSAGE),
        (
            {"path": "/ckpt", "url": "s3://bucket/run", "everyVersions": 10},
            {},
            api.CHECKPOINT_DEST_MESSAGE,
        ),
        ({"path": "/var/lib/ddiloco/ckpt", "everyVersions": 10}, {}, "checkpoints.path is at or"),
        ({"url": "s3://bucket/run"}, {}, api.CHECKPOINT_PERIOD_MESSAGE),
        (
            {"url": "s3://bucket/run", "everySeconds": 60},
            {"shards": 2},
            "checkpoints need synchronizer.shards 1",
        ),
    ],
)
def test_a_checkpoint_destination_that_cannot_work_is_refused(
    cl: h.Clusters, checkpoints: dict[str, Any], sync: dict[str, Any], needle: str
) -> None:
    body = h.job_manifest(
        "badckpt",
        [{"name": "a", "replicas": 1}],
        training={"model": "tiny", "fragments": 2, "innerSteps": 24},
        checkpoints=checkpoints,
    )
    body["spec"]["synchronizer"].update(sync)
    with pytest.raises(ApiException) as refused:
        cl.custom().create_namespaced_custom_object(
            h.GROUP, h.VERSION, cl.ns, h.PLURAL, body, field_validation="Strict"
        )
    assert refused.value.status == 422, refused.value
    text = refused.value.body or ""
    assert needle in text, text
