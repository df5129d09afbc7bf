"""Fuzzed request heads against the upload port (synchronizer/upload_port.py): a real synchronizer
in-process, its real port on loopback, one raw connection per input.

    pytest tests/unit/test_upload_port_fuzz.py

Each input is a learner's valid request mutated: header names and values replaced, fields
repeated or dropped, line endings changed, Content-Length made of signs, letters, spaces or
thousands of digits, junk bytes spliced in; then the body it declares (a real update or
junk), and the client's half of the connection closed so that nothing waits on it. Every
input is answered or closed within a bound, never with a 5xx (but a 505 to a request line of
another HTTP version), and the served fragments stay byte-identical (quorum 2 with one
learner: no update can merge, whatever is accepted).
"""

from __future__ import annotations

import http.client
import socket
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.learner.sync_client import SyncClient
from ddiloco.wire import codec
from ddiloco.wire.auth import learner_token
from ddiloco.wire.protocol import LAYOUT_KEY, JoinRequest, UpdateMeta
from tests.conftest import TOKEN
from tests.unit.test_upload_port import LAYOUT, TENSORS

BOUND_S = 5.0
"""An answer or a close comes within this (the body timeout is 1 s; the head's, 2 s)."""

UPDATE = codec.encode(
    {"w1": TENSORS["w1"] * 0.01},
    UpdateMeta(
        learner_id="l0", fragment=1, base_version=0, steps=10, tokens=100, learner_step=10
    ).to_metadata(),
)
FIELDS = [
    (b"Host", b"127.0.0.1"),
    (b"Authorization", b"Bearer " + learner_token(TOKEN, "l0").encode()),
    (b"Content-Type", b"application/octet-stream"),
    (b"Content-Length", str(len(UPDATE)).encode()),
    (b"User-Agent", b"ddiloco"),
]
NAMES = st.sampled_from(
    [
        b"Host",
        b"Content-Length",
        b"content-length",
        b"Transfer-Encoding",
        b"Authorization",
        b"Connection",
        b"Expect",
        b"Transfer-Encoding ",
        b" Host",
        b"X-A",
        b"",
    ]
) | st.binary(max_size=8)
VALUES = (
    st.sampled_from(
        [
            b"chunked",
            b"close",
            b"100-continue",
            b"Bearer " + TOKEN.encode(),
            b"Bearer nope",
            b"-1",
            b"+5",
            b"0x21",
            b"1e3",
            b"",
            b" 64",
            b"64, 64",
            b"64, 65",
            b"9" * 5000,
            b"0" * 30 + b"1",
            str(1 << 40).encode(),
            b"a\x00b",
            b"a\rb",
            b"a\nb",
            b"\xff\xfe",
        ]
    )
    | st.binary(max_size=12)
    | st.integers(min_value=0, max_value=1 << 20).map(lambda n: str(n).encode())
)
ENDINGS = st.sampled_from([b"\r\n", b"\n", b"\r", b"\r\r\n", b" \r\n", b"\r\n "])
REQUEST_LINES = st.sampled_from(
    [
        b"POST /v1/fragments/1/updates HTTP/1.1",
        b"POST /v1/fragments/9/updates HTTP/1.1",
        b"POST /v1/fragments/1/updates HTTP/1.0",
        b"POST /v1/fragments/1/updates HTTP/2.0",
        b"GET /v1/fragments/1/updates HTTP/1.1",
        b"POST  /v1/fragments/1/updates HTTP/1.1",
        b"POST /v1/fragments/1/updates?x=1 HTTP/1.1",
        b"POST http://127.0.0.1/v1/fragments/1/updates HTTP/1.1",
        b"POST /v1/heartbeat HTTP/1.1",
        b"post /v1/fragments/1/updates HTTP/1.1",
        b"POST /v1/fragments/1/updates",
    ]
)


@st.composite
def inputs(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """(head, body): a learner's request with a few mutations."""
    line = b"POST /v1/fragments/1/updates HTTP/1.1"
    fields = list(FIELDS)
    endings = [b"\r\n"] * (len(fields) + 2)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["line", "name", "value", "dup", "drop", "ending", "add"]))
        i = draw(st.integers(0, max(0, len(fields) - 1)))
        if op == "line":
            line = draw(REQUEST_LINES)
        elif op == "name" and fields:
            fields[i] = (draw(NAMES), fields[i][1])
        elif op == "value" and fields:
            fields[i] = (fields[i][0], draw(VALUES))
        elif op == "dup" and fields:
            fields.insert(i, (fields[i][0], draw(VALUES | st.just(fields[i][1]))))
            endings.append(b"\r\n")
        elif op == "drop" and fields:
            del fields[i]
        elif op == "ending":
            endings[draw(st.integers(0, len(endings) - 1))] = draw(ENDINGS)
        elif op == "add":
            fields.insert(i, (draw(NAMES), draw(VALUES)))
            endings.append(b"\r\n")
    lines = [line, *(name + b": " + value for name, value in fields), b""]
    head = b"".join(text + ending for text, ending in zip(lines, endings, strict=False))
    if draw(st.booleans()):  # junk spliced in somewhere
        at = draw(st.integers(0, len(head)))
        head = head[:at] + draw(st.binary(min_size=1, max_size=6)) + head[at:]
    body = UPDATE if draw(st.booleans()) else b"\xff" * draw(st.integers(0, 300))
    return head, body


def exchange(port: int, head: bytes, body: bytes) -> tuple[int | None, float]:
    """Send one input and half-close; (the status answered or None for a close, seconds)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as sock:
        try:
            sock.sendall(head + body)
            sock.shutdown(socket.SHUT_WR)  # nothing more comes: no read waits on us
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before all of it was taken, and closed: the answer may be there
        resp = http.client.HTTPResponse(sock)  # type: ignore[arg-type]
        try:
            resp.begin()
            resp.read()
            status: int | None = resp.status
        except (http.client.RemoteDisconnected, ConnectionResetError):
            status = None
        except http.client.BadStatusLine as e:
            raise AssertionError(f"not an HTTP answer: {e!r}") from None
    return status, time.monotonic() - t0


def test_fuzzed_heads_never_fail_or_hang_and_change_nothing(make_sync_server) -> None:
    server = make_sync_server(quorum=2, grace=False, upload_port=0, body_timeout_s=1.0)
    boss = SyncClient(server.url, server.token)
    for learner in ("l0", "l1"):
        boss.join(JoinRequest(learner_id=learner))
    boss.init(codec.encode(TENSORS, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
    boss.close()
    port = server.sync.upload_port

    def served() -> list[tuple[int, bytes]]:
        return [
            (v, bytes(b))
            for v, b in (server.sync.fragment(p) for p in range(len(LAYOUT.fragments)))
        ]

    before = served()
    statuses: list[int | None] = []

    @settings(max_examples=400, deadline=None, database=None)
    @given(inputs())
    def one(case: tuple[bytes, bytes]) -> None:
        head, body = case
        status, took = exchange(port, head, body)
        statuses.append(status)
        # no 5xx: the one deliberate 5xx is 505, for a request line of another version
        other_version = not head.split(b"\n", 1)[0].rstrip(b"\r").endswith(b" HTTP/1.1")
        assert status is None or status < 500 or (status == 505 and other_version), (
            status,
            head[:300],
        )
        assert took < BOUND_S, (took, head[:300])
        assert served() == before, head[:300]

    one()
    assert any(s == 400 for s in statuses)  # the mutations did reach the parser's refusals
    assert any(s == 200 for s in statuses)  # and valid learner requests got through
    uploads = server.server.config.app.state.uploads
    assert uploads.answers[("http", "500")] == 0
