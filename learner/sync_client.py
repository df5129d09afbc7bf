"""The learner's client for the synchronizer API, on libcurl (pycurl) over HTTP/2.

    client = SyncClient("http://127.0.0.1:8470", token)
    version, tensors = client.fragment(3)
    client = SyncClient("https://sync:8470", TokenFile(path), tls=ClientTLS(ca_file="ca.crt"))

libcurl speaks h2c by prior knowledge and moves large bodies from C; httpx's pure-Python
h2 stack measured ~5x slower on the same server (architecture.md). One `SyncClient` per
thread: a curl handle is not thread-safe, and each keeps its own HTTP/2 connection.

TLS: an https URL negotiates HTTP/2 (or HTTP/1.1 with `http2=False`) by ALPN. The server is
verified against `ClientTLS.ca_file` (the learner's DDILOCO_CA_FILE), else the system trust
store, hostname included; `cert_file` + `key_file` (DDILOCO_CLIENT_CERT_FILE,
DDILOCO_CLIENT_KEY_FILE) present a client certificate for mutual TLS. The token is a string
or a token source (auth.py): with a `TokenFile` each request sends its current first line, and
a 401 re-reads the file and retries once when the token changed (rotation).

Errors: `SyncUnavailable` when the synchronizer cannot be reached or answers 5xx (retry
later), `SyncRefused` for a 4xx, carrying the server's reason (do not retry as is).
"""

from __future__ import annotations

import io
import json
import os
import urllib.parse
from collections.abc import Sequence
from typing import Final, TypeVar

import pycurl
import torch
from pydantic import BaseModel

from ddiloco.learner.upload_sender import Failed, PartsSender
from ddiloco.wire import broadcast, codec
from ddiloco.wire.auth import StaticTokens, Tokens
from ddiloco.wire.broadcast import Download, Held
from ddiloco.wire.errors import PayloadError
from ddiloco.wire.protocol import (
    API_PREFIX,
    CONTENT_TYPE,
    HELD_QUERY,
    VERSION_HEADER,
    EvaluationReport,
    EvaluationStatus,
    Heartbeat,
    HeartbeatResponse,
    InitResponse,
    JoinRequest,
    JoinResponse,
    ModelSpec,
    Status,
    UpdateMeta,
    UpdateResponse,
)
from ddiloco.wire.tls import ClientTLS

__all__ = ["ClientTLS", "SyncClient", "SyncRefused", "SyncUnavailable"]

M = TypeVar("M", bound=BaseModel)

Body = bytes | Sequence[bytes | memoryview]
"""A request body: bytes, or its parts in order (`codec.pieces`: a header, then each
tensor's own memory), sent one after the other with no joined copy (`Parts`)."""


class Parts:
    """A body of several buffers, as libcurl's read and seek callbacks.

    A joined 32 MB payload is a fresh allocation whose every page faults on first touch: posting
    `[header, data]` instead costs the sender about a third of the CPU of `header + data` per post
    (bench/RESULTS.md, "Figures behind the code"). libcurl copies each chunk it asks for into its
    upload buffer; the chunk handed over is a copy too (pycurl takes bytes)."""

    def __init__(self, parts: Sequence[bytes | memoryview]) -> None:
        self.views = [memoryview(p).cast("B") for p in parts]
        self.size = sum(len(v) for v in self.views)
        self.index = 0
        self.offset = 0

    def read(self, size: int) -> bytes:
        while self.index < len(self.views) and self.offset >= len(self.views[self.index]):
            self.index += 1
            self.offset = 0
        if self.index == len(self.views):
            return b""
        view = self.views[self.index]
        chunk = view[self.offset : self.offset + size]
        self.offset += len(chunk)
        return bytes(chunk)

    def seek(self, offset: int, origin: int) -> int:
        """libcurl rewinds a body to re-send it (a kept-alive connection found dead)."""
        if origin != os.SEEK_SET or not 0 <= offset <= self.size:
            return pycurl.SEEKFUNC_CANTSEEK
        self.index, self.offset = 0, offset
        while self.index < len(self.views) and self.offset > len(self.views[self.index]):
            self.offset -= len(self.views[self.index])
            self.index += 1
        return pycurl.SEEKFUNC_OK


def body_size(body: Body | None) -> int:
    if body is None:
        return 0
    if isinstance(body, bytes | bytearray | memoryview):
        return len(body)
    return sum(memoryview(p).nbytes for p in body)


