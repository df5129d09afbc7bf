"""Downloads from the upload port (synchronizer/upload_port.py: `GET /v1/fragments/{p}` on the upload
port) against the main port's contract: in-process synchronizers on real loopback sockets.

    pytest tests/unit/test_download_port.py

The body and version header are the main port's, for any valid credential (the job key, a
learner's, a spare's) and 401 without one; TLS and mutual TLS with the main port's certificate
and client CA; 421 from a shard that does not own the fragment, 422 for one that does not
exist, 409 before the job is initialized; a client that stops reading mid-body is cut off
(its thread and its hold on the served buffer end). The learner's client reads the body
into one buffer its tensors view, and its Streamer downloads through the port, falling back
to the main URL when the port turns it away or serves no fragments.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.streaming import Streamer
from ddiloco.learner.sync_client import ClientTLS, SyncClient, SyncRefused, SyncUnavailable
from ddiloco.learner.uploads import with_port
from ddiloco.synchronizer import upload_port
from ddiloco.wire import broadcast, codec, tls
from ddiloco.wire.auth import StaticTokens, evaluator_token, learner_token, spare_token
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    VERSION_HEADER,
    FragmentSpec,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)
from tests.conftest import TOKEN
from tests.unit import test_upload_port as up


def get(p: int = 1, token: str | None = TOKEN, *fields: str) -> bytes:
    lines = [f"GET /v1/fragments/{p} HTTP/1.1", "Host: 127.0.0.1"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join([*lines, *fields]) + "\r\n\r\n").encode("latin-1")


def merged(server) -> None:
    """One update of fragment 1 through the port, merged (K = 1): version 1 is served."""
    with up.connect(server.sync.upload_port) as sock:
        body = up.update("l0")
        sock.sendall(up.request(length=str(len(body))) + body)
        assert up.answer(sock)[0] == 200
    up.wait_for(lambda: server.sync.versions()[1] == 1)


def sent(port: upload_port.UploadServer, n: int) -> None:
    """The port counts `n` downloads sent whole (counted just after the last byte went out:
    the client may have it all first)."""
    up.wait_for(lambda: port.downloads >= n, timeout=5)
    time.sleep(0.05)
    assert port.downloads == n


def initialized(servers) -> None:
    """Each shard initialized from the one init upload (it keeps its own fragments)."""
    for server in servers:
        boss = SyncClient(server.url, server.token)
        boss.join(JoinRequest(learner_id="l0"))
        boss.init(codec.encode(up.TENSORS, {LAYOUT_KEY: up.LAYOUT.model_dump_json()}))
        boss.close()


def main_port(server, p: int) -> tuple[int, bytes]:
    c = SyncClient(server.url, server.token)
    try:
        _, headers, body = c.request("GET", f"/v1/fragments/{p}")
    finally:
        c.close()
    return int(headers[VERSION_HEADER.lower()]), body


@pytest.mark.parametrize(
    "who", ["job key", "learner", "spare"], ids=["job_key", "learner", "spare"]
)
def test_the_port_serves_the_main_ports_bytes_and_version(make_sync_server, who: str) -> None:
    server = up.ready(make_sync_server)
    merged(server)
    token = {
        "job key": TOKEN,
        "learner": learner_token(TOKEN, "l0"),
        "spare": spare_token(TOKEN, "pod-0"),
    }[who]
    uploads = server.server.config.app.state.uploads
    for p in (0, 1):
        with up.connect(server.sync.upload_port) as sock:
            sock.sendall(get(p, token))
            first = up.answer(sock)
            sock.sendall(get(p, token))  # the next on the same kept-alive connection
            second = up.answer(sock)
        version, body = main_port(server, p)
        assert first[0] == 200 and first[2] == body == second[2]
        assert int(first[1][VERSION_HEADER.lower()]) == version == (1 if p == 1 else 0)
        assert first[1]["content-type"] == "application/vnd.safetensors"
    sent(uploads, 4)
    assert uploads.requests == 1  # the one update


def test_the_learners_client_reads_the_body_into_the_tensors_buffer(make_sync_server) -> None:
    """`SyncClient.fragment` from the port: the tensors equal the main port's and view the one
    buffer the body was read into (no bytes object in between); the bytes are counted."""
    server = up.ready(make_sync_server)
    merged(server)
    url = with_port(server.url, server.sync.upload_port)
    port = SyncClient(url, learner_token(TOKEN, "l0"), http2=False, sendmsg=True)
    main = SyncClient(server.url, server.token)
    try:
        for p in range(4):
            version, tensors = port.fragment(p)
            want_version, want = main.fragment(p)
            assert version == want_version and tensors.keys() == want.keys()
            for name, t in tensors.items():
                assert torch.equal(t, want[name])
                assert isinstance(t.untyped_storage(), torch.UntypedStorage)
            assert port.http_version == "HTTP/1.1"
        assert port.bytes_down == main.bytes_down
        sent(server.server.config.app.state.uploads, 4)
        with pytest.raises(SyncRefused) as e:
            port.fragment(9)
        assert e.value.status == 422
    finally:
        port.close()
        main.close()


def test_a_wrong_or_missing_credential_is_401(make_sync_server) -> None:
    server = up.ready(make_sync_server)
    for token in (None, "wrong", learner_token("another key", "l0")):
        with up.connect(server.sync.upload_port) as sock:
            sock.sendall(get(1, token))
            got = up.answer(sock)
            assert up.closed(sock)
        up.refused(got, 401, "unauthorized")
        assert got[1]["www-authenticate"] == "Bearer"


def test_missing_fragments_wrong_methods_and_bodies_are_4xx(make_sync_server) -> None:
    """A fragment that does not exist is 422 as on the main port (the connection kept); a
    method the route does not take is 405; a GET with a body is 400 and closed."""
    server = up.ready(make_sync_server)
    with up.connect(server.sync.upload_port) as sock:
        sock.sendall(get(99))
        err = up.refused(up.answer(sock), 422, "invalid")
        assert "does not exist" in err["detail"]
        sock.sendall(get(0))  # the same connection goes on
        assert up.answer(sock)[0] == 200
    main = SyncClient(server.url, server.token)
    with pytest.raises(SyncRefused) as e:
        main.fragment(99)
    assert e.value.status == 422
    main.close()
    with up.connect(server.sync.upload_port) as sock:
        sock.sendall(get(1).replace(b"GET", b"PUT", 1))
        got = up.answer(sock)
    up.refused(got, 405, "method_not_allowed")
    assert got[1]["allow"] == "GET"
    with up.connect(server.sync.upload_port) as sock:
        sock.sendall(get(1, TOKEN, "Content-Length: 4") + b"abcd")
        got = up.answer(sock)
        assert up.closed(sock)
    up.refused(got, 400, "bad_request")


def test_before_the_job_is_initialized_a_fragment_is_409(make_sync_server) -> None:
    server = make_sync_server(quorum=1, grace=False, upload_port=0)
    with up.connect(server.sync.upload_port) as sock:
        sock.sendall(get(0))
        up.refused(up.answer(sock), 409, "not_initialized")


def test_a_shard_that_does_not_own_the_fragment_is_421(make_sync_server) -> None:
    servers = [
        make_sync_server(shard=i, shards=2, quorum=1, grace=False, upload_port=0) for i in (0, 1)
    ]
    initialized(servers)
    for i, server in enumerate(servers):
        for p in range(4):
            with up.connect(server.sync.upload_port) as sock:
                sock.sendall(get(p))
                got = up.answer(sock)
            if p in server.sync.owned:
                assert got[0] == 200 and got[2] == main_port(server, p)[1]
            else:
                owner = 1 - i
                assert f"owned by shard {owner}" in up.refused(got, 421, "wrong_shard")["detail"]


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    ca = tls.issue_ca("test CA")
    files = {"ca": tls.write_pem(ca.cert_pem, tmp_path / "ca.crt")}
    files["cert"], files["key"] = tls.write_pair(
        tls.issue_server(ca, ["localhost"], ["127.0.0.1"]), tmp_path / "s.crt", tmp_path / "s.key"
    )
    files["ccert"], files["ckey"] = tls.write_pair(
        tls.issue_client(ca, "l0"), tmp_path / "c.crt", tmp_path / "c.key"
    )
    return files


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
def test_over_tls_and_mutual_tls(make_sync_server, pki: dict[str, Path], mutual: bool) -> None:
    """The port's own TLS listener on the same synchronizer: the learner's client verifies it
    and (mutual) presents its certificate; the bytes are the main port's. Without a client
    certificate a mutual-TLS port ends the handshake."""
    server = up.ready(make_sync_server)
    merged(server)
    context = tls.server_context(
        pki["cert"], pki["key"], client_ca_file=pki["ca"] if mutual else None, alpn=["http/1.1"]
    )
    port = upload_port.UploadServer(
        server.sync, StaticTokens(TOKEN), server.sync.settings, context=context
    )
    port.start()
    client_tls = ClientTLS(
        ca_file=pki["ca"],
        cert_file=pki["ccert"] if mutual else None,
        key_file=pki["ckey"] if mutual else None,
    )
    c = SyncClient(
        f"https://127.0.0.1:{port.port}", learner_token(TOKEN, "l0"), http2=False,
        sendmsg=True, tls=client_tls, timeout=10,
    )  # fmt: skip
    try:
        for p in range(4):
            version, tensors = c.fragment(p)
            want_version, body = main_port(server, p)
            assert version == want_version
            want = codec.decode(body)
            assert all(torch.equal(tensors[k], want[k]) for k in want)
        sent(port, 4)
        if mutual:
            bare = SyncClient(
                f"https://127.0.0.1:{port.port}", TOKEN, http2=False, sendmsg=True,
                tls=ClientTLS(ca_file=pki["ca"]), timeout=10,
            )  # fmt: skip
            with pytest.raises(SyncUnavailable):
                bare.fragment(0)
            bare.close()
            assert port.downloads == 4
    finally:
        c.close()
        port.close()


BIG = Layout(fragments=[FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[1 << 22])])])
"""One fragment of 16 MB in float32: far more than loopback's socket buffers hold."""


