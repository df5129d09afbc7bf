"""Downloads from the bulk port (synchronizer/bulk.py: `GET /v1/fragments/{p}` on the upload
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

import socket
import time
from pathlib import Path

import pytest
import torch

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.streaming import Streamer
from ddiloco.learner.uploads import with_port
from ddiloco.synchronizer import bulk, codec, tls
from ddiloco.synchronizer.auth import StaticTokens, learner_token, spare_token
from ddiloco.synchronizer.client import ClientTLS, SyncClient, SyncRefused, SyncUnavailable
from ddiloco.synchronizer.protocol import (
    LAYOUT_KEY,
    VERSION_HEADER,
    FragmentSpec,
    JoinRequest,
    Layout,
    TensorSpec,
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


def sent(port: bulk.UploadServer, n: int) -> None:
    """The port counts `n` downloads sent whole (counted just after the last byte went out:
    the client may have it all first)."""
    up.wait_for(lambda: port.downloads >= n, timeout=5)
    time.sleep(0.05)
    assert port.downloads == n


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
    for server in servers:
        boss = SyncClient(server.url, server.token)
        boss.join(JoinRequest(learner_id="l0"))
        boss.init(codec.encode(up.TENSORS, {LAYOUT_KEY: up.LAYOUT.model_dump_json()}))
        boss.close()
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
    port = bulk.UploadServer(
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


@pytest.mark.parametrize("how", ["turned_away", "no_fragments"])
def test_a_learner_falls_back_to_the_main_port(make_sync_server, monkeypatch, how: str) -> None:
    """A port at its cap (503) sends that download to the main URL, and the next tries the
    port again; a port that serves no fragments (404: an older synchronizer's) is not asked
    again."""
    server = up.ready(make_sync_server)
    if how == "turned_away":
        monkeypatch.setattr(bulk, "MAX_CONNECTIONS", 0)
    else:
        monkeypatch.setattr(bulk, "_FRAGMENT", bulk.re.compile("^$"))
    uploads = server.server.config.app.state.uploads
    s = streamer(server)
    got = s.fetch_all()
    assert all(torch.equal(t[f"w{p}"], up.TENSORS[f"w{p}"]) for p, _, t in got)
    assert uploads.downloads == 0
    assert s.no_downloads == [how == "no_fragments"]
    assert s.fallback_until == [0.0]  # the port itself is not given up on for uploads
    monkeypatch.undo()
    main = SyncClient(server.url, server.token)
    version, tensors = s._fetch(0, main, 1, {})
    assert version == 0 and torch.equal(tensors["w1"], up.TENSORS["w1"])
    sent(uploads, 1 if how == "turned_away" else 0)
    main.close()