class SyncUnavailable(ConnectionError):
    """The synchronizer could not be reached, or failed (5xx). Worth retrying. `unreached`:
    no connection was made at all (refused, unresolvable, connect timeout); `reset`: the
    connection was reset or closed before any of an answer; `status`: the 5xx answered."""

    def __init__(
        self, message: str, *, unreached: bool = False, reset: bool = False, status: int = 0
    ) -> None:
        super().__init__(message)
        self.unreached, self.reset, self.status = unreached, reset, status

    @property
    def turned_away(self) -> bool:
        """Refused for now without being looked at (503, or a reset before any answer): what
        an upload port at its connection cap does. The main port may take the request."""
        return self.status == 503 or self.reset


UNREACHED: Final = frozenset({pycurl.E_COULDNT_RESOLVE_HOST, pycurl.E_COULDNT_CONNECT})
"""libcurl's codes for a connection never made (a connect timeout is E_OPERATION_TIMEDOUT,
which a stalled transfer shares: `_perform` tells them apart by the connect time)."""
RESET: Final = frozenset(
    {pycurl.E_GOT_NOTHING, pycurl.E_SEND_ERROR, pycurl.E_RECV_ERROR, pycurl.E_SSL_CONNECT_ERROR}
)
"""libcurl's codes for a connection reset or closed with no answer (a failed certificate
check is E_PEER_FAILED_VERIFICATION, not one of them)."""


class SyncRefused(RuntimeError):
    """The synchronizer refused the request (4xx); `kind` and the message say why."""

    def __init__(self, status: int, kind: str, detail: str) -> None:
        super().__init__(f"HTTP {status} {kind}: {detail}")
        self.status, self.kind, self.detail = status, kind, detail


HTTP_VERSIONS = {
    pycurl.CURL_HTTP_VERSION_1_0: "HTTP/1.0",
    pycurl.CURL_HTTP_VERSION_1_1: "HTTP/1.1",
    pycurl.CURL_HTTP_VERSION_2_0: "HTTP/2",
}