def test_a_client_that_stops_reading_is_cut_off(make_sync_server, caplog) -> None:
    """A download whose client stops reading mid-body (its receive window full) is cut off
    `body_timeout_s` later: the connection closed, its thread gone, nothing left busy, and
    the port serves the next download at once."""
    server = make_sync_server(quorum=1, grace=False, upload_port=0, body_timeout_s=1.0)
    boss = SyncClient(server.url, server.token)
    boss.join(JoinRequest(learner_id="l0"))
    boss.init(codec.encode({"w": torch.ones(1 << 22)}, {LAYOUT_KEY: BIG.model_dump_json()}))
    boss.close()
    uploads = server.server.config.app.state.uploads
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", server.sync.upload_port))
    t0 = time.monotonic()
    try:
        sock.sendall(get(0))
        head = sock.recv(4096)  # the head and the body's first bytes, then nothing more is read
        assert head.startswith(b"HTTP/1.1 200 ")
        up.wait_for(lambda: uploads.busy == 1, timeout=5)
        with caplog.at_level("WARNING"):
            up.wait_for(lambda: uploads.busy == 0 and not uploads.conns, timeout=10)
        assert time.monotonic() - t0 < 1.0 + 5.0
        assert "cut off" in caplog.text and "read nothing" in caplog.text
        assert uploads.downloads == 0
    finally:
        sock.close()
    c = SyncClient(with_port(server.url, server.sync.upload_port), TOKEN, http2=False, sendmsg=True)
    version, tensors = c.fragment(0)
    assert version == 0 and torch.equal(tensors["w"], torch.ones(1 << 22))
    c.close()


