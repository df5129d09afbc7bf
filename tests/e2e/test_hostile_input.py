"""Hostile input against a real `ddiloco synchronizer` process: every probe case is refused
with its reason (never a 500, never a hang), and nothing refused changes a served fragment.

    pytest tests/e2e/test_hostile_input.py -m e2e

One synchronizer serves the whole module (a learner joined, the model initialized), with a
1 s body timeout and a 1 MiB init limit so the size and stall cases stay quick. After each
refused input the fragments served (GET /v1/fragments/{p}: version and bytes) are compared
with what they were before it.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ddiloco.learner.sync_client import SyncClient
from ddiloco.local.processes import terminate_all
from ddiloco.wire import codec
from ddiloco.wire.protocol import (
    CONTENT_TYPE,
    LAYOUT_KEY,
    FragmentSpec,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
TOKEN = "hostile-token"
BODY_TIMEOUT_S = 1.0
MAX_INIT_BYTES = 1 << 20
PARAMS = {"emb": torch.arange(12.0).reshape(3, 4), "w": torch.ones(4, 4), "b": torch.zeros(4)}
LAYOUT = Layout(
    fragments=[
        FragmentSpec(index=0, embedding=True, tensors=[TensorSpec(name="emb", shape=[3, 4])]),
        FragmentSpec(
            index=1,
            tensors=[TensorSpec(name="b", shape=[4]), TensorSpec(name="w", shape=[4, 4])],
        ),
    ]
)
UPDATE = "/v1/fragments/1/updates"


class Sync:
    """The synchronizer under attack, and plain HTTP/1.1 requests to it."""

    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.client = SyncClient(f"http://127.0.0.1:{port}", TOKEN, timeout=10)

    def connect(self, timeout: float = 10.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def call(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        content_type: str = "application/json",
        token: str | None = TOKEN,
    ) -> tuple[int, dict[str, str], bytes]:
        headers = {"Content-Type": content_type}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        conn = self.connect()
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def fragments(self) -> list[tuple[str, bytes]]:
        """What is served: (version header, body) of every fragment."""
        out = []
        for p in range(len(LAYOUT.fragments)):
            status, headers, body = self.call("GET", f"/v1/fragments/{p}")
            assert status == 200, body
            out.append((headers["x-ddiloco-version"], body))
        return out

    def refusals(self) -> dict[str, int]:
        return dict(self.client.status().refusals)


@pytest.fixture(scope="module")
def sync(
    tmp_path_factory: pytest.TempPathFactory, synchronizer_process: Callable[..., Any]
) -> Iterator[Sync]:
    proc = synchronizer_process(
        tmp_path_factory.mktemp("hostile"),
        TOKEN,
        "--quorum",
        "1",
        "--no-grace",
        DDILOCO_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S),
        DDILOCO_MAX_INIT_BYTES=str(MAX_INIT_BYTES),
    )
    s = Sync(proc.port, proc.log)
    try:
        proc.start()
        s.client.join(JoinRequest(learner_id="l0", layout_digest=LAYOUT.digest()))
        s.client.init(codec.encode(PARAMS, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
        yield s
        assert "Traceback" not in s.log.read_text(), s.log.read_text()[-5000:]
    finally:
        terminate_all([proc.child])


@pytest.fixture(autouse=True)
def unchanged(request: pytest.FixtureRequest, sync: Sync) -> Iterator[None]:
    """The served fragments are byte-identical after each test to what they were before
    (but in the one test that sends a good update)."""
    before = sync.fragments()
    yield
    if "good_update" not in request.node.name:
        assert sync.fragments() == before
    assert sync.client.healthy()


def refused(status: int, body: bytes, want_status: int, kind: str) -> dict[str, Any]:
    """Assert a refusal's status and JSON body `{"error": kind, "detail": ...}`."""
    assert status == want_status, (status, body[:500])
    err = json.loads(body, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert err["error"] == kind, err
    assert isinstance(err["detail"], str) and err["detail"], err
    return err


def safetensors(header: bytes | str, data: bytes = b"") -> bytes:
    raw = header.encode() if isinstance(header, str) else header
    return len(raw).to_bytes(8, "little") + raw + data


def meta(step: int = 24) -> dict[str, str]:
    return UpdateMeta(
        learner_id="l0", fragment=1, base_version=0, steps=24, tokens=240, learner_step=step
    ).to_metadata()


DEEP = 100_000
NOT_OBJECTS = {
    "list": "[]",
    "null": "null",
    "number": "1",
    "string": '"x"',
    "deep_list": "[" * DEEP + "]" * DEEP,
    "deep_in_object": '{"x":' + "[" * DEEP + "]" * DEEP + "}",
    "deep_metadata": '{"__metadata__":{"x":' + "{" * DEEP + "}" * DEEP + "}}",
}


# ---- case 1: headers that are JSON but not an object, or nested 100,000 deep ----------
@pytest.mark.parametrize("route", ["update", "init"])
@pytest.mark.parametrize("name", list(NOT_OBJECTS))
def test_header_that_is_not_an_object_is_refused(sync: Sync, route, name) -> None:
    method, path = ("POST", UPDATE) if route == "update" else ("PUT", "/v1/init")
    status, _, body = sync.call(method, path, safetensors(NOT_OBJECTS[name]), CONTENT_TYPE)
    err = refused(status, body, 422, "invalid")
    assert "not safetensors" in err["detail"]


def test_init_layout_nested_deep_is_refused(sync: Sync) -> None:
    layout = "[" * DEEP + "]" * DEEP
    header = json.dumps({"__metadata__": {LAYOUT_KEY: layout}})
    status, _, body = sync.call("PUT", "/v1/init", safetensors(header), CONTENT_TYPE)
    refused(status, body, 422, "invalid")


# ---- case 2: dtypes safetensors allows and the wire does not; bad header entries --------
def header_with(w: Any, metadata: dict[str, Any] | None = None) -> str:
    return json.dumps(
        {
            "__metadata__": meta() if metadata is None else metadata,
            "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "w": w,
        }
    )


@pytest.mark.parametrize(
    ("dtype", "nbytes"),
    [("F8_E8M0", 16), ("F4", 8), ("F6_E2M3", 12), ("F6_E3M2", 12), ("I32", 64), ("F64", 128)],
)
@pytest.mark.parametrize("route", ["update", "init"])
def test_dtype_outside_the_wire_is_refused(sync: Sync, dtype, nbytes, route) -> None:
    w = {"dtype": dtype, "shape": [4, 4], "data_offsets": [16, 16 + nbytes]}
    if route == "update":
        method, path, metadata = "POST", UPDATE, meta()
    else:
        method, path, metadata = "PUT", "/v1/init", {LAYOUT_KEY: LAYOUT.model_dump_json()}
    payload = safetensors(header_with(w, metadata), b"\x01" * (16 + nbytes))
    status, _, body = sync.call(method, path, payload, CONTENT_TYPE)
    err = refused(status, body, 422, "invalid")
    assert "dtype" in err["detail"] and dtype in err["detail"]


def test_bad_header_entries_are_refused(sync: Sync) -> None:
    """A few of the header checks over HTTP (tests/unit/test_codec_fuzz.py has them all)."""
    cases = [
        ({"dtype": "F32", "shape": [-4, -4], "data_offsets": [16, 80]}, 80),
        ({"dtype": "F32", "shape": [True, 16], "data_offsets": [16, 80]}, 80),
        ({"dtype": "F32", "shape": [4, 4], "data_offsets": [16, 80]}, 40),  # past the end
        ({"dtype": "F32", "shape": [4, 4], "data_offsets": [8, 72]}, 72),  # overlap
        ({"dtype": "F32", "shape": [4, 4], "data_offsets": [16, 80], "x": 1}, 80),
    ]
    for w, data_len in cases:
        payload = safetensors(header_with(w), b"\x00" * data_len)
        refused(*sync.call("POST", UPDATE, payload, CONTENT_TYPE)[::2], 422, "invalid")
    for meta_value in ({"learner_id": "l0", "fragment": 1}, [], {"learner_id": "\ud800"}):
        header = json.dumps({"__metadata__": meta_value})
        refused(*sync.call("POST", UPDATE, safetensors(header), CONTENT_TYPE)[::2], 422, "invalid")


def test_valid_but_corrupted_update_is_refused(sync: Sync) -> None:
    good = codec.encode({"b": torch.zeros(4), "w": torch.zeros(4, 4)}, meta())
    for bad in (good[:-1], good + b"\x00", good[:8] + good[9:], b"\xff" * 8 + good[8:]):
        status, _, body = sync.call("POST", UPDATE, bad, CONTENT_TYPE)
        refused(status, body, 422, "invalid")


# ---- cases 3, 4, 5: JSON routes: non-finite numbers, non-UTF-8, unbounded step_seconds ---
def heartbeat(**fields: Any) -> dict[str, Any]:
    hb = {
        "learner_id": "l0",
        "step": 1,
        "steps": [0, 0],
        "tokens": [0, 0],
        "base_versions": [0, 0],
        "step_seconds": 0.5,
    }
    return {**hb, **fields}


def raw_json(doc: dict[str, Any], **literal: str) -> bytes:
    """`doc` as JSON with some values written as literal text (1e999, NaN, Infinity...)."""
    text = json.dumps({**doc, **{k: f"@{k}@" for k in literal}})
    for key, value in literal.items():
        text = text.replace(f'"@{key}@"', value)
    return text.encode()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/heartbeat", raw_json(heartbeat(step=0), step="1e999")),
        ("/v1/heartbeat", raw_json(heartbeat(step=0), step="-1e999")),
        ("/v1/heartbeat", raw_json(heartbeat(loss=0.0), loss="NaN")),
        ("/v1/heartbeat", raw_json(heartbeat(compute_seconds=0.0), compute_seconds="1e999")),
        ("/v1/heartbeat", raw_json(heartbeat(steps=[0]), steps="[NaN, 1e999]")),
        ("/v1/join", raw_json({"learner_id": "l9", "pid": 0}, pid="1e999")),
        ("/v1/join", raw_json({"learner_id": "l9", "pid": 0}, pid="NaN")),
    ],
)
def test_non_finite_json_number_is_refused(sync: Sync, path, body) -> None:
    status, _, answer = sync.call("POST", path, body)
    refused(status, answer, 422, "invalid")


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/octet-stream", "application/json", None]
)
@pytest.mark.parametrize("path", ["/v1/join", "/v1/heartbeat"])
def test_non_utf8_body_is_refused(sync: Sync, path, content_type) -> None:
    conn = sync.connect()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    conn.request("POST", path, body=b"\xff\xfe\x80{\xc3(", headers=headers)
    resp = conn.getresponse()
    refused(resp.status, resp.read(), 422, "invalid")
    conn.close()


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "1e9", "3600.5", "-1"])
def test_unbounded_step_seconds_is_refused(sync: Sync, value) -> None:
    status, _, body = sync.call("POST", "/v1/heartbeat", json.dumps(heartbeat()).encode())
    assert status == 200, body
    bad = raw_json(heartbeat(), step_seconds=value)
    status, _, body = sync.call("POST", "/v1/heartbeat", bad)
    refused(status, body, 422, "invalid")
    (l0,) = [rec for rec in sync.client.status().learners if rec.learner_id == "l0"]
    assert l0.step_seconds == 0.5  # the refused heartbeat changed nothing


