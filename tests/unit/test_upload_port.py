"""The upload port (synchronizer/upload_port.py) as learners use it: in-process synchronizers on
real loopback sockets, the learner's own Streamer.

    pytest tests/unit/test_upload_port.py

A learner posts each fragment's updates to its owner shard's upload port, which the shard
named at join, and downloads fragments from it (tests/unit/test_download_port.py); when that port cannot be reached the uploads go
to the main URL and nothing is lost; an explicit DDILOCO_UPLOAD_URL list is checked against
the shards. Then the port against hostile clients, over raw sockets: a malformed head is 400
and closed, a trickled body 408 at its deadline, silent sockets are closed and cannot keep a
learner out, a credential holds a few connections at most, and an update the port turns
away at its cap goes to the main URL. The same refusals against a synchronizer process are
in tests/e2e/test_upload_port.py; fuzzed heads in tests/unit/test_upload_port_fuzz.py.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import ssl
import threading
import time

import pytest
import torch

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.streaming import Streamer
from ddiloco.learner.sync_client import ClientTLS, SyncClient, SyncUnavailable
from ddiloco.learner.uploads import upload_overrides, with_port
from ddiloco.local.processes import free_port
from ddiloco.synchronizer import upload_port
from ddiloco.wire import codec, tls
from ddiloco.wire.auth import StaticTokens, learner_token, spare_token
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    Heartbeat,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)
from tests.conftest import TOKEN

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


def test_join_names_the_upload_port_and_updates_and_downloads_go_there(make_sync_server) -> None:
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
    # each shard's two fragments came in through its upload port, and went out through it
    assert [uploads_of(server) for server in servers] == [2, 2]
    assert all(x.server.config.app.state.uploads.downloads >= 2 for x in servers)
    assert s.upload_urls == [with_port(x.url, x.sync.upload_port) for x in servers]
    # to the upload port the parts go from their own memory (upload_sender.py)
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
    assert torch.allclose(tensors["w1"].float(), TENSORS["w1"] + step, atol=1e-2)
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
    deadline = time.time() + 5  # the port counts an upload once its answer is sent
    while uploads_of(server) < 1 and time.time() < deadline:
        time.sleep(0.01)
    assert uploads_of(server) == 1
    up.close()
    c.close()


# ---- hostile input: strict heads, deadlines, caps (raw sockets on loopback) --------------
def ready(make_sync_server, **settings: object):
    """A synchronizer with its upload port, learners l0 and l1 joined, the model initialized."""
    server = make_sync_server(quorum=1, grace=False, upload_port=0, **settings)
    boss = SyncClient(server.url, server.token)
    for learner in ("l0", "l1"):
        boss.join(JoinRequest(learner_id=learner))
    boss.init(codec.encode(TENSORS, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
    boss.close()
    return server


def served(server) -> list[tuple[int, bytes]]:
    """Every fragment as the synchronizer serves it (version, bytes)."""
    out = []
    for p in range(len(LAYOUT.fragments)):
        version, body = server.sync.fragment(p)
        out.append((version, bytes(body)))
    return out


def update(learner: str = "l0", p: int = 1, step: int = 10) -> bytes:
    meta = UpdateMeta(
        learner_id=learner, fragment=p, base_version=0, steps=10, tokens=100, learner_step=step
    )
    n = LAYOUT.fragments[p].tensors[0].shape[0]
    return codec.encode({f"w{p}": torch.full((n,), 0.25)}, meta.to_metadata())


def request(
    *fields: str, p: int = 1, token: str | None = TOKEN, length: str | None = "64"
) -> bytes:
    """A learner's request head (CRLF, Host, credential, Content-Length) with `fields` added."""
    lines = [f"POST /v1/fragments/{p}/updates HTTP/1.1", "Host: 127.0.0.1"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join([*lines, *fields]) + "\r\n\r\n").encode("latin-1")