def streamer(server) -> Streamer:
    cfg = LearnerConfig(sync_url=server.url, token=server.token, learner_id="l0")
    return Streamer(cfg, up.LAYOUT, lambda: up.TENSORS)


def test_a_learner_downloads_through_the_port(make_sync_server) -> None:
    server = up.ready(make_sync_server)
    s = streamer(server)
    got = s.fetch_all()
    assert [(p, v) for p, v, _ in got] == [(p, 0) for p in range(4)]
    assert all(torch.equal(t[f"w{p}"], up.TENSORS[f"w{p}"]) for p, _, t in got)
    sent(server.server.config.app.state.uploads, 4)
    assert s.bytes_down > sum(len(main_port(server, p)[1]) for p in range(4))  # and the join


def test_a_learner_falls_back_to_the_main_port(make_sync_server, monkeypatch) -> None:
    """A port at its cap (503) sends that download to the main URL, and the next tries the
    port again."""
    server = up.ready(make_sync_server)
    monkeypatch.setattr(upload_port, "MAX_CONNECTIONS", 0)
    uploads = server.server.config.app.state.uploads
    s = streamer(server)
    got = s.fetch_all()
    assert all(torch.equal(t[f"w{p}"], up.TENSORS[f"w{p}"]) for p, _, t in got)
    assert uploads.downloads == 0
    assert s.fallback_until == [0.0]  # the port itself is not given up on for uploads
    monkeypatch.undo()
    main = SyncClient(server.url, server.token)
    version, tensors = s._fetch(0, main, 1, {})
    assert version == 0 and torch.equal(tensors["w1"], up.TENSORS["w1"])
    sent(uploads, 1)
    main.close()


