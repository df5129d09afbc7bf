"""The upload port (synchronizer/bulk.py) as learners use it: in-process synchronizers on
real loopback sockets, the learner's own Streamer.

    pytest tests/unit/test_upload_port.py

A learner posts each fragment's updates to its owner shard's upload port, which the shard
named at join (and nothing else goes there); when that port cannot be reached the uploads go
to the main URL and nothing is lost; an explicit DDILOCO_UPLOAD_URL list is checked against
the shards. The hostile-input cases of the port are in tests/e2e/test_upload_port.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.streaming import Streamer
from ddiloco.learner.uploads import upload_overrides, with_port
from ddiloco.local.processes import free_port
from ddiloco.synchronizer import codec
from ddiloco.synchronizer.client import SyncClient
from ddiloco.synchronizer.protocol import (
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
        FragmentSpec(index=i, tensors=[TensorSpec(name=f"w{i}", shape=[n])])
        for i, n in enumerate([6, 6, 4, 4])
    ]
)
TENSORS = {f"w{i}": torch.full((n,), float(i + 1)) for i, n in enumerate([6, 6, 4, 4])}


def uploads_of(server) -> int:
    """Updates the server's upload port answered 200."""
    return server.server.config.app.state.uploads.requests


def run_learner(cfg: LearnerConfig, servers) -> Streamer:
    """Join, initialize, send one update of every fragment and wait until all are answered."""
    s = Streamer(cfg, LAYOUT, lambda: TENSORS)
    s.fetch_all()
    s.report(
        Heartbeat(
            learner_id="l0",
            step=10,
            steps=[10] * 4,
            tokens=[100] * 4,
            base_versions=[0] * 4,
            step_seconds=0.1,
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
        results = sorted(s.results())
        assert [r[2] for r in results] == ["accepted"] * 4, results
    finally:
        s.close()
    for server in servers:  # every shard merges its fragments' one update each
        deadline = time.time() + 10
        while sum(server.sync.versions()) < len(server.sync.owned) and time.time() < deadline:
            time.sleep(0.02)
        assert sum(server.sync.versions()) == len(server.sync.owned)
    return s


def test_join_names_the_upload_port_and_only_updates_go_there(make_sync_server) -> None:
    servers = [
        make_sync_server(shard=i, shards=2, quorum=1, grace=False, upload_port=0) for i in (0, 1)
    ]
    for server in servers:
        port = server.sync.upload_port
        assert port and port != int(server.url.rsplit(":", 1)[1])
        c = SyncClient(server.url, server.token)
        assert c.join(JoinRequest(learner_id="probe")).upload_port == port
        c.close()
    cfg = LearnerConfig(
        sync_url=",".join(s.url for s in servers), token=servers[0].token, learner_id="l0"
    )
    s = run_learner(cfg, servers)
    # each shard's two fragments came in through its upload port, nothing else did
    assert [uploads_of(server) for server in servers] == [2, 2]
    assert s.upload_urls == [with_port(x.url, x.sync.upload_port) for x in servers]
    # to the upload port the parts go from their own memory (sender.py)
    assert all(s._upload_client(i, None).sendmsg for i in (0, 1))


def test_an_unreachable_upload_port_falls_back_to_the_main_url(make_sync_server, caplog) -> None:
    server = make_sync_server(quorum=1, grace=False, upload_port=0)
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = LearnerConfig(sync_url=server.url, token=server.token, learner_id="l0", upload_url=closed)
    with caplog.at_level("WARNING"):
        s = run_learner(cfg, [server])
    assert uploads_of(server) == 0  # all four went to the main port, none was lost
    assert s.fallback_until[0] > time.monotonic()
    assert not s._upload_client(0, None).sendmsg  # the main port's uvicorn: through libcurl
    assert any("unreachable" in r.getMessage() for r in caplog.records)


def test_upload_url_off_uses_the_main_port(make_sync_server) -> None:
    server = make_sync_server(quorum=1, grace=False, upload_port=0)
    cfg = LearnerConfig(sync_url=server.url, token=server.token, learner_id="l0", upload_url="off")
    run_learner(cfg, [server])
    assert uploads_of(server) == 0


def test_upload_url_list_must_match_the_shards() -> None:
    assert upload_overrides("", 2) == [None, None]
    assert upload_overrides("off", 1) == [None]
    assert upload_overrides("http://a:1/, http://b:2", 2) == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="one per shard"):
        LearnerConfig(sync_url="http://a:1,http://b:2", upload_url="http://c:3")
    assert with_port("https://[::1]:8470/", 8471) == "https://[::1]:8471"
    assert with_port("http://sync-0.sync.ns.svc:8470", 9) == "http://sync-0.sync.ns.svc:9"


@pytest.mark.parametrize("port", ["upload", "main h2", "main h1"])
def test_an_update_posted_as_its_parts_is_the_update_posted_whole(make_sync_server, port) -> None:
    """`post_update` takes `codec.pieces` (header, then the tensor's own memory) and sends
    them one after the other: the synchronizer takes the same update, a re-send of the same
    parts is a duplicate, and the client counts the body's bytes once."""
    server = make_sync_server(quorum=1, grace=False, upload_port=0)
    boss = SyncClient(server.url, server.token)
    boss.join(JoinRequest(learner_id="l0"))
    boss.init(codec.encode(TENSORS, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
    url = with_port(server.url, server.sync.upload_port) if port == "upload" else server.url
    c = SyncClient(url, server.token, http2=port == "main h2")
    meta = UpdateMeta(
        learner_id="l0", fragment=1, base_version=0, steps=10, tokens=100, learner_step=1
    )
    delta = {"w1": torch.arange(6, dtype=torch.float32) / 10}
    parts = codec.pieces(delta, meta.to_metadata())
    assert parts is not None and len(parts) == 2
    whole = b"".join(parts)
    assert c.post_update(1, parts).status == "accepted"
    assert c.bytes_up == len(whole)
    assert c.post_update(1, parts).status == "duplicate"
    assert c.post_update(1, whole).status == "duplicate"
    deadline = time.time() + 10  # the server's own loop merges it (K = 1)
    while server.sync.versions()[1] < 1 and time.time() < deadline:
        time.sleep(0.02)
    version, tensors = boss.fragment(1)
    assert version == 1
    outer = server.sync.policy.outer  # one update from zero momentum: lr (1 + mu) delta
    step = outer.lr * (1 + outer.momentum) * delta["w1"]
    assert torch.allclose(tensors["w1"], TENSORS["w1"] + step, atol=1e-2)
    if port == "upload":
        assert uploads_of(server) == 3
    c.close()
    boss.close()


@pytest.mark.parametrize("merge_first", [True, False])
def test_body_reads_wait_while_a_merge_computes(make_sync_server, merge_first: bool) -> None:
    """`merge_first`: the upload port reads no more of a body while a merge computes (the
    gate is held here as a merge holds it), and goes on once it is done; off: reads go on."""
    server = make_sync_server(quorum=2, grace=False, upload_port=0, merge_first=merge_first)
    big = Layout(fragments=[FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[1 << 20])])])
    c = server.client()
    c.join(JoinRequest(learner_id="a"))
    init = {"w": torch.ones(1 << 20)}
    c.init(codec.encode(init, {LAYOUT_KEY: big.model_dump_json()}))
    meta = UpdateMeta(
        learner_id="a", fragment=0, base_version=0, steps=10, tokens=100, learner_step=10
    )
    body = codec.encode({"w": torch.full((1 << 20,), 1e-3)}, meta.to_metadata())  # 4 MB
    url = with_port(server.url, server.sync.upload_port)
    up = SyncClient(url, server.token, http2=False, timeout=30)  # the port is HTTP/1.1
    answers: list[object] = []

    def post() -> None:
        try:
            answers.append(up.post_update(0, body).status)
        except Exception as e:  # shown by the asserts below
            answers.append(e)

    gate = server.sync.computing
    with gate:  # a merge computing
        poster = threading.Thread(target=post)
        poster.start()
        poster.join(0.6)
        assert answers == ([] if merge_first else ["accepted"])
    poster.join(10)
    assert answers == ["accepted"]
    assert uploads_of(server) == 1
    up.close()
    c.close()