class SyncClient:
    """One HTTP/2 connection to the synchronizer; counts the bytes it moves. `http_version`
    is the protocol the last response came over ("HTTP/2", "HTTP/1.1")."""

    def __init__(
        self,
        base_url: str,
        token: str | Tokens,
        *,
        timeout: float = 60.0,
        http2: bool = True,
        tls: ClientTLS | None = None,
        sendmsg: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.tokens: Tokens = StaticTokens(token) if isinstance(token, str) else token
        self.timeout = timeout
        self.http2 = http2
        self.tls = tls or ClientTLS()
        self.https = self.base_url.lower().startswith("https://")
        self.curl = pycurl.Curl()
        self.sendmsg = sendmsg and not http2
        """The upload port's client (upload_port.py): a body of parts (a POST) goes from its own memory
        over HTTP/1.1, and a fragment (a GET) is read into a buffer of its own, which its
        tensors view (upload_sender.py), where it saves the learner CPU; not for uvicorn's main port,
        which took the same bodies slower that way than through libcurl (bench/RESULTS.md,
        "Figures behind the code")."""
        self.sender: PartsSender | None = None
        self.bytes_up = 0
        self.bytes_down = 0
        self.http_version = ""

    @property
    def token(self) -> str:
        return self.tokens.current()

    def close(self) -> None:
        self.curl.close()
        if self.sender is not None:
            self.sender.close()

    def request(
        self,
        method: str,
        path: str,
        body: Body | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, dict[str, str], bytes]:
        """One request; on a 401 with a token file that changed since, once more."""
        token = self.tokens.current()
        try:
            return self._perform(method, path, body, content_type, token)
        except SyncRefused as e:
            if e.status != 401 or not self.tokens.refresh() or self.tokens.current() == token:
                raise
            return self._perform(method, path, body, content_type, self.tokens.current())

    def _http_version(self) -> int:
        if not self.http2:
            return pycurl.CURL_HTTP_VERSION_1_1
        # h2c by prior knowledge in cleartext; over TLS, h2 by ALPN (1.1 if the server lacks it)
        return (
            pycurl.CURL_HTTP_VERSION_2TLS
            if self.https
            else pycurl.CURL_HTTP_VERSION_2_PRIOR_KNOWLEDGE
        )

    def _set_tls(self, c: pycurl.Curl) -> None:
        c.setopt(pycurl.SSL_VERIFYPEER, 1)
        c.setopt(pycurl.SSL_VERIFYHOST, 2)
        if self.tls.ca_file is not None:
            c.setopt(pycurl.CAINFO, os.fspath(self.tls.ca_file))
        if self.tls.cert_file is not None and self.tls.key_file is not None:
            c.setopt(pycurl.SSLCERT, os.fspath(self.tls.cert_file))
            c.setopt(pycurl.SSLCERTTYPE, "PEM")
            c.setopt(pycurl.SSLKEY, os.fspath(self.tls.key_file))
            c.setopt(pycurl.SSLKEYTYPE, "PEM")

    def _perform(
        self, method: str, path: str, body: Body | None, content_type: str, token: str
    ) -> tuple[int, dict[str, str], bytes]:
        if self.sendmsg and body is not None and not isinstance(body, bytes) and method == "POST":
            return self._send_parts(path, body, content_type, token)
        if self.sendmsg and body is None and method == "GET":
            return self._get_into(path, token)
        return self._curl(method, path, body, content_type, token)

    def _curl(
        self, method: str, path: str, body: Body | None, content_type: str, token: str
    ) -> tuple[int, dict[str, str], bytes]:
        """One request through libcurl (a body of parts through its read callback: `Parts`)."""
        c = self.curl
        c.reset()
        out = io.BytesIO()
        headers: dict[str, str] = {}

        def on_header(line: bytes) -> None:
            name, sep, value = line.decode("latin-1").partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()

        c.setopt(pycurl.URL, self.base_url + path)
        c.setopt(pycurl.HTTP_VERSION, self._http_version())
        if self.https:
            self._set_tls(c)
        c.setopt(
            pycurl.HTTPHEADER,
            [f"Authorization: Bearer {token}", f"Content-Type: {content_type}", "Expect:"],
        )
        c.setopt(pycurl.WRITEDATA, out)
        c.setopt(pycurl.HEADERFUNCTION, on_header)
        c.setopt(pycurl.CONNECTTIMEOUT_MS, 3000)
        c.setopt(pycurl.TIMEOUT_MS, int(self.timeout * 1000))
        c.setopt(pycurl.NOSIGNAL, 1)
        c.setopt(pycurl.CUSTOMREQUEST, method)
        if isinstance(body, bytes):
            c.setopt(pycurl.POSTFIELDSIZE_LARGE, len(body))
            c.setopt(pycurl.POSTFIELDS, body)
            c.setopt(pycurl.UPLOAD_BUFFERSIZE, 2 << 20)
        elif body is not None:
            parts = Parts(body)
            c.setopt(pycurl.POST, 1)
            c.setopt(pycurl.POSTFIELDSIZE_LARGE, parts.size)
            c.setopt(pycurl.READFUNCTION, parts.read)
            c.setopt(pycurl.SEEKFUNCTION, parts.seek)
            c.setopt(pycurl.UPLOAD_BUFFERSIZE, 2 << 20)
        elif method == "GET":
            c.setopt(pycurl.HTTPGET, 1)
        try:
            c.perform()
        except pycurl.error as e:
            unreached = e.args[0] in UNREACHED or (
                e.args[0] == pycurl.E_OPERATION_TIMEDOUT and c.getinfo(pycurl.CONNECT_TIME) == 0
            )
            reset = e.args[0] in RESET
            raise SyncUnavailable(
                f"{method} {path}: {e.args[-1]}", unreached=unreached, reset=reset
            ) from None
        status = int(c.getinfo(pycurl.RESPONSE_CODE))
        self.http_version = HTTP_VERSIONS.get(int(c.getinfo(pycurl.INFO_HTTP_VERSION)), "?")
        return self._answered(method, path, body, status, headers, out.getvalue())

    def _send_parts(
        self, path: str, body: Sequence[bytes | memoryview], content_type: str, token: str
    ) -> tuple[int, dict[str, str], bytes]:
        """A body of parts over HTTP/1.1 (a learner's update to the upload port), sent from
        the parts' own memory (upload_sender.py), with libcurl's contract."""
        if self.sender is None:
            self.sender = PartsSender(self.base_url, timeout=self.timeout, tls=self.tls)
        try:
            status, headers, payload = self.sender.post(path, body, content_type, token)
        except Failed as e:
            raise SyncUnavailable(
                f"POST {path}: {e}", unreached=e.unreached, reset=e.reset
            ) from None
        self.http_version = "HTTP/1.1"
        return self._answered("POST", path, body, status, headers, payload)

    def _get_into(self, path: str, token: str) -> tuple[int, dict[str, str], bytes]:
        """A GET over HTTP/1.1 whose body is read straight into a buffer of its own (upload_sender.py),
        with libcurl's contract. The body is a bytearray (typed as bytes: read-only to callers
        but `fragment`, whose tensors view it)."""
        if self.sender is None:
            self.sender = PartsSender(self.base_url, timeout=self.timeout, tls=self.tls)
        try:
            status, headers, payload = self.sender.get(path, token)
        except Failed as e:
            raise SyncUnavailable(
                f"GET {path}: {e}", unreached=e.unreached, reset=e.reset
            ) from None
        self.http_version = "HTTP/1.1"
        return self._answered("GET", path, None, status, headers, payload)  # type: ignore[arg-type]

    def _answered(
        self,
        method: str,
        path: str,
        body: Body | None,
        status: int,
        headers: dict[str, str],
        payload: bytes,
    ) -> tuple[int, dict[str, str], bytes]:
        """Count the bytes moved; a 5xx is `SyncUnavailable`, a 4xx `SyncRefused`."""
        self.bytes_up += body_size(body)
        self.bytes_down += len(payload)
        if status >= 500:
            raise SyncUnavailable(f"{method} {path}: HTTP {status}", status=status)
        if status >= 400:
            try:
                err = json.loads(payload)
                kind, detail = str(err.get("error", "http")), str(err.get("detail", payload[:200]))
            except (ValueError, AttributeError):
                kind, detail = "http", payload[:200].decode("utf-8", "replace")
            raise SyncRefused(status, kind, detail)
        return status, headers, payload

    def _json(self, method: str, path: str, msg: BaseModel | None, reply: type[M]) -> M:
        body = msg.model_dump_json().encode() if msg is not None else None
        _, _, payload = self.request(method, API_PREFIX + path, body)
        return reply.model_validate_json(payload)

    def join(self, req: JoinRequest) -> JoinResponse:
        return self._json("POST", "/join", req, JoinResponse)

    def init(self, payload: bytes) -> InitResponse:
        _, _, body = self.request("PUT", API_PREFIX + "/init", payload, CONTENT_TYPE)
        return InitResponse.model_validate_json(body)

    def fragment(self, p: int) -> tuple[int, dict[str, torch.Tensor]]:
        """Global fragment p and its version, whole, in whatever broadcast encoding the
        synchronizer serves (wire/broadcast.py): float tensors, or float32 ones dequantized."""
        version, got = self.download(p)
        return version, got.tensors

    def exact_fragment(self, p: int) -> tuple[int, dict[str, torch.Tensor]]:
        """Global fragment p's Theta in float32, bit for bit, and its version, whatever the
        broadcast encoding (`GET /v1/fragments/{p}/float32`: the job key only, for
        `ddiloco export`). `SyncUnavailable` with status 503 while the synchronizer is
        encoding another such read of p: ask again (Retry-After)."""
        _, headers, body = self.request("GET", f"{API_PREFIX}/fragments/{p}/float32")
        version = int(headers[VERSION_HEADER.lower()])
        header = codec.read_header(body)
        if any(t.dtype != "F32" for t in header.tensors.values()):
            raise PayloadError(f"fragment {p}'s float32 read holds other than float32 tensors")
        return version, codec.decode(body, header)

    def download(self, p: int, held: Held | None = None) -> tuple[int, Download]:
        """Global fragment p, its version and (delta encodings) its token; `held`: the
        learner's copy of p, for a delta from it (wire/broadcast.py). From the upload port
        (`sendmsg`) a float fragment's tensors are views of the one buffer the body was read
        into, theirs alone; through libcurl they are decoded from the joined body; a
        quantized one is dequantized into float32 tensors of its own. A delta for a copy the
        learner does not hold (`broadcast.StaleBase`) is fetched again whole."""
        path = f"{API_PREFIX}/fragments/{p}"
        if held is not None:
            path += "?" + urllib.parse.urlencode({HELD_QUERY: held.token})
        _, headers, body = self.request("GET", path)
        version = int(headers[VERSION_HEADER.lower()])
        try:
            return version, broadcast.read(body, held)
        except broadcast.StaleBase:
            if held is None:
                raise
            return self.download(p)

    def upload(self, meta: UpdateMeta, delta: dict[str, torch.Tensor]) -> UpdateResponse:
        return self.post_update(meta.fragment, codec.encode(delta, metadata=meta.to_metadata()))

    def post_update(self, fragment: int, payload: Body) -> UpdateResponse:
        """POST an encoded update (a re-send posts the very same bytes): one buffer, or its
        parts in order (`codec.pieces`), sent without joining them."""
        _, _, body = self.request(
            "POST", f"{API_PREFIX}/fragments/{fragment}/updates", payload, CONTENT_TYPE
        )
        return UpdateResponse.model_validate_json(body)

    def heartbeat(self, hb: Heartbeat) -> HeartbeatResponse:
        return self._json("POST", "/heartbeat", hb, HeartbeatResponse)

    def status(self) -> Status:
        return self._json("GET", "/status", None, Status)

    def model_spec(self) -> ModelSpec:
        """What the job trains (GET /v1/model)."""
        return self._json("GET", "/model", None, ModelSpec)

    def evaluation(self, report: EvaluationReport) -> EvaluationStatus:
        """Post an evaluation of the global model (POST /v1/evaluations: an evaluator's)."""
        return self._json("POST", "/evaluations", report, EvaluationStatus)

    def healthy(self) -> bool:
        try:
            return self.request("GET", "/healthz")[0] == 200
        except (SyncUnavailable, SyncRefused):
            return False