# ---- delta downloads (wire/broadcast.py), on both ports --------------------------
PORTS = ["main", "bulk"]


def client_for(server, where: str, token: str = TOKEN) -> SyncClient:
    if where == "main":
        return SyncClient(server.url, token)
    url = with_port(server.url, server.sync.upload_port)
    return SyncClient(url, token, http2=False, sendmsg=True)


def merge_once(server, p: int = 1, step: int = 10) -> int:
    """One update of fragment p on the version served (K = 1): the next version, served."""
    version = server.sync.versions()[p]
    meta = UpdateMeta(
        learner_id="l0", fragment=p, base_version=version, steps=10, tokens=100, learner_step=step
    )
    n = up.LAYOUT.fragments[p].tensors[0].shape[0]
    boss = SyncClient(server.url, server.token)
    try:
        assert boss.upload(meta, {f"w{p}": torch.linspace(-0.5, 0.3, n)}).status == "accepted"
    finally:
        boss.close()
    up.wait_for(lambda: server.sync.versions()[p] == version + 1)
    return version + 1


def raw_get(server, where: str, path: str, token: str = TOKEN) -> tuple[int, dict, bytes]:
    """A GET of `path` as bytes: the main port through libcurl, the upload port by hand."""
    if where == "main":
        c = SyncClient(server.url, token)
        try:
            status, headers, body = c.request("GET", path)
        except SyncRefused as e:
            return e.status, {}, b""
        finally:
            c.close()
        return status, headers, bytes(body)
    with up.connect(server.sync.upload_port) as sock:
        head = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\r\n"
        sock.sendall(head.encode())
        return up.answer(sock)


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].contiguous().view(torch.int32), b[k].contiguous().view(torch.int32))
        for k in a
    )