# ---- case 6: bodies too large, declared or not, and bodies that stall --------------------
def raw_request(sync: Sync, head: str, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", sync.port), timeout=10)
    sock.sendall(head.encode() + b"\r\n" + first)
    return sock


def head(method: str, path: str, **headers: str) -> str:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {TOKEN}"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return "\r\n".join(lines) + "\r\n"


def answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()


@pytest.mark.parametrize(
    ("method", "path", "declared"),
    [
        ("POST", UPDATE, 1 << 31),
        ("POST", "/v1/fragments/0/updates", 4 << 20),  # fragment 0 needs ~1 MiB at most
        ("POST", "/v1/fragments/7/updates", 1 << 31),  # no such fragment
        ("PUT", "/v1/init", MAX_INIT_BYTES + 1),
        ("PUT", "/v1/init", 1 << 40),
        ("POST", "/v1/heartbeat", 1 << 31),
        ("POST", "/v1/join", 64 << 20),
    ],
)
def test_declared_huge_body_is_refused_at_once(sync: Sync, method, path, declared) -> None:
    before = sync.refusals().get("too_large", 0)
    t0 = time.monotonic()
    sock = raw_request(
        sync,
        head(method, path, Content_Type=CONTENT_TYPE, Content_Length=str(declared)),
        b"x" * 100,
    )
    with sock:
        status, headers, body = answer(sock)
    elapsed = time.monotonic() - t0
    refused(status, body, 413, "too_large")
    assert elapsed < 2.0, elapsed  # before reading: not after the body or a timeout
    assert headers.get("connection") == "close"
    assert sync.refusals().get("too_large", 0) == before + 1


@pytest.mark.parametrize("path", [UPDATE, "/v1/heartbeat"])
def test_undeclared_body_is_refused_once_it_passes_the_limit(sync: Sync, path) -> None:
    """A chunked body is read only up to the limit: the 413 comes while the client still
    sends, long before its 300 MiB are through."""
    sock = raw_request(
        sync, head("POST", path, Content_Type=CONTENT_TYPE, Transfer_Encoding="chunked")
    )
    chunk = b"%x\r\n%s\r\n" % (64 << 10, b"\x00" * (64 << 10))
    sent, t0 = 0, time.monotonic()
    with sock:
        sock.settimeout(10)
        while sent < 300 << 20:
            if select.select([sock], [], [], 0)[0]:
                break  # the answer is there
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 64 << 10
            assert time.monotonic() - t0 < 10, "no answer while sending"
        status, _headers, body = answer(sock)
    refused(status, body, 413, "too_large")
    assert sent < 32 << 20, sent  # stopped reading near the limit (~1 MiB, or 4 MiB of JSON)


@pytest.mark.parametrize(
    ("method", "path", "headers", "first"),
    [
        ("POST", UPDATE, {"Content_Length": "1000"}, b"\x10" * 10),
        ("PUT", "/v1/init", {"Content_Length": "1000"}, b""),
        ("POST", UPDATE, {"Transfer_Encoding": "chunked"}, b"a\r\n0123456789\r\n"),
        ("POST", "/v1/heartbeat", {"Content_Length": "200"}, b'{"learner_id": "l0", '),
        ("POST", "/v1/join", {"Transfer_Encoding": "chunked"}, b""),
    ],
)
def test_stalled_body_times_out(sync: Sync, method, path, headers, first) -> None:
    before = sync.refusals().get("timeout", 0)
    t0 = time.monotonic()
    sock = raw_request(sync, head(method, path, Content_Type=CONTENT_TYPE, **headers), first)
    with sock:
        status, got, body = answer(sock)
    elapsed = time.monotonic() - t0
    refused(status, body, 408, "timeout")
    assert BODY_TIMEOUT_S * 0.9 < elapsed < BODY_TIMEOUT_S + 3.0, elapsed
    assert got.get("connection") == "close"
    assert sync.refusals().get("timeout", 0) == before + 1


def test_h2_upload_over_the_limit_is_refused_before_it_is_sent(sync: Sync) -> None:
    """The learner's own transport (libcurl, h2c): a 300 MiB declared upload gets its 413
    after a few KiB, never buffered whole."""
    import pycurl

    c, out, read = pycurl.Curl(), bytearray(), [0]

    def source(n: int) -> bytes:
        read[0] += n
        return b"\x00" * n

    c.setopt(pycurl.URL, f"http://127.0.0.1:{sync.port}{UPDATE}")
    c.setopt(pycurl.HTTP_VERSION, pycurl.CURL_HTTP_VERSION_2_PRIOR_KNOWLEDGE)
    c.setopt(pycurl.HTTPHEADER, [f"Authorization: Bearer {TOKEN}", f"Content-Type: {CONTENT_TYPE}"])
    c.setopt(pycurl.POST, 1)
    c.setopt(pycurl.POSTFIELDSIZE_LARGE, 300 << 20)
    c.setopt(pycurl.READFUNCTION, source)
    c.setopt(pycurl.WRITEFUNCTION, out.extend)
    c.setopt(pycurl.TIMEOUT_MS, 10_000)
    t0 = time.monotonic()
    try:
        c.perform()
    except pycurl.error as e:  # libcurl may give up on the rest of the upload: fine
        assert c.getinfo(pycurl.RESPONSE_CODE) == 413, e
    status = c.getinfo(pycurl.RESPONSE_CODE)
    c.close()
    refused(status, bytes(out), 413, "too_large")
    assert time.monotonic() - t0 < 3.0
    assert read[0] < 4 << 20, read[0]  # the limit is ~1 MiB; libcurl sent ~200 KiB


# ---- authentication and unknown routes: JSON refusals too --------------------------------
@pytest.mark.parametrize("token", [None, "wrong", ""])
def test_bad_token_is_refused_with_401_and_challenge(sync: Sync, token) -> None:
    for method, path in (("GET", "/v1/status"), ("POST", UPDATE), ("GET", "/v1/fragments/0")):
        status, headers, body = sync.call(method, path, b"{}", token=token)
        refused(status, body, 401, "unauthorized")
        assert headers["www-authenticate"] == "Bearer"


def test_unknown_route_and_method_answer_json(sync: Sync) -> None:
    status, _, body = sync.call("GET", "/v1/nothing-here")
    refused(status, body, 404, "not_found")
    status, headers, body = sync.call("DELETE", "/v1/status")
    refused(status, body, 405, "method_not_allowed")
    assert "GET" in headers.get("allow", "")


def test_openapi_describes_the_binary_bodies(sync: Sync) -> None:
    status, _, body = sync.call("GET", "/openapi.json")
    assert status == 200
    paths = json.loads(body)["paths"]
    for path, method in (("/v1/init", "put"), ("/v1/fragments/{p}/updates", "post")):
        content = paths[path][method]["requestBody"]["content"]
        assert content[CONTENT_TYPE]["schema"]["format"] == "binary"
    assert sync.call("GET", "/docs")[0] == 200


def test_a_good_update_still_merges_after_all_that(sync: Sync) -> None:
    """Last: the synchronizer still works, and the update it accepts is the only change."""
    before = sync.fragments()
    delta = {"b": torch.full((4,), 0.1), "w": torch.full((4, 4), 0.1)}
    status, _, body = sync.call("POST", UPDATE, codec.encode(delta, meta(step=1000)), CONTENT_TYPE)
    assert status == 200 and json.loads(body)["status"] == "accepted", body
    deadline = time.time() + 10
    while sync.fragments()[1][0] == before[1][0]:
        assert time.time() < deadline, "the good update never merged"
        time.sleep(0.05)
    after = sync.fragments()
    assert after[0] == before[0]  # the other fragment is untouched
    assert after[1][0] == "1" and after[1][1] != before[1][1]
