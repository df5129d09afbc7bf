"""Synchronizer shards: the shard map, a shard's ownership, and the job's merged status.

    pytest tests/unit/test_shards.py

The map is balanced by bytes, deterministic and total; a shard keeps and serves only its
own fragments (the rest are refused with 421 naming the owner, over real HTTP too), resumes
them from its state dir, refuses another shard's state dir; `merge_statuses` adds the
shards' answers up into the one-synchronizer definitions.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from ddiloco.learner.shard_clients import split_urls
from ddiloco.learner.sync_client import SyncRefused
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.wire import codec
from ddiloco.wire.errors import SyncError
from ddiloco.wire.job_status import merge_statuses
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    FragmentStatus,
    Heartbeat,
    JoinRequest,
    Layout,
    LearnerStatus,
    Status,
    TensorSpec,
    UpdateMeta,
    shard_map,
)


def layout_of(sizes: list[int]) -> Layout:
    return Layout(
        fragments=[
            FragmentSpec(index=i, tensors=[TensorSpec(name=f"w{i}", shape=[n])])
            for i, n in enumerate(sizes)
        ]
    )


# ---- the map -----------------------------------------------------------------------
def test_shard_map_is_total_deterministic_and_balanced_by_bytes() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 1000) for _ in range(rng.randint(1, 12))]
        shards = rng.randint(1, 5)
        layout = layout_of(sizes)
        owners = shard_map(layout, shards)
        assert owners == shard_map(layout_of(list(sizes)), shards)  # same answer every time
        assert len(owners) == len(sizes) and all(0 <= o < shards for o in owners)
        load = [sum(n for n, o in zip(sizes, owners, strict=True) if o == s) for s in range(shards)]
        # greedy largest-first: no shard exceeds another by more than the largest fragment
        assert max(load) - min(load) <= max(sizes)
        if len(sizes) >= shards:
            assert all(load), (sizes, owners)  # every shard gets something when it can


def test_shard_map_examples() -> None:
    assert shard_map(layout_of([10, 10, 10, 10]), 2) == [0, 1, 0, 1]
    assert shard_map(layout_of([1, 5, 3]), 1) == [0, 0, 0]
    assert shard_map(layout_of([1, 8, 3, 4]), 2) == [1, 0, 1, 1]  # 8 against 4+3+1
    with pytest.raises(ValueError, match="shards must be >= 1"):
        shard_map(layout_of([1]), 0)


def test_settings_refuse_a_shard_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="DDILOCO_SHARD=2 is out of range for DDILOCO_SHARDS=2"):
        SyncSettings(token="t", state_dir=tmp_path, shard=2, shards=2)


# ---- a shard -----------------------------------------------------------------------
LAYOUT = layout_of([6, 6, 4, 4])  # shard_map(..., 2) == [0, 1, 0, 1]


def shard(tmp_path: Path, i: int, shards: int = 2) -> Synchronizer:
    s = SyncSettings(
        token="t",
        state_dir=tmp_path / f"sync-{i}",
        shard=i,
        shards=shards,
        quorum=1,
        grace=False,
        outer_lr=1.0,
        outer_momentum=0.0,
        max_update_ratio=10.0,
    )
    return Synchronizer(s)


def init_payload() -> bytes:
    tensors = {f"w{i}": torch.full((n,), float(i + 1)) for i, n in enumerate([6, 6, 4, 4])}
    return codec.encode(tensors, {LAYOUT_KEY: LAYOUT.model_dump_json()})


def update(p: int, value: float, step: int = 10) -> bytes:
    meta = UpdateMeta(
        learner_id="l0", fragment=p, base_version=0, steps=10, tokens=100, learner_step=step
    )
    n = LAYOUT.fragments[p].tensors[0].shape[0]
    return codec.encode({f"w{p}": torch.full((n,), value)}, meta.to_metadata())


def test_a_shard_keeps_merges_and_serves_only_its_fragments(tmp_path: Path) -> None:
    a, b = shard(tmp_path, 0), shard(tmp_path, 1)
    for s in (a, b):
        resp = s.join(JoinRequest(learner_id="l0"))
        assert (resp.shards, resp.owned) == (2, [])
        s.init(init_payload())
    assert a.owned == [0, 2] and b.owned == [1, 3]
    assert a.join(JoinRequest(learner_id="l0")).owned == [0, 2]
    # no tensors of another shard's fragment in memory, nor its file on disk
    assert a.fragments[1].state.params == {} and a.fragments[3].state.params == {}
    assert a.fragments[2].state.params["w2"].tolist() == [3.0] * 4
    assert sorted(p.name for p in (tmp_path / "sync-0").glob("fragment-*")) == [
        "fragment-0000.safetensors",
        "fragment-0002.safetensors",
    ]
    with pytest.raises(SyncError, match="fragment 1 is owned by shard 1 of 2") as e:
        a.submit(update(1, 0.5))
    assert e.value.status == 421
    with pytest.raises(SyncError, match="owned by shard 0") as e:
        b.fragment(2)
    assert e.value.status == 421
    assert a.submit(update(2, 0.5)).status == "accepted"
    assert a.merge(2) == 1
    assert a.versions() == [0, 0, 1, 0]
    st = a.status()
    assert [(f.index, f.shard) for f in st.fragments] == [(0, 0), (2, 0)]
    assert (st.shard, st.shards, st.global_version) == (0, 2, 1)
    assert st.tokens_merged == 50  # 100 tokens on one of its two fragments
    a.close()
    again = shard(tmp_path, 0)  # resumes its own fragments from its state dir
    assert again.versions() == [0, 0, 1, 0] and again.owned == [0, 2]
    again.close()
    with pytest.raises(ValueError, match="is shard 0 of 2, not shard 1 of 2"):
        Synchronizer(SyncSettings(token="t", state_dir=tmp_path / "sync-0", shard=1, shards=2))
    b.close()


def test_a_misdirected_update_gets_421_over_http(make_sync_server) -> None:
    server = make_sync_server(shard=1, shards=2, quorum=1, grace=False)
    client = server.client()
    client.join(JoinRequest(learner_id="l0"))
    client.init(init_payload())
    with pytest.raises(SyncRefused) as e:
        client.post_update(0, update(0, 0.5))
    assert (e.value.status, e.value.kind) == (421, "wrong_shard")
    assert "owned by shard 0" in e.value.detail
    with pytest.raises(SyncRefused) as e:
        client.fragment(2)
    assert e.value.status == 421
    version, tensors = client.fragment(3)
    assert version == 0 and tensors["w3"].tolist() == [4.0] * 4
    client.heartbeat(
        Heartbeat(
            learner_id="l0",
            step=1,
            steps=[1] * 4,
            tokens=[1] * 4,
            base_versions=[0] * 4,
            step_seconds=0.5,
        )
    )
    assert client.post_update(1, update(1, 0.5)).status == "accepted"
    client.close()


# ---- the job's view ----------------------------------------------------------------
def learner(lid: str, **kw: object) -> LearnerStatus:
    base: dict[str, object] = {
        "learner_id": lid,
        "alive": True,
        "incarnation": 1,
        "step": 10,
        "tokens_total": 1000,
        "step_seconds": 0.5,
        "compute_seconds": 8.0,
        "uptime_seconds": 10.0,
        "contributions": 2,
        "last_seen_s": 0.5,
        "tokens_computed": 1000,
    }
    return LearnerStatus.model_validate(base | kw)


def status(shard_: int, frags: list[tuple[int, int, int]], learners: list[LearnerStatus], **kw):
    fs = [
        FragmentStatus(
            index=i, merge="rda", version=v, contributors_pending=0, tokens_merged=t, shard=shard_
        )
        for i, v, t in frags
    ]
    base: dict[str, object] = {
        "initialized": True,
        "global_version": sum(v for _, v, _ in frags),
        "merges": sum(v for _, v, _ in frags),
        "tokens_merged": sum(t for *_, t in frags) // max(1, len(frags)),
        "contributions_merged": 2 * sum(v for _, v, _ in frags),
        "contributions_rejected": 1,
        "refusals": {"stale": 1},
        "mean_contributors": 2.0,
        "mean_staleness": 1.0 if shard_ == 0 else 0.0,
        "bytes_up": 100,
        "bytes_down": 10,
        "goodput": 0.8,
        "fragments": fs,
        "learners": learners,
        "xi": {"step": 0.5 + shard_, "quorum": 0.2, "sync": None},
        "shard": shard_,
        "shards": 2,
    }
    return Status.model_validate(base | kw)


def test_merge_statuses_adds_the_shards_up() -> None:
    s0 = status(
        0,
        [(0, 3, 600), (3, 1, 200)],
        [learner("a", last_seen_s=0.1, step=12, contributions=4), learner("b", alive=False)],
    )
    s1 = status(
        1,
        [(1, 2, 400), (2, 2, 400)],
        [
            learner("a", last_seen_s=0.9, step=11, contributions=4, data_position=70),
            learner("b", alive=True, last_seen_s=0.2, incarnation=2, tokens_computed=1500),
        ],
    )
    job = merge_statuses([s1, s0])
    assert [(f.index, f.shard, f.version) for f in job.fragments] == [
        (0, 0, 3),
        (1, 1, 2),
        (2, 1, 2),
        (3, 0, 1),
    ]
    assert (job.global_version, job.merges, job.contributions_merged) == (8, 8, 16)
    assert job.tokens_merged == (600 + 400 + 400 + 200) // 4
    assert job.refusals == {"stale": 2} and job.contributions_rejected == 2
    assert (job.bytes_up, job.bytes_down, job.shards) == (200, 20, 2)
    a, b = job.learners
    assert (a.learner_id, a.step, a.contributions, a.data_position) == ("a", 12, 8, 70)
    assert (b.alive, b.incarnation, b.tokens_computed) == (True, 2, 1500)
    assert job.goodput == pytest.approx(16 / 20)
    assert job.merged_work_ratio == pytest.approx(400 / 2500)
    assert job.mean_staleness == pytest.approx((1.0 * 8 + 0.0 * 8) / 16)
    assert job.xi == {"step": 1.5, "quorum": pytest.approx(0.2), "sync": None}
    assert merge_statuses([s0]) is s0
    with pytest.raises(ValueError):
        merge_statuses([])


def test_split_urls() -> None:
    assert split_urls("http://a:1, http://b:2/") == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="empty URL"):
        split_urls("http://a:1,,http://b:2")


def test_status_cli_merges_the_shards(
    make_sync_server, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddiloco.cli.status import main as status_main

    servers = [make_sync_server(shard=i, shards=2, quorum=1, grace=False) for i in (0, 1)]
    for server in servers:
        client = server.client()
        client.join(JoinRequest(learner_id="l0"))
        client.init(init_payload())
        p = server.sync.owned[0]
        assert client.post_update(p, update(p, 0.5)).status == "accepted"
        client.close()
    for server in servers:  # the merge loop merges each shard's one update
        deadline = time.time() + 10
        while sum(server.sync.versions()) < 1 and time.time() < deadline:
            time.sleep(0.02)
    monkeypatch.setenv("DDILOCO_TOKEN", servers[0].token)
    assert status_main([",".join(s.url for s in servers), "--json"]) == 0
    job = Status.model_validate_json(capsys.readouterr().out)
    assert [(f.index, f.shard) for f in job.fragments] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert job.global_version == 2 and job.shards == 2
    assert [r.learner_id for r in job.learners] == ["l0"]
    with pytest.raises(SystemExit):
        status_main(["http://a:1,ftp://b", "--json"])


def test_a_learner_joins_every_shard_and_sends_each_fragment_to_its_owner(
    make_sync_server,
) -> None:
    from ddiloco.cli.errors import UsageError
    from ddiloco.learner.config import LearnerConfig
    from ddiloco.learner.streaming import Streamer

    servers = [make_sync_server(shard=i, shards=2, quorum=1, grace=False) for i in (0, 1)]
    tensors = {f"w{i}": torch.full((n,), float(i + 1)) for i, n in enumerate([6, 6, 4, 4])}

    def streamer(urls: list[str]) -> Streamer:
        cfg = LearnerConfig(sync_url=",".join(urls), token=servers[0].token, learner_id="l0")
        return Streamer(cfg, LAYOUT, lambda: tensors)

    wrong = streamer([servers[1].url, servers[0].url])
    with pytest.raises(UsageError, match="in shard order"):
        wrong.fetch_all()
    s = streamer([x.url for x in servers])
    got = s.fetch_all()  # initializes both shards, each fragment fetched from its owner
    assert [(p, v, t[f"w{p}"][0].item()) for p, v, t in got] == [
        (0, 0, 1.0),
        (1, 0, 2.0),
        (2, 0, 3.0),
        (3, 0, 4.0),
    ]
    assert servers[0].sync.owned == [0, 2] and servers[1].sync.owned == [1, 3]
    s.report(
        Heartbeat(
            learner_id="l0",
            step=10,
            steps=[10] * 4,
            tokens=[100] * 4,
            base_versions=[0] * 4,
            step_seconds=0.1,
            data_position=7,
        )
    )
    s.start()
    try:
        for p in range(4):
            meta = UpdateMeta(
                learner_id="l0",
                fragment=p,
                base_version=0,
                steps=10,
                tokens=100,
                learner_step=10,
                incarnation=s.incarnation,
            )
            n = LAYOUT.fragments[p].tensors[0].shape[0]
            s.send(meta, {f"w{p}": torch.full((n,), 0.5)})
        assert s.outbox.wait_empty(20)
        ledger = s.ledger()
        assert all(ledger[p]["accepted_uploads"] == 1 for p in range(4)), ledger
        deadline = time.time() + 20  # merged on their owners, adopted here from their owners
        while time.time() < deadline and s.versions != [1, 1, 1, 1]:
            time.sleep(0.05)
        assert s.versions == [1, 1, 1, 1]
        assert sorted(p for p, _, _ in s.arrivals()) == [0, 1, 2, 3]
        for server in servers:  # every shard heard the heartbeats: alive, at its position
            row = server.sync.status().learners[0]
            assert row.alive and row.data_position >= 7
    finally:
        s.close()


def test_export_reads_every_shards_state_dir(tmp_path: Path) -> None:
    from ddiloco.cli.export import ExportError, from_state_dir

    a, b = shard(tmp_path, 0), shard(tmp_path, 1)
    for s in (a, b):
        s.join(JoinRequest(learner_id="l0"))
        s.init(init_payload())
    assert b.submit(update(3, 0.5)).status == "accepted" and b.merge(3) == 1
    a.close()
    b.close()
    dirs = [str(tmp_path / "sync-1"), str(tmp_path / "sync-0")]  # any order
    model = from_state_dir(",".join(dirs))
    assert model.versions == [0, 0, 0, 1]
    assert sorted(model.params) == ["w0", "w1", "w2", "w3"]
    assert model.params["w1"].tolist() == [2.0] * 6
    assert model.params["w3"].tolist() != [4.0] * 4  # the merged version, from its owner
    with pytest.raises(ExportError, match="is shard 0 of 2: give every shard's state dir"):
        from_state_dir(tmp_path / "sync-0")
    with pytest.raises(ExportError, match=r"owns fragments \[1, 3\]"):
        from_state_dir(f"{tmp_path / 'sync-0'},{tmp_path / 'sync-0'}")