@pytest.mark.parametrize("where", PORTS)
def test_a_learner_following_deltas_holds_the_served_copy_bit_for_bit(
    make_sync_server, where: str
) -> None:
    """int8-delta: a learner's credential reads the delta from the copy it names; a learner
    fetching whole and the synchronizer's served copy hold the same bits; an unknown token
    or one of a version missed gets the whole fragment (200, never an error)."""
    server = up.ready(make_sync_server, broadcast_encoding="int8-delta")
    follower = client_for(server, where, learner_token(TOKEN, "l0"))
    joiner = client_for(server, where, spare_token(TOKEN, "pod-0"))
    try:
        version, got = follower.download(1)
        assert version == 0 and got.token is not None
        assert torch.equal(got.tensors["w1"], up.TENSORS["w1"])
        for step in range(3):
            version = merge_once(server, step=10 * (step + 2))
            before = follower.bytes_down
            v, got = follower.download(1, broadcast.Held(str(got.token), got.tensors))
            delta_bytes = follower.bytes_down - before
            assert v == version
            served = server.sync.fragments[1].served
            assert served.delta is not None and delta_bytes == len(served.delta)
            assert got.token == served.token and bits_equal(got.tensors, served.held)
            assert not torch.equal(got.tensors["w1"], server.sync.fragments[1].state.params["w1"])
            v, whole = joiner.download(1)
            assert v == version and whole.token == got.token
            assert bits_equal(whole.tensors, got.tensors)
        paths = {
            "unknown": f"/v1/fragments/1?held={'9' * 20}.3",
            "missed": f"/v1/fragments/1?held={served.base.rsplit('.', 1)[0]}.1",
            "none": "/v1/fragments/1",
        }
        for why, path in paths.items():
            status, headers, body = raw_get(server, where, path)
            assert status == 200, why
            assert body == bytes(served.whole), why
            assert int(headers[VERSION_HEADER.lower()]) == version
        status, _, body = raw_get(server, where, f"/v1/fragments/1?held={served.base}")
        assert status == 200 and body == bytes(served.delta)
    finally:
        follower.close()
        joiner.close()


@pytest.mark.parametrize("where", PORTS)
def test_a_stale_held_copy_is_fetched_again_whole(make_sync_server, where: str) -> None:
    """A learner that missed versions names its old copy: the synchronizer answers the whole
    fragment, and the client ends with the copy every follower holds."""
    server = up.ready(make_sync_server, broadcast_encoding="int4-delta")
    c = client_for(server, where, learner_token(TOKEN, "l1"))
    try:
        _, old = c.download(1)
        for step in range(3):
            merge_once(server, step=10 * (step + 2))
        version, got = c.download(1, broadcast.Held(str(old.token), old.tensors))
        served = server.sync.fragments[1].served
        assert version == 3 and got.token == served.token
        assert bits_equal(got.tensors, served.held)
    finally:
        c.close()


@pytest.mark.parametrize("where", PORTS)
def test_a_delta_request_to_the_wrong_shard_is_421(make_sync_server, where: str) -> None:
    servers = [
        make_sync_server(
            shard=i, shards=2, quorum=1, grace=False, upload_port=0,
            broadcast_encoding="int8-delta",
        )
        for i in (0, 1)
    ]  # fmt: skip
    initialized(servers)
    server = servers[0]
    other = next(p for p in range(4) if p not in server.sync.owned)
    status, _, _ = raw_get(server, where, f"/v1/fragments/{other}?held=a.0")
    assert status == 421
    mine = server.sync.owned[0]
    status, _, body = raw_get(server, where, f"/v1/fragments/{mine}?held=a.0")
    assert status == 200 and body == bytes(server.sync.fragments[mine].served.whole)


