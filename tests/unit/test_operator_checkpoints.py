"""`spec.checkpoints` and `training.initFrom` reach the synchronizer; bad ones are refused.

    .venv/bin/pytest tests/unit/test_operator_checkpoints.py

The pure builders put the checkpoint settings and initFrom in the synchronizer pod's
environment, under the names the synchronizer's settings read (synchronizer/config.py), and
leave them out of a job without them; `validate()` repeats the CRD's rules on checkpoints
(tests/integration/test_operator_checkpoints.py has the apiserver's side).
"""

from __future__ import annotations

from typing import Any

import pytest

from ddiloco.operator import api, sync_workload
from ddiloco.synchronizer.config import SyncSettings
from tests.unit.test_operator_template import env_of, make_job

VOLUME = {"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}}
MOUNT = {"name": "ckpt", "mountPath": "/ckpt"}


def sync_env(job: api.DecoupledDiLoCoJob) -> dict[str, Any]:
    sts = sync_workload.build_synchronizer_statefulset(job)
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return env_of(container)


def test_checkpoints_and_init_from_reach_the_synchronizer_as_its_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = make_job(
        training={"model": "tiny", "initFrom": "/ckpt/latest-run"},
        synchronizer={
            "volumes": [VOLUME],
            "volumeMounts": [MOUNT],
            "envFrom": [{"secretRef": {"name": "s3-creds"}}],
        },
        checkpoints={"path": "/ckpt/run-1", "everyVersions": 50, "everySeconds": 600, "keep": 4},
    )
    assert api.validate(job.spec) == []
    env = sync_env(job)
    assert env["DDILOCO_CHECKPOINT_DEST"] == "/ckpt/run-1"
    assert env["DDILOCO_CHECKPOINT_EVERY_VERSIONS"] == "50"
    assert env["DDILOCO_CHECKPOINT_EVERY_SECONDS"] == "600.0"
    assert env["DDILOCO_CHECKPOINT_KEEP"] == "4"
    assert env["DDILOCO_INIT_FROM"] == "/ckpt/latest-run"
    sts = sync_workload.build_synchronizer_statefulset(job)
    pod = sts["spec"]["template"]["spec"]
    assert {"name": "ckpt", "mountPath": "/ckpt"} in pod["containers"][0]["volumeMounts"]
    assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    # the synchronizer reads them as the settings they are meant to be
    for k, v in env.items():
        if isinstance(v, str):
            monkeypatch.setenv(k, v)
    monkeypatch.setenv("DDILOCO_TOKEN", "t")
    settings = SyncSettings()
    assert settings.checkpoint_dest == "/ckpt/run-1" and settings.checkpoint_keep == 4
    assert settings.checkpoint_every_versions == 50 and settings.checkpoint_every_seconds == 600
    assert settings.init_from == "/ckpt/latest-run"

    url = make_job(checkpoints={"url": "s3://bucket/run-2", "everySeconds": 60})
    env = sync_env(url)
    assert env["DDILOCO_CHECKPOINT_DEST"] == "s3://bucket/run-2"
    assert "DDILOCO_CHECKPOINT_EVERY_VERSIONS" not in env and env["DDILOCO_CHECKPOINT_KEEP"] == "3"
    plain = sync_env(make_job())
    assert not any(k.startswith("DDILOCO_CHECKPOINT_") for k in plain)
    assert "DDILOCO_INIT_FROM" not in plain
    # shards leave initFrom to the learners' init upload (no shard holds a whole checkpoint)
    sharded = make_job(
        training={"model": "tiny", "initFrom": "/models/x", "fragments": 2},
        synchronizer={"shards": 2},
    )
    assert "DDILOCO_INIT_FROM" not in sync_env(sharded)


@pytest.mark.parametrize(
    ("checkpoints", "spec", "needle"),
    [
        ({"path": "relative/dir", "everyVersions": 1}, {}, api.CHECKPOINT_PATH_MESSAGE),
        (
            {"path": "/ckpt", "url": "s3://b/p", "everyVersions": 1},
            {},
            api.CHECKPOINT_DEST_MESSAGE,
        ),
        ({"everyVersions": 1}, {}, api.CHECKPOINT_DEST_MESSAGE),
        ({"path": "/var/lib/ddiloco/ckpt", "everyVersions": 1}, {}, "at or below a path"),
        ({"path": "/dev/shm", "everyVersions": 1}, {}, "at or below a path"),
        ({"path": "/ckpt"}, {}, api.CHECKPOINT_PERIOD_MESSAGE),
        (
            {"path": "/ckpt", "everyVersions": 1},
            {"synchronizer": {"shards": 2}},
            api.CHECKPOINT_SHARDS_MESSAGE,
        ),
    ],
)
def test_validate_refuses_bad_checkpoints(
    checkpoints: dict[str, Any], spec: dict[str, Any], needle: str
) -> None:
    job = make_job(checkpoints=checkpoints, **spec)
    problems = api.validate(job.spec)
    assert any(needle in p for p in problems), problems


def test_the_crd_carries_the_checkpoint_rules() -> None:
    import yaml

    from ddiloco.operator import crd

    messages: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            messages.extend(r.get("message", "") for r in node.get("x-kubernetes-validations", []))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(yaml.safe_load(crd.render()))
    for message in (
        api.CHECKPOINT_DEST_MESSAGE,
        api.CHECKPOINT_PATH_MESSAGE,
        api.CHECKPOINT_OWNED_MESSAGE,
        api.CHECKPOINT_PERIOD_MESSAGE,
        api.CHECKPOINT_SHARDS_MESSAGE,
    ):
        assert message in messages, message