def connect(port: int, context: ssl.SSLContext | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return context.wrap_socket(sock, server_hostname="127.0.0.1") if context else sock


def answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    resp = http.client.HTTPResponse(sock)  # type: ignore[arg-type]
    resp.begin()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()


def refused(got: tuple[int, dict[str, str], bytes], status: int, kind: str) -> dict[str, str]:
    assert got[0] == status, got
    err = json.loads(got[2])
    assert err["error"] == kind and err["detail"], err
    return err


def closed(sock: socket.socket, within: float = 5.0) -> bool:
    """The server closed the connection (EOF or a reset) within `within` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def held_mid_body(server, token: str, n: int) -> list[socket.socket]:
    """`n` connections whose request passed its checks and whose body is read no further:
    each holds its place against the caps until closed (each counted before the next is
    opened: none is taken for a silent one)."""
    uploads = server.server.config.app.state.uploads
    out = []
    for _ in range(n):
        held = uploads.authenticated
        sock = connect(server.sync.upload_port)
        sock.sendall(request(token=token, length="64") + b"\x00" * 8)
        out.append(sock)
        wait_for(lambda held=held: uploads.authenticated > held)
    return out


def wait_for(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


MALFORMED = {
    "length_of_5000_digits": request(length="1" * 5000),
    "length_negative": request(length="-1"),
    "length_letters": request(length="abc"),
    "length_signed": request(length="+5"),
    "length_hex": request(length="0x21"),
    "length_exponent": request(length="1e3"),
    "length_empty": request(length=""),
    "lengths_that_differ": request("Content-Length: 65"),
    "bare_lf": request().replace(b"\r\n", b"\n"),
    "bare_cr_ending": request().replace(b"Host: 127.0.0.1\r\n", b"Host: 127.0.0.1\r"),
    "te_folded_beside_length": request().replace(b"\r\n\r\n", b"\r\nTransfer-Encoding\n: chunked\r\n\r\n"),
    "te_space_before_colon": request("Transfer-Encoding : chunked"),
    "te_beside_length": request("Transfer-Encoding: chunked"),
    "te_unknown": request("Transfer-Encoding: gzip", length=None),
    "obs_fold": request("X-Note: a", " folded"),
    "nul_in_value": request("X-Note: a\x00b"),
    "cr_in_value": request("X-Note: a\rb"),
    "two_hosts": request("Host: 127.0.0.2"),
    "no_host": request().replace(b"Host: 127.0.0.1\r\n", b""),
    "space_in_name": request("X Note: a"),
    "credential_in_a_bad_line": request(f"Authorization : Bearer {TOKEN}", token=None),
    "junk_request_line": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_head_is_400_at_once_and_closed(make_sync_server, caplog, case: str) -> None:
    """Anything but a well-formed HTTP/1.1 head (RFC 9112: a malformed Content-Length is
    400, not 411; line endings are CRLF; one Host) is answered 400 before the body, and the
    connection closed: its bytes are never taken for a body or a next request. The answer
    and the log say what was wrong without quoting the line (it may hold a credential)."""
    server = ready(make_sync_server)
    before = served(server)
    t0 = time.monotonic()
    with connect(server.sync.upload_port) as sock:
        sock.sendall(MALFORMED[case] + b"x" * 64)
        got = answer(sock)
        assert closed(sock)
    refused(got, 400, "bad_request")
    assert got[1]["connection"] == "close"
    assert time.monotonic() - t0 < 2.0
    assert served(server) == before
    assert TOKEN not in got[2].decode() and TOKEN not in caplog.text


def test_a_length_of_5000_digits_is_400_over_tls_too(make_sync_server, tmp_path) -> None:
    """The same port over TLS (its own listener on the same synchronizer)."""
    ca = tls.issue_ca("test CA")
    cert, key = tls.write_pair(
        tls.issue_server(ca, ["localhost"], ["127.0.0.1"]), tmp_path / "s.crt", tmp_path / "s.key"
    )
    ca_file = tls.write_pem(ca.cert_pem, tmp_path / "ca.crt")
    server = ready(make_sync_server)
    context = tls.server_context(cert, key, alpn=["http/1.1"])
    port = upload_port.UploadServer(
        server.sync, StaticTokens(TOKEN), server.sync.settings, context=context
    )
    port.start()
    try:
        client = ssl.create_default_context(cafile=ca_file)
        with connect(port.port, client) as sock:
            sock.sendall(request(length="1" * 5000))
            got = answer(sock)
        refused(got, 400, "bad_request")
        with connect(port.port, client) as sock:  # and a good one after it
            body = update()
            sock.sendall(request(length=str(len(body))) + body)
            assert answer(sock)[0] == 200
    finally:
        port.close()


def test_connection_close_ends_the_connection_after_a_refusal(make_sync_server) -> None:
    """A body refused for what it holds keeps the connection, unless the request said
    `Connection: close`."""
    server = ready(make_sync_server)
    garbage = b"\xff" * 64
    with connect(server.sync.upload_port) as sock:
        sock.sendall(request("Connection: close") + garbage)
        got = answer(sock)
        refused(got, 422, "invalid")
        assert got[1]["connection"] == "close"
        assert closed(sock)
    with connect(server.sync.upload_port) as sock:  # without it, the connection stays
        sock.sendall(request() + garbage)
        got = answer(sock)
        refused(got, 422, "invalid")
        assert "connection" not in got[1]
        body = update()
        sock.sendall(request(length=str(len(body))) + body)
        assert answer(sock)[0] == 200


def test_a_trickled_body_is_408_at_its_deadline(make_sync_server) -> None:
    """A body that sends a byte every 0.3 s never waits `body_timeout_s` (1 s) for a read,
    but must be whole in body_timeout_s + size / MIN_BODY_RATE: 408 and closed then, where
    it used to hold its thread and buffer for as long as it went on."""
    server = ready(make_sync_server, body_timeout_s=1.0)
    before = served(server)
    t0 = time.monotonic()
    with connect(server.sync.upload_port) as sock:
        sock.sendall(request(length="1000"))
        while not select.select([sock], [], [], 0.3)[0]:
            sock.sendall(b"\x00")
            assert time.monotonic() - t0 < 10, "never answered"
        got = answer(sock)
        assert closed(sock)
    assert "slower than" in refused(got, 408, "timeout")["detail"]
    assert 0.9 < time.monotonic() - t0 < 1.0 + 1000 / upload_port.MIN_BODY_RATE + 2.0
    assert served(server) == before


def test_a_silent_connection_is_closed_after_the_head_deadline(make_sync_server) -> None:
    server = ready(make_sync_server)
    t0 = time.monotonic()
    with connect(server.sync.upload_port) as sock:
        assert closed(sock, upload_port.HEAD_TIMEOUT_S + 3.0)
    assert (
        upload_port.HEAD_TIMEOUT_S * 0.9 < time.monotonic() - t0 < upload_port.HEAD_TIMEOUT_S + 2.0
    )


def test_silent_sockets_cannot_keep_a_learner_out(make_sync_server) -> None:
    """MAX_CONNECTIONS sockets that send nothing, with no credential: a learner's upload
    still gets in at once (each connection accepted past MAX_ANONYMOUS closes the oldest
    silent one; the learner's sends its head at once and holds its place by its credential),
    and every silent one is closed within the head deadline."""
    server = ready(make_sync_server)
    port = server.sync.upload_port
    uploads = server.server.config.app.state.uploads
    silent = [connect(port) for _ in range(upload_port.MAX_CONNECTIONS)]
    try:
        poster = SyncClient(
            f"http://127.0.0.1:{port}", learner_token(TOKEN, "l0"), http2=False, sendmsg=True
        )
        assert poster.post_update(1, [update()]).status == "accepted"
        assert uploads.answers[("http", "503")] == 0  # nobody was turned away
        assert len(uploads.anonymous) <= upload_port.MAX_ANONYMOUS
        assert all(closed(s, upload_port.HEAD_TIMEOUT_S + 3.0) for s in silent)
        poster.close()
    finally:
        for s in silent:
            s.close()


def test_one_credential_holds_at_most_its_cap(make_sync_server) -> None:
    """A learner's credential holds MAX_PER_CREDENTIAL connections; one more is 503 (the
    learner posts to the main port then), while other learners and the job key get in."""
    server = ready(make_sync_server)
    port = server.sync.upload_port
    l0 = learner_token(TOKEN, "l0")
    holders = held_mid_body(server, l0, upload_port.MAX_PER_CREDENTIAL)
    holders += held_mid_body(
        server, TOKEN, upload_port.MAX_PER_CREDENTIAL + 1
    )  # the job key: no cap
    try:
        with connect(port) as sock:
            body = update("l0")
            sock.sendall(request(token=l0, length=str(len(body))) + body)
            got = answer(sock)
        refused(got, 503, "unavailable")
        assert got[1]["connection"] == "close" and got[1]["retry-after"] == "1"
        for token, learner in ((learner_token(TOKEN, "l1"), "l1"), (TOKEN, "l0")):
            with connect(port) as sock:
                body = update(learner)
                sock.sendall(request(token=token, length=str(len(body))) + body)
                assert answer(sock)[0] == 200
    finally:
        for s in holders:
            s.close()


def test_credentials_are_checked_before_and_after_the_body(make_sync_server) -> None:
    """A spare's credential is 403 before the body; a learner's may post only its own
    updates (403 after the body, the connection kept)."""
    server = ready(make_sync_server)
    port = server.sync.upload_port
    before = served(server)
    with connect(port) as sock:
        sock.sendall(request(token=spare_token(TOKEN, "pod-0"), length=str(1 << 30)))
        got = answer(sock)
        assert closed(sock)
    refused(got, 403, "forbidden")
    with connect(port) as sock:
        other = update("l1")
        sock.sendall(request(token=learner_token(TOKEN, "l0"), length=str(len(other))) + other)
        refused(answer(sock), 403, "forbidden")
        assert served(server) == before
        own = update("l0")
        sock.sendall(request(token=learner_token(TOKEN, "l0"), length=str(len(own))) + own)
        assert answer(sock)[0] == 200


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_port_at_its_cap_turns_the_client_away(
    make_sync_server, monkeypatch, tmp_path, scheme: str
) -> None:
    """At the connection cap the port answers 503 (over TLS: closes before the handshake);
    the client says `turned_away`, not `unreached`: the learner posts to the main port."""
    monkeypatch.setattr(upload_port, "MAX_CONNECTIONS", 0)
    server = ready(make_sync_server)
    tls_client, context = None, None
    if scheme == "https":
        ca = tls.issue_ca("test CA")
        pair = tls.issue_server(ca, ["localhost"], ["127.0.0.1"])
        cert, key = tls.write_pair(pair, tmp_path / "s.crt", tmp_path / "s.key")
        context = tls.server_context(cert, key, alpn=["http/1.1"])
        tls_client = ClientTLS(ca_file=tls.write_pem(ca.cert_pem, tmp_path / "ca.crt"))
    port = upload_port.UploadServer(
        server.sync, StaticTokens(TOKEN), server.sync.settings, context=context
    )
    port.start()
    try:
        for sendmsg in (True, False):  # from the parts' memory, and through libcurl
            c = SyncClient(
                f"{scheme}://127.0.0.1:{port.port}", TOKEN, http2=False, sendmsg=sendmsg,
                tls=tls_client, timeout=10,
            )  # fmt: skip
            with pytest.raises(SyncUnavailable) as e:
                c.post_update(1, [update()])
            assert e.value.turned_away and not e.value.unreached, e.value
            c.close()
    finally:
        port.close()


def test_an_upload_port_at_its_cap_sends_that_update_to_the_main_port(
    make_sync_server, monkeypatch
) -> None:
    """The learner's updates that the upload port turns away (503 at its cap) go to the main
    port at once, none lost; once the port has room the next ones go to it again."""
    monkeypatch.setattr(upload_port, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(upload_port, "MAX_ANONYMOUS", 1)
    server = make_sync_server(quorum=1, grace=False, upload_port=0)
    cfg = LearnerConfig(sync_url=server.url, token=server.token, learner_id="l0")
    s = Streamer(cfg, LAYOUT, lambda: TENSORS)
    s.fetch_all()  # joined and initialized
    uploads = server.server.config.app.state.uploads
    # fetch_all closed its download connection; the port uncounts it once it reads the close
    wait_for(lambda: uploads.authenticated == 0)
    holders = held_mid_body(server, TOKEN, 2)
    s.report(
        Heartbeat(
            learner_id="l0", step=10, steps=[10] * 4, tokens=[100] * 4, base_versions=[0] * 4,
            step_seconds=0.1,
        )
    )  # fmt: skip
    s.start()

    def send(p: int) -> None:
        version = server.sync.versions()[p]
        meta = UpdateMeta(
            learner_id="l0", fragment=p, base_version=version, steps=10, tokens=100,
            learner_step=10 + version, incarnation=s.incarnation,
        )  # fmt: skip
        n = LAYOUT.fragments[p].tensors[0].shape[0]
        s.send(meta, {f"w{p}": torch.full((n,), 0.5)})

    try:
        for p in (0, 1):
            send(p)
        assert s.outbox.wait_empty(20)
        assert [r[2] for r in sorted(s.results())] == ["accepted"] * 2
        assert uploads_of(server) == 0  # both went to the main port
        assert s.fallback_until[0] == 0.0  # that update only: the port is not given up on
        for h in holders:
            h.close()
        # room again, beside the learner's own downloads of the merges (one per shard thread
        # at any moment): they must not be what turns its next updates away
        monkeypatch.setattr(upload_port, "MAX_CONNECTIONS", 4)
        wait_for(lambda: uploads.authenticated <= 2)
        for p in (2, 3):
            send(p)
        assert s.outbox.wait_empty(20)
        assert [r[2] for r in sorted(s.results())] == ["accepted"] * 2
        assert uploads_of(server) == 2
    finally:
        for h in holders:
            h.close()
        s.close()