@pytest.mark.parametrize("where", PORTS)
def test_a_stalled_download_does_not_hold_up_the_others(make_sync_server, where: str) -> None:
    """A client that stops reading a 16 MB whole fragment mid-body: other learners' deltas
    and whole downloads of it go on at once, on the same port."""
    server = make_sync_server(
        quorum=1, grace=False, upload_port=0, body_timeout_s=5.0, broadcast_encoding="int8-delta"
    )
    boss = SyncClient(server.url, server.token)
    boss.join(JoinRequest(learner_id="l0"))
    boss.init(codec.encode({"w": torch.ones(1 << 22)}, {LAYOUT_KEY: BIG.model_dump_json()}))
    reader = client_for(server, where, learner_token(TOKEN, "l0"))
    _, got = reader.download(0)
    meta = UpdateMeta(
        learner_id="l0", fragment=0, base_version=0, steps=10, tokens=100, learner_step=10
    )
    assert boss.upload(meta, {"w": torch.full((1 << 22,), 0.01)}).status == "accepted"
    up.wait_for(lambda: server.sync.versions()[0] == 1)
    boss.close()
    port = int(server.url.rsplit(":", 1)[1]) if where == "main" else server.sync.upload_port
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    try:
        sock.sendall(get(0))
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")  # then nothing more is read
        t0 = time.monotonic()
        version, after = reader.download(0, broadcast.Held(str(got.token), got.tensors))
        _, whole = client_for(server, where).download(0)
        assert time.monotonic() - t0 < 4.0  # well before the stalled one is cut off
        assert version == 1 and bits_equal(after.tensors, whole.tensors)
        assert bits_equal(after.tensors, server.sync.fragments[0].served.held)
    finally:
        sock.close()
        reader.close()


def test_a_learner_holds_its_initial_values_and_follows_deltas(make_sync_server) -> None:
    """int8-delta: a learner whose initial values are the job's version 0 downloads none of
    them (answers of no tensors), then each merge as a delta through the upload port, and holds
    the served copy bit for bit."""
    server = up.ready(make_sync_server, broadcast_encoding="int8-delta")
    s = streamer(server)
    got = s.fetch_all()
    assert s.broadcast_encoding == "int8-delta"
    assert all(torch.equal(t[f"w{p}"], up.TENSORS[f"w{p}"]) for p, _, t in got)
    assert server.sync.learners.totals["bytes_down"] < 4 * 200  # no tensor bytes went down
    ports: dict = {}
    main = SyncClient(server.url, server.token)
    try:
        for step in range(2):
            version = merge_once(server, step=10 * (step + 2))
            before = server.sync.learners.totals["bytes_down"]
            v, tensors = s._fetch(0, main, 1, ports)
            served = server.sync.fragments[1].served
            assert v == version and bits_equal(tensors, served.held)
            assert served.delta is not None
            assert server.sync.learners.totals["bytes_down"] - before == len(served.delta)
            assert s.held[1].token == served.token
        sent(server.server.config.app.state.uploads, 6)
    finally:
        main.close()
        for c in ports.values():
            c.close()


# ---- the float32 read of Theta (GET /v1/fragments/{p}/float32), main port only ----------
def exact_path(p: int) -> str:
    return f"/v1/fragments/{p}/float32"


@pytest.mark.parametrize("encoding", ["bfloat16", "float32", "int8-delta"])
def test_the_float32_read_is_theta_bit_for_bit(make_sync_server, encoding: str) -> None:
    """Whatever the broadcast encoding, the job key reads each fragment's installed Theta in
    float32, bit for bit, with its version; a float32 broadcast answers its served payload
    itself (no copy made)."""
    server = up.ready(make_sync_server, broadcast_encoding=encoding)
    merge_once(server)
    boss = SyncClient(server.url, server.token)
    try:
        for p in range(4):
            version, tensors = boss.exact_fragment(p)
            frag = server.sync.fragments[p]
            assert version == frag.version == (1 if p == 1 else 0)
            assert all(t.dtype == torch.float32 for t in tensors.values())
            assert bits_equal(tensors, frag.state.params)
        _, served = boss.fragment(1)
    finally:
        boss.close()
    theta = server.sync.fragments[1].state.params["w1"]
    assert torch.equal(served["w1"], theta) == (encoding == "float32")  # the broadcast rounds
    if encoding == "float32":
        assert server.sync.exact_fragment(1)[1] is server.sync.fragments[1].served.whole


