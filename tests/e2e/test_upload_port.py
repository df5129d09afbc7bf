"""Hostile input against a real synchronizer's upload port (synchronizer/upload_port.py): the main
port's contract on the one route it serves, over raw sockets.

    pytest tests/e2e/test_upload_port.py -m e2e

One `ddiloco synchronizer --upload-port P` process serves the module (a learner joined, the
model initialized, a 1 s body timeout). Refusals that come before the body (401, 404, 405,
411, 413, 431, 400, 505) come at once and close the connection, a malformed head (its
Content-Length, line endings, Host, a NUL or CR in a value) being 400; 408 comes after the
timeout, or when a body trickles slower than the port's floor rate;
a body refused for what it holds (422) leaves the connection usable. Nothing refused changes
a served fragment; the one good update merges once, and its re-send is a duplicate.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ddiloco.learner.sync_client import SyncClient
from ddiloco.local.processes import free_port, terminate_all
from ddiloco.wire import codec
from ddiloco.wire.protocol import LAYOUT_KEY, JoinRequest
from tests.e2e.test_hostile_input import LAYOUT, PARAMS, TOKEN, UPDATE, Sync, answer, meta, refused

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
BODY_TIMEOUT_S = 1.0


class Uploads(Sync):
    """The synchronizer (`port`, `client`) and its upload port (`upload`)."""

    def __init__(self, port: int, upload: int, log: Any) -> None:
        super().__init__(port, log)
        self.upload = upload

    def raw(self, head: str, first: bytes = b"") -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.upload), timeout=10)
        sock.sendall(head.encode() + b"\r\n" + first)
        return sock


def head(method: str, path: str, token: str | None = TOKEN, version: str = "HTTP/1.1", **h: str):
    lines = [f"{method} {path} {version}", "Host: 127.0.0.1"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in h.items()]
    return "\r\n".join(lines) + "\r\n"


@pytest.fixture(scope="module")
def up(
    tmp_path_factory: pytest.TempPathFactory, synchronizer_process: Callable[..., Any]
) -> Iterator[Uploads]:
    upload = free_port()
    proc = synchronizer_process(
        tmp_path_factory.mktemp("uploads"),
        TOKEN,
        "--quorum",
        "1",
        "--no-grace",
        "--upload-port",
        str(upload),
        DDILOCO_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S),
    )
    s = Uploads(proc.port, upload, proc.log)
    try:
        proc.start()
        joined = s.client.join(JoinRequest(learner_id="l0", layout_digest=LAYOUT.digest()))
        assert joined.upload_port == upload
        s.client.init(codec.encode(PARAMS, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
        yield s
        assert "Traceback" not in s.log.read_text(), s.log.read_text()[-5000:]
    finally:
        terminate_all([proc.child])


@pytest.fixture(autouse=True)
def unchanged(request: pytest.FixtureRequest, up: Uploads) -> Iterator[None]:
    before = up.fragments()
    yield
    if "good_update" not in request.node.name:
        assert up.fragments() == before
    assert up.client.healthy()


GOOD = {"b": torch.full((4,), 0.1), "w": torch.full((4, 4), 0.1)}
TOO_BIG = str(1 << 31)
BEFORE_THE_BODY = {
    "no_token": (head("POST", UPDATE, token=None, Content_Length="64"), 401, "unauthorized"),
    "wrong_token": (head("POST", UPDATE, token="nope", Content_Length="64"), 401, "unauthorized"),
    "declared_huge": (head("POST", UPDATE, Content_Length=TOO_BIG), 413, "too_large"),
    "no_fragment": (head("POST", "/v1/fragments/7/updates", Content_Length=TOO_BIG), 413, "too_large"),
    "chunked": (head("POST", UPDATE, Transfer_Encoding="chunked"), 411, "length_required"),
    "no_length": (head("POST", UPDATE), 411, "length_required"),
    "other_route": (head("POST", "/v1/heartbeat", Content_Length="2"), 404, "not_found"),
    "get": (head("GET", UPDATE), 405, "method_not_allowed"),
    "http10": (head("POST", UPDATE, version="HTTP/1.0", Content_Length="2"), 505, "http_version_not_supported"),
    "bad_line": ("POST  /v1/x HTTP/1.1\r\n", 400, "bad_request"),
    "bad_field": (head("POST", UPDATE) + "no colon here\r\n", 400, "bad_request"),
    "two_lengths": (head("POST", UPDATE, Content_Length="2") + "Content-Length: 3\r\n", 400, "bad_request"),
    "huge_head": (head("POST", UPDATE, X_Pad="a" * (70 << 10)), 431, "request_header_fields_too_large"),
    **{  # RFC 9112: a Content-Length that is not digits is malformed (400), not missing (411)
        f"length_{name}": (head("POST", UPDATE, Content_Length=value), 400, "bad_request")
        for name, value in {
            "5000_digits": "1" * 5000, "negative": "-1", "letters": "abc", "signed": "+5",
            "hex": "0x21", "exponent": "1e3", "empty": "",
        }.items()
    },
    "bare_lf": (head("POST", UPDATE, Content_Length="2").replace("\r\n", "\n"), 400, "bad_request"),
    "te_folded": (head("POST", UPDATE, Content_Length="2") + "Transfer-Encoding\n: chunked\r\n", 400, "bad_request"),
    "te_and_length": (head("POST", UPDATE, Content_Length="2", Transfer_Encoding="chunked"), 400, "bad_request"),
    "nul_in_value": (head("POST", UPDATE, Content_Length="2", X_A="a\x00b"), 400, "bad_request"),
    "cr_in_value": (head("POST", UPDATE, Content_Length="2", X_A="a\rb"), 400, "bad_request"),
    "two_hosts": (head("POST", UPDATE, Content_Length="2", Host="127.0.0.2"), 400, "bad_request"),
    "no_host": (head("POST", UPDATE, Content_Length="2").replace("Host: 127.0.0.1\r\n", ""), 400, "bad_request"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BEFORE_THE_BODY))
def test_refused_before_the_body(up: Uploads, case: str) -> None:
    text, status, kind = BEFORE_THE_BODY[case]
    counted = kind in ("unauthorized", "too_large")
    before = up.refusals().get(kind, 0)
    t0 = time.monotonic()
    with up.raw(text, b"x" * 10) as sock:
        got, headers, body = answer(sock)
        assert sock.recv(1) == b""  # and the connection closed: its body is never read
    refused(got, body, status, kind)
    assert time.monotonic() - t0 < 2.0
    assert headers.get("connection") == "close"
    if kind == "unauthorized":
        assert headers["www-authenticate"] == "Bearer"
    assert up.refusals().get(kind, 0) == before + counted


def test_stalled_body_times_out(up: Uploads) -> None:
    before = up.refusals().get("timeout", 0)
    t0 = time.monotonic()
    with up.raw(head("POST", UPDATE, Content_Length="1000"), b"\x10" * 10) as sock:
        status, headers, body = answer(sock)
    refused(status, body, 408, "timeout")
    assert BODY_TIMEOUT_S * 0.9 < time.monotonic() - t0 < BODY_TIMEOUT_S + 3.0
    assert headers.get("connection") == "close"
    assert up.refusals().get("timeout", 0) == before + 1


def test_a_trickled_body_times_out_at_its_deadline(up: Uploads) -> None:
    """A byte every 0.4 s keeps every read under the 1 s body timeout; the body must still
    be whole within the timeout plus its size at bulk.MIN_BODY_RATE."""
    before = up.refusals().get("timeout", 0)
    t0 = time.monotonic()
    with up.raw(head("POST", UPDATE, Content_Length="1000")) as sock:
        while not select.select([sock], [], [], 0.4)[0]:
            sock.sendall(b"\x10")
            assert time.monotonic() - t0 < 10, "the trickle was never cut off"
        status, headers, body = answer(sock)
    assert "slower than" in refused(status, body, 408, "timeout")["detail"]
    assert headers.get("connection") == "close"
    assert up.refusals().get("timeout", 0) == before + 1


def test_a_malformed_body_is_refused_and_the_connection_kept(up: Uploads) -> None:
    garbage = b"\xff" * 64
    nan = codec.encode({"b": torch.full((4,), float("nan")), "w": GOOD["w"]}, meta())
    with up.raw(head("POST", UPDATE, Content_Length=str(len(garbage))), garbage) as sock:
        status, headers, body = answer(sock)
        refused(status, body, 422, "invalid")
        assert headers.get("connection") != "close"
        sock.sendall(head("POST", UPDATE, Content_Length=str(len(nan))).encode() + b"\r\n" + nan)
        status, _, body = answer(sock)  # the same connection: the first body was read whole
        assert "NaN" in refused(status, body, 422, "invalid")["detail"]


def test_a_good_update_merges_once_over_the_upload_port(up: Uploads) -> None:
    before = up.fragments()
    merges = up.client.status().merges
    payload = codec.encode(GOOD, meta(step=1000))
    poster = SyncClient(f"http://127.0.0.1:{up.upload}", TOKEN, http2=False, timeout=10)
    try:
        assert poster.post_update(1, payload).status == "accepted"
        assert poster.http_version == "HTTP/1.1"
        deadline = time.time() + 10
        while up.fragments()[1][0] == before[1][0]:
            assert time.time() < deadline, "the good update never merged"
            time.sleep(0.05)
        assert poster.post_update(1, payload).status == "duplicate"  # exactly once
    finally:
        poster.close()
    after = up.fragments()
    assert after[0] == before[0] and after[1][0] == "1"
    moved = codec.decode(after[1][1])["w"].float() - PARAMS["w"]
    # the one update of 0.1 through the outer Nesterov step (lr 0.7, mu 0.9), served in bf16
    assert torch.allclose(moved, torch.full_like(moved, 0.7 * 1.9 * 0.1), atol=0.01)
    assert up.client.status().merges == merges + 1


def test_a_head_sent_a_byte_at_a_time_is_cut_off(up: Uploads) -> None:
    """The head must be whole within the body timeout of its first byte: a client trickling
    it cannot hold one of the port's threads (while an idle keep-alive may wait longer)."""
    text = head("POST", UPDATE, Content_Length="64").encode()
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", up.upload), timeout=10) as sock:
        closed = False
        for byte in text:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.2)
            if time.monotonic() - t0 > BODY_TIMEOUT_S + 3.0:
                break
        if not closed:
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""
    assert time.monotonic() - t0 < BODY_TIMEOUT_S + 3.0
    with up.raw(head("GET", UPDATE)) as sock:  # and the port serves the next one
        status, _, body = answer(sock)
    refused(status, body, 405, "method_not_allowed")
