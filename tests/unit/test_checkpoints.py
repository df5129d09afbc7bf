"""Checkpoints (synchronizer/checkpoints.py): their format, retention, failures, and a
synchronizer started from one, in-process on real files.

    pytest tests/unit/test_checkpoints.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddiloco.synchronizer import checkpoints
from ddiloco.synchronizer.checkpoints import CheckpointError
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.service import SyncError, Synchronizer
from ddiloco.wire import codec
from ddiloco.wire.errors import Refusal
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    Heartbeat,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

LAYOUT = Layout(
    fragments=[
        FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[4])]),
        FragmentSpec(index=1, tensors=[TensorSpec(name="v", shape=[2, 3])]),
    ]
)
START = {"w": torch.linspace(-1.0, 1.0, 4), "v": torch.arange(6.0).view(2, 3) / 10}


def make(state: Path, **kw: object) -> Synchronizer:
    base: dict[str, object] = {
        "token": "t",
        "state_dir": state,
        "quorum": 1,
        "grace": False,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,  # a momentum that is not zero after a merge
        "max_update_ratio": 10.0,
        "snapshot_lag": 0,
    }
    return Synchronizer(SyncSettings(**(base | kw)))  # type: ignore[arg-type]


def init(sync: Synchronizer, layout: Layout = LAYOUT, tensors: dict | None = None) -> None:
    sync.join(JoinRequest(learner_id="a", layout_digest=layout.digest()))
    payload = codec.encode(tensors or START, {LAYOUT_KEY: layout.model_dump_json()})
    sync.init(payload)


def merge_round(sync: Synchronizer, step: int) -> None:
    """One update of learner a on every fragment, merged."""
    versions = sync.versions()
    sync.heartbeat(
        Heartbeat(
            learner_id="a",
            step=step,
            steps=[step, step],
            tokens=[100, 100],
            base_versions=versions,
            step_seconds=1.0,
        )
    )
    for p, name in enumerate(["w", "v"]):
        delta = torch.full_like(START[name], 0.05 * (p + 1) * step)
        meta = UpdateMeta(
            learner_id="a",
            fragment=p,
            base_version=versions[p],
            steps=10,
            tokens=100,
            learner_step=step,
        )
        assert sync.submit(codec.encode({name: delta}, meta.to_metadata())).status == "accepted"
        assert sync.merge(p) == versions[p] + 1


def state(sync: Synchronizer) -> dict[str, torch.Tensor]:
    out = {}
    for p in sync.owned:
        fs = sync.fragments[p].state
        out |= {f"param/{k}": v.clone() for k, v in fs.params.items()}
        out |= {f"momentum/{k}": v.clone() for k, v in fs.momentum.items()}
    return out


def test_a_checkpoint_is_a_model_dir_and_the_outer_state_and_a_new_job_resumes_it(
    tmp_path: Path,
) -> None:
    sync = make(tmp_path / "state")
    init(sync)
    for step in (10, 20, 30):
        merge_round(sync, step)
    held, versions = state(sync), sync.versions()
    assert versions == [3, 3]
    assert any(v.abs().sum() > 0 for k, v in held.items() if k.startswith("momentum/"))
    dest = tmp_path / "ckpt"
    snap = checkpoints.take_snapshot(sync)
    assert snap is not None
    out = checkpoints.write_checkpoint(snap, str(dest), keep=3)
    sync.close()

    root = dest / str(out.name)
    assert checkpoints.NAME.match(root.name) and root.name.endswith("-v000000000006")
    assert (dest / "latest").read_text().strip() == root.name
    manifest = json.loads((root / checkpoints.MANIFEST).read_text())
    assert manifest["format_version"] == 1 and manifest["global_version"] == 6
    assert Layout.model_validate(manifest["layout"]).digest() == LAYOUT.digest()
    assert [f["version"] for f in manifest["fragments"]] == [3, 3]
    # (a) a model directory: the parameters by name (no model spec: the plain writer)
    weights = load_file(str(root / "model.safetensors"))
    assert weights.keys() == {"w", "v"}
    assert all(torch.equal(weights[k], held[f"param/{k}"]) for k in weights)
    assert json.loads((root / "config.json").read_text())["kind"] == "unknown"
    # (b) the outer state, exactly as merged
    outer = load_file(str(root / "outer" / "fragment-0000.safetensors"))
    outer |= load_file(str(root / "outer" / "fragment-0001.safetensors"))
    assert outer.keys() == held.keys()
    assert all(torch.equal(outer[k], held[k]) for k in held)

    # a new job, fresh state dir, from the destination (its `latest`): initialized at start
    resumed = make(tmp_path / "state2", init_from=str(dest))
    try:
        assert resumed.layout is not None and resumed.layout.digest() == LAYOUT.digest()
        assert resumed.versions() == versions
        now = state(resumed)
        assert now.keys() == held.keys() and all(torch.equal(now[k], held[k]) for k in held)
        joined = resumed.join(JoinRequest(learner_id="a", layout_digest=LAYOUT.digest()))
        assert joined.initialized and joined.versions == versions
        # a learner's init upload does not overwrite it, and says it was not created
        answer = resumed.init(codec.encode(START, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
        assert answer.created is False and state(resumed)["param/w"].equal(held["param/w"])
        assert resumed.fragments[0].state.high_water == {}  # the old job's learners are not ours
        # the same learner id joins afresh and its first update is merged, not a duplicate
        merge_round(resumed, 10)
        assert resumed.versions() == [4, 4]
        # a learner of another model is refused at join, naming the checkpoint
        other = Layout(fragments=[FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[5])])])
        with pytest.raises(SyncError) as e:
            resumed.join(JoinRequest(learner_id="b", layout_digest=other.digest()))
        assert e.value.kind == Refusal.CONFLICT and str(dest) in str(e.value)
        assert "\n" not in str(e.value)
    finally:
        resumed.close()
    # restarted on its own state dir, it still names where it came from
    again = make(tmp_path / "state2", init_from=str(dest))
    try:
        assert again.versions() == [4, 4]
        with pytest.raises(SyncError, match="initialized from --init-from"):
            again.join(JoinRequest(learner_id="c", layout_digest="0" * 16))
    finally:
        again.close()


def test_retention_keeps_the_newest_and_touches_nothing_else(tmp_path: Path) -> None:
    sync = make(tmp_path / "state")
    init(sync)
    dest = tmp_path / "ckpt"
    dest.mkdir()
    (dest / "notes.txt").write_text("the user's")
    (dest / "20000101T000000.000000Z-v000000000009").mkdir()  # a partial one: no manifest
    (dest / ".partial-20000101T000000.000000Z-v000000000009").mkdir()  # a killed writer's
    names = []
    try:
        for step in (10, 20, 30, 40):
            merge_round(sync, step)
            snap = checkpoints.take_snapshot(sync)
            assert snap is not None
            names.append(checkpoints.write_checkpoint(snap, str(dest), keep=2).name)
    finally:
        sync.close()
    kept = sorted(p.name for p in dest.iterdir())
    assert kept == sorted([*names[-2:], "latest", "notes.txt"])
    assert (dest / "latest").read_text().strip() == names[-1]
    assert checkpoints.listed(str(dest)) == names[-2:]
    assert json.loads((dest / names[-1] / checkpoints.MANIFEST).read_text())["global_version"] == 8


def test_a_failed_upload_never_pushes_out_a_whole_checkpoint(tmp_path: Path) -> None:
    sync = make(tmp_path / "state")
    init(sync)
    dest = tmp_path / "ckpt"
    try:
        merge_round(sync, 10)
        snap = checkpoints.take_snapshot(sync)
        assert snap is not None
        whole = str(checkpoints.write_checkpoint(snap, str(dest), keep=1).name)
    finally:
        sync.close()
    # newer ones whose manifest never landed (uploads that failed midway), and an older one
    newer = ["29991231T000000.000000Z-v000000000099", "29991231T000001.000000Z-v000000000100"]
    for name in [*newer, "20000101T000000.000000Z-v000000000001"]:
        (dest / name).mkdir()
    gone = checkpoints.prune(str(dest), keep=1)
    assert gone == ["20000101T000000.000000Z-v000000000001"]  # the partial behind the whole
    assert (dest / whole / checkpoints.MANIFEST).is_file()  # kept: the one that can be read
    assert all((dest / n).is_dir() for n in newer)  # left for a later pass


def test_a_partial_or_foreign_checkpoint_is_never_taken(tmp_path: Path) -> None:
    sync = make(tmp_path / "state")
    init(sync)
    merge_round(sync, 10)
    snap = checkpoints.take_snapshot(sync)
    sync.close()
    assert snap is not None
    dest = tmp_path / "ckpt"
    name = str(checkpoints.write_checkpoint(snap, str(dest), keep=3).name)
    # a checkpoint whose manifest never landed: `latest` naming it is refused, by name
    (dest / name / checkpoints.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"holds no ddiloco_checkpoint\.json"):
        checkpoints.read_checkpoint(str(dest / name))
    # another format version: refused in one line
    (dest / name / checkpoints.MANIFEST).write_text(json.dumps({"format_version": 2, "name": name}))
    with pytest.raises(CheckpointError, match="not a version-1 manifest") as e:
        checkpoints.check_source(str(dest))
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoints.check_source(str(tmp_path / "nowhere"))


def test_a_failed_write_is_logged_counted_and_retried_at_the_next_period(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    sync = make(tmp_path / "state")
    init(sync)
    version = [0]
    writer = checkpoints.Checkpointer(
        str(blocker / "ckpt"),
        every_versions=2,
        every_seconds=0,
        keep=2,
        version=lambda: version[0],
        snapshot=lambda: checkpoints.take_snapshot(sync),
        counted=checkpoints.counted_by(sync.metrics),
    )
    try:
        version[0] = 1
        assert not writer.due()
        merge_round(sync, 10)
        version[0] = 2
        assert writer.due()
        out = writer.attempt()  # never raises
        assert out.error is not None and writer.failed == 1 and writer.written == 0
        assert (
            "Checkpoint to" in caplog.text and "failed (retried in the next period)" in caplog.text
        )
        text = sync.metrics.render().decode()
        assert 'ddiloco_checkpoints_total{outcome="failed"} 1.0' in text
        assert not writer.due()  # the next period: two more versions
        writer.dest = str(tmp_path / "ckpt")  # the volume is back
        version[0] = 4
        assert writer.due()
        out = writer.attempt()
        assert out.error is None and writer.written == 1
        text = sync.metrics.render().decode()
        assert 'ddiloco_checkpoints_total{outcome="written"} 1.0' in text
    finally:
        writer.close()
        sync.close()


def test_the_synchronizer_writes_checkpoints_on_its_own(tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    sync = make(
        tmp_path / "state",
        checkpoint_dest=str(dest),
        checkpoint_every_versions=2,
        checkpoint_keep=2,
    )
    try:
        init(sync)
        assert sync.checkpointer is not None and sync.checkpointer.last_version == 0
        merge_round(sync, 10)  # global version 2
        deadline = time.time() + 20
        while not (dest / "latest").exists():
            assert time.time() < deadline, "no checkpoint written"
            time.sleep(0.05)
        name = (dest / "latest").read_text().strip()
        assert json.loads((dest / name / checkpoints.MANIFEST).read_text())["global_version"] == 2
    finally:
        sync.close()


def test_a_plain_model_dir_seeds_the_first_learners_layout(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    given = {"w": torch.full((4,), 0.25), "v": torch.full((2, 3), -0.5)}
    save_file(given, str(model / "model.safetensors"))
    sync = make(tmp_path / "state", init_from=str(model))
    try:
        assert sync.layout is None and sync.seed is not None
        init(sync)  # the learner's own parameters (START) are not the job's
        held = state(sync)
        assert torch.equal(held["param/w"], given["w"]) and torch.equal(held["param/v"], given["v"])
        assert all(not v.any() for k, v in held.items() if k.startswith("momentum/"))
    finally:
        sync.close()
    wrong = make(tmp_path / "state-wrong", init_from=str(model))
    other = Layout(
        fragments=[
            FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[4])]),
            FragmentSpec(index=1, tensors=[TensorSpec(name="v", shape=[3, 2])]),
        ]
    )
    try:
        with pytest.raises(SyncError, match=r"v is \[2, 3\] there, \[3, 2\] in the learners'"):
            init(wrong, other, {"w": torch.zeros(4), "v": torch.zeros(3, 2)})
        assert wrong.layout is None  # nothing was initialized
    finally:
        wrong.close()


def test_settings_refuse_what_cannot_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither DDILOCO_CHECKPOINT_EVERY_VERSIONS"):
        SyncSettings(token="t", state_dir=tmp_path, checkpoint_dest=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="not supported with DDILOCO_SHARDS=2"):
        SyncSettings(token="t", state_dir=tmp_path, shards=2, init_from=str(tmp_path))


def test_a_url_is_logged_without_its_credentials() -> None:
    assert checkpoints.shown("s3://key:secret@bucket/run") == "s3://bucket/run"
    assert checkpoints.shown("/ckpt/run") == "/ckpt/run"


def test_checkpoints_to_object_storage_and_a_job_started_from_one(
    tmp_path: Path, s3_server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """s3:// on a real S3-compatible server (tests/s3server.py), credentials from the
    environment as in the synchronizer's pod."""
    server: object = s3_server
    for k, v in server.env().items():  # type: ignore[attr-defined]
        monkeypatch.setenv(k, v)
    url = server.url("jobs", "run-1")  # type: ignore[attr-defined]
    sync = make(tmp_path / "state")
    init(sync)
    names = []
    try:
        for step in (10, 20):
            merge_round(sync, step)
            snap = checkpoints.take_snapshot(sync)
            assert snap is not None
            names.append(checkpoints.write_checkpoint(snap, url, keep=1).name)
        held, versions = state(sync), sync.versions()
    finally:
        sync.close()
    assert checkpoints.listed(url) == names[-1:]  # the older one deleted from the bucket
    fs = server.filesystem()  # type: ignore[attr-defined]
    root = url.removeprefix("s3://")
    assert fs.cat_file(f"{root}/latest").decode().strip() == names[-1]
    assert fs.isfile(f"{root}/{names[-1]}/model.safetensors")
    resumed = make(tmp_path / "state2", init_from=url)
    try:
        assert resumed.versions() == versions
        now = state(resumed)
        assert all(torch.equal(now[k], held[k]) for k in held)
    finally:
        resumed.close()
    # a bucket that is not there: the attempt fails, is counted, and raises nothing
    sync = make(tmp_path / "state3")
    init(sync)
    writer = checkpoints.Checkpointer(
        server.url("jobs").replace(server.bucket, "no-such-bucket"),  # type: ignore[attr-defined]
        every_versions=1,
        every_seconds=0,
        keep=1,
        version=lambda: sum(sync.versions()),
        snapshot=lambda: checkpoints.take_snapshot(sync),
    )
    try:
        merge_round(sync, 10)
        assert writer.attempt().error is not None and writer.failed == 1
    finally:
        writer.close()
        sync.close()