def test_the_float32_read_is_the_job_keys_only(make_sync_server) -> None:
    """A learner's, a spare's or an evaluator's credential is 403, a wrong one 401; the
    upload port does not serve the route (404: everything else is on the main port)."""
    server = up.ready(make_sync_server)
    for token in (
        learner_token(TOKEN, "l0"),
        spare_token(TOKEN, "pod-0"),
        evaluator_token(TOKEN, "eval"),
    ):
        c = SyncClient(server.url, token)
        with pytest.raises(SyncRefused) as e:
            c.exact_fragment(1)
        c.close()
        assert (e.value.status, e.value.kind) == (403, "forbidden")
        assert "job key only" in e.value.detail
    status, _, _ = raw_get(server, "main", exact_path(1), "wrong")
    assert status == 401
    status, _, body = raw_get(server, "bulk", exact_path(1))
    assert status == 404 and b"main port" in body


def test_the_float32_read_of_a_missing_or_foreign_fragment(make_sync_server) -> None:
    """Before init 409; a fragment that does not exist 422; one another shard owns 421
    naming its owner, and the owner answers it."""
    bare = make_sync_server(quorum=1, grace=False)
    assert raw_get(bare, "main", exact_path(0))[0] == 409
    servers = [make_sync_server(shard=i, shards=2, quorum=1, grace=False) for i in (0, 1)]
    initialized(servers)
    for i, server in enumerate(servers):
        c = SyncClient(server.url, server.token)
        try:
            with pytest.raises(SyncRefused) as e:
                c.exact_fragment(4)
            assert (e.value.status, e.value.kind) == (422, "invalid")
            for p in range(4):
                if p in server.sync.owned:
                    assert bits_equal(c.exact_fragment(p)[1], {f"w{p}": up.TENSORS[f"w{p}"]})
                    continue
                with pytest.raises(SyncRefused) as e:
                    c.exact_fragment(p)
                assert (e.value.status, e.value.kind) == (421, "wrong_shard")
                assert f"owned by shard {1 - i}" in e.value.detail
        finally:
            c.close()


def test_a_second_float32_read_of_a_fragment_meanwhile_is_503(make_sync_server) -> None:
    """One copy of a fragment at a time: while one is being encoded (here: waiting for the
    fragment's lock, which the test holds as an update's admission would) a second is 503
    with Retry-After, other fragments are read; the first completes once the lock is free,
    and the export's reader asks again through 503s until it gets its copy."""
    from ddiloco.cli.export import exact_fragment

    server = up.ready(make_sync_server)
    frag = server.sync.fragments[1]
    first: dict[str, object] = {}

    def read() -> None:
        c = SyncClient(server.url, server.token)
        try:
            first["got"] = c.exact_fragment(1)
        finally:
            c.close()

    frag.lock.acquire()
    reader = threading.Thread(target=read)
    try:
        reader.start()
        up.wait_for(frag.exporting.locked)
        conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
        conn.request("GET", exact_path(1), headers={"Authorization": f"Bearer {TOKEN}"})
        busy = conn.getresponse()
        assert busy.status == 503 and busy.getheader("retry-after") == "1"
        assert b"being read already" in busy.read()
        conn.close()
        assert raw_get(server, "main", exact_path(2))[0] == 200
    finally:
        frag.lock.release()
        reader.join(timeout=10)
    version, tensors = first["got"]  # type: ignore[misc]
    assert version == 0 and bits_equal(tensors, {"w1": up.TENSORS["w1"]})
    frag.exporting.acquire()
    threading.Timer(1.5, frag.exporting.release).start()
    boss = SyncClient(server.url, server.token)
    try:
        t0 = time.monotonic()
        assert exact_fragment(boss, 1)[0] == 0
        assert time.monotonic() - t0 >= 1.5
    finally:
        boss.close()
