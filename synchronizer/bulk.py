"""The upload port: update bodies read straight from the socket into their buffer.

    server = UploadServer(sync, tokens, settings)      # app.py's lifespan, DDILOCO_UPLOAD_PORT
    server.start()                                     # -> the bound port, told at join
    ...
    server.close()                                     # stops accepting, lets uploads finish

Why a second listener (issue 15, bench/RESULTS.md "the upload port"): with 16 clients posting
32 MB bodies over HTTP/1.1, uvicorn spends 2.2 CPU s per GB handing the body to the app in
64-256 KiB chunks through the event loop (zttp; h11 3.6), more than the synchronizer's own
work on it; a thread per connection that calls `recv_into` on the body's own buffer spends
0.26, with the GIL released while the kernel copies. This port serves one route,
`POST /v1/fragments/{p}/updates`, over HTTP/1.1 (TLS and mutual TLS with the main port's
certificate and client CA), with the main port's contract: the same bearer tokens, the same
refusals before a byte of the body is read (401, 421, 413 on a declared Content-Length over
the fragment's limit), 408 when the body stalls for `body_timeout_s`, the same
`{"error", "detail"}` bodies, and the same `Synchronizer.submit`. Everything else (join,
heartbeats, downloads, HTTP/2) stays on the main port; a request for another route here gets
404 or 405 saying so. A chunked body (no Content-Length) is refused with 411: learners always
declare theirs.

Connections are capped (`MAX_CONNECTIONS`; one over it is answered 503 and closed), the
request head is capped at `MAX_HEAD` bytes (431), and a connection idle between requests for
`IDLE_S` is closed, so a client that holds sockets open cannot pin more than the cap.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import ssl
import threading
import time
from collections import Counter
from http import HTTPStatus
from typing import Any, Final

from ddiloco.synchronizer.auth import Tokens, bearer_matches
from ddiloco.synchronizer.buffers import BODIES
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.errors import Refusal, SyncError
from ddiloco.synchronizer.protocol import API_PREFIX
from ddiloco.synchronizer.service import Synchronizer

log = logging.getLogger(__name__)

MAX_HEAD: Final = 64 << 10
"""The largest request line plus headers (431 above): a learner's is under 1 KiB."""
MAX_CONNECTIONS: Final = 256
IDLE_S: Final = 15.0
"""A kept-alive connection with no new request for this long is closed."""
CLOSE_WAIT_S: Final = 5.0
"""How long `close` lets requests in flight finish."""
_ROUTE: Final = re.compile(rf"^{re.escape(API_PREFIX)}/fragments/(\d{{1,9}})/updates(\?.*)?$")
_TOKEN: Final = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


class Refused(Exception):
    """A request answered with an error; `close`: the rest of the connection is unreadable."""

    def __init__(
        self, status: int, kind: str, detail: str, *, close: bool = False, **headers: str
    ) -> None:
        super().__init__(detail)
        self.status, self.kind, self.detail, self.close = status, kind, detail, close
        self.headers = headers


class Request:
    """The parsed head of one request."""

    def __init__(self, method: str, target: str, headers: dict[str, str], rest: bytes) -> None:
        self.method, self.target, self.headers, self.rest = method, target, headers, rest


def parse_head(head: bytes, rest: bytes) -> Request:
    """Request line and headers (RFC 9112), strictly: anything odd is a 400, never a guess."""
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise Refused(400, "bad_request", "request head is not ASCII", close=True) from None
    line, *fields = text.split("\r\n")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[0] or not parts[1].startswith("/"):
        raise Refused(400, "bad_request", "malformed request line", close=True)
    method, target, version = parts
    if version != "HTTP/1.1":
        raise Refused(
            505, "http_version_not_supported", "the upload port speaks HTTP/1.1", close=True
        )
    headers: dict[str, str] = {}
    for field in fields:
        name, sep, value = field.partition(":")
        if not sep or not _TOKEN.match(name.encode()):
            raise Refused(400, "bad_request", "malformed header field", close=True)
        key, value = name.lower(), value.strip(" \t")
        if key not in headers:
            headers[key] = value
        elif key == "content-length":
            if headers[key] != value:
                raise Refused(400, "bad_request", "conflicting Content-Length", close=True)
        else:  # a repeated field is its values joined (RFC 9110 5.3)
            headers[key] = f"{headers[key]}, {value}"
    return Request(method, target, headers, rest)


def response(status: int, body: bytes, *, close: bool, **headers: str) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Error"
    lines = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items()),
    ]
    if close:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def error_body(kind: str, detail: str) -> bytes:
    return json.dumps({"error": str(kind), "detail": detail}).encode()


class UploadServer:
    """The threaded HTTP/1.1 listener of `SyncSettings.upload_port` (the module docstring)."""

    def __init__(
        self,
        sync: Synchronizer,
        tokens: Tokens,
        settings: SyncSettings,
        *,
        context: ssl.SSLContext | None = None,
        protocols: Counter[tuple[str, str]] | None = None,
    ) -> None:
        self.sync, self.tokens, self.settings = sync, tokens, settings
        self.context = context
        self.scheme = "https" if context is not None else "http"
        self.protocols = protocols if protocols is not None else Counter()
        self.listener: socket.socket | None = None
        self.port = 0
        self.conns: set[socket.socket] = set()
        self.answers: Counter[tuple[str, str]] = Counter()
        """Answers by (scheme, status code): ddiloco_upload_port_requests_total."""
        sync.metrics.watch_uploads(self.answers)
        self.busy = 0
        """Requests between their head and their answer (`close` waits for them)."""
        self.cond = threading.Condition()
        self.counting = threading.Lock()
        self.closing = False
        self.thread: threading.Thread | None = None

    # ---- life --------------------------------------------------------------------
    def start(self) -> int:
        port = self.settings.upload_port or 0
        self.listener = socket.create_server(
            (self.settings.host, port), backlog=128, reuse_port=False
        )
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._accept, name="upload-accept", daemon=True)
        self.thread.start()
        log.info(
            "Upload port %d (%s, POST %s/fragments/{p}/updates)", self.port, self.scheme, API_PREFIX
        )
        return self.port

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.wait_for(lambda: self.busy == 0, timeout=CLOSE_WAIT_S)
            conns = list(self.conns)
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.shutdown(socket.SHUT_RDWR)
            self.listener.close()
        for conn in conns:  # idle keep-alives: wake their threads, which then exit
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self.thread is not None:
            self.thread.join(timeout=CLOSE_WAIT_S)

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            with self.cond:
                full = len(self.conns) >= MAX_CONNECTIONS or self.closing
                if not full:
                    self.conns.add(conn)
            if full:
                threading.Thread(target=self._turn_away, args=(conn,), daemon=True).start()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="upload", daemon=True).start()

    def _turn_away(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            conn.settimeout(2.0)
            if self.context is None:  # over TLS a cleartext answer would be noise: just close
                body = error_body("unavailable", f"more than {MAX_CONNECTIONS} upload connections")
                conn.sendall(response(503, body, close=True, retry_after="1"))

    # ---- one connection --------------------------------------------------------
    def _serve(self, raw: socket.socket) -> None:
        conn: socket.socket = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw.settimeout(self.settings.body_timeout_s)
            if self.context is not None:
                conn = self.context.wrap_socket(raw, server_side=True)  # mTLS checked here
            pending = b""
            while not self.closing:
                head, pending = self._read_head(conn, pending)
                if head is None:
                    return
                with self.cond:
                    self.busy += 1
                try:
                    keep, pending = self._handle(conn, head, pending)
                finally:
                    with self.cond:
                        self.busy -= 1
                        self.cond.notify_all()
                if not keep:
                    return
        except (OSError, ssl.SSLError) as e:  # a reset, a failed handshake, a stalled head
            log.debug("Upload connection ended: %r", e)
        finally:
            with self.cond:
                self.conns.discard(raw)
            with contextlib.suppress(OSError):
                conn.close()

    def _read_head(self, conn: socket.socket, pending: bytes) -> tuple[bytes | None, bytes]:
        """The next request's head, and what followed it; (None, b"") at a clean end, after
        `IDLE_S` without a first byte, or when the head is not whole `body_timeout_s` after
        its first byte (a head sent a byte at a time holds no thread for long)."""
        buf = bytearray(pending)
        limit = self.settings.body_timeout_s
        deadline = time.monotonic() + limit if buf else None
        chunk = bytearray(16 << 10)
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                if end > MAX_HEAD:
                    break
                return bytes(buf[:end]), bytes(buf[end + 4 :])
            if len(buf) > MAX_HEAD:
                break
            left = IDLE_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return None, b""
            conn.settimeout(left)
            try:
                n = conn.recv_into(chunk)
            except TimeoutError:
                return None, b""  # idle, or a head that stalled: close quietly
            if n == 0:
                return None, b""
            buf += chunk[:n]
            if deadline is None:
                deadline = time.monotonic() + limit
        detail = f"request head over {MAX_HEAD} bytes"
        self._send(conn, 431, error_body("request_header_fields_too_large", detail), close=True)
        return None, b""

    def _handle(self, conn: socket.socket, head: bytes, rest: bytes) -> tuple[bool, bytes]:
        """Answer one request; (keep the connection, bytes already read past its body)."""
        with self.counting:  # += on a Counter is not atomic across threads
            self.protocols[(self.scheme, "1.1")] += 1  # as the main port's middleware counts
        try:
            req = parse_head(head, rest)
            p, body, rest = self._body(conn, req)
            try:
                answer = self.sync.submit(body, p).model_dump_json().encode()
            finally:  # submit keeps nothing of the body (decoded into buffers of its own)
                BODIES.give(body)
        except Refused as e:
            if e.kind in {r.value for r in Refusal}:
                self.sync.reject(e.kind)
            log.warning("Refused upload: %s %s", e.kind, e.detail)
            self._send(conn, e.status, error_body(e.kind, e.detail), close=e.close, **e.headers)
            return not e.close, rest
        except SyncError as e:  # refused by the synchronizer itself: the body was read whole
            self.sync.reject(e.kind)
            log.warning("Refused upload: %s", e)
            self._send(conn, e.status, error_body(str(e.kind), str(e)), close=False)
            return True, rest
        except (OSError, ssl.SSLError):
            raise
        except Exception as e:  # a bug: the learner retries, the log says what
            log.error("Failed upload: %r", e)
            body = error_body("internal", "see the synchronizer's log")
            self._send(conn, 500, body, close=True)
            return False, b""
        close = req.headers.get("connection", "").lower() == "close"
        self._send(conn, 200, answer, close=close)
        return not close, rest

    def _send(self, conn: socket.socket, status: int, body: bytes, **headers: Any) -> None:
        with self.counting:
            self.answers[(self.scheme, str(status))] += 1
        conn.sendall(response(status, body, **headers))

    @property
    def requests(self) -> int:
        """Updates answered 200 here (tests and the bench tell the port was used by it)."""
        return self.answers[(self.scheme, "200")]

    def _body(self, conn: socket.socket, req: Request) -> tuple[int, memoryview, bytes]:
        """Check the request before its body (route, token, owner, size), then read the body
        into a buffer of its declared size; refusals before the body close the connection
        (its unread body would be taken for the next request)."""
        match = _ROUTE.match(req.target)
        if match is None:
            raise Refused(
                404,
                "not_found",
                f"the upload port serves only POST {API_PREFIX}/fragments/{{p}}/updates; "
                "everything else is on the main port",
                close=True,
            )
        if req.method != "POST":
            raise Refused(405, "method_not_allowed", "only POST here", close=True, allow="POST")
        if not bearer_matches(req.headers.get("authorization", ""), self.tokens):
            raise Refused(
                401,
                Refusal.UNAUTHORIZED,
                "missing or wrong bearer token",
                close=True,
                www_authenticate="Bearer",
            )
        p = int(match.group(1))
        try:
            self.sync.check_owner(p)
        except SyncError as e:
            raise Refused(e.status, e.kind, str(e), close=True) from None
        if "transfer-encoding" in req.headers:
            raise Refused(411, "length_required", "declare the body's Content-Length", close=True)
        value = req.headers.get("content-length", "")
        if not (value.isascii() and value.isdigit()):
            raise Refused(411, "length_required", "declare the body's Content-Length", close=True)
        size, limit = int(value), self.sync.body_limit(p)
        if size > limit:
            raise Refused(
                413,
                Refusal.TOO_LARGE,
                f"declared body of {size} bytes is larger than the {limit} bytes this route "
                "can need",
                close=True,
            )
        if req.headers.get("expect", "").lower() == "100-continue":
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        return p, *self._read_body(conn, size, req.rest)

    def _read_body(self, conn: socket.socket, size: int, rest: bytes) -> tuple[memoryview, bytes]:
        """The body, read into a buffer of `buffers.BODIES` (the caller gives it back)."""
        view = BODIES.take(size)
        try:
            at = self._fill(conn, view, rest)
        except BaseException:
            BODIES.give(view)
            raise
        return view, rest[at:]

    def _fill(self, conn: socket.socket, view: memoryview, rest: bytes) -> int:
        """Fill `view` from what was read past the head, then the socket; returns how much
        of `rest` it took."""
        size = len(view)
        at = taken = min(len(rest), size)
        view[:at] = rest[:at]
        conn.settimeout(self.settings.body_timeout_s)
        gate = self.sync.computing
        while at < size:
            gate.wait()  # a merge computing gets the cores first
            try:
                n = conn.recv_into(view[at:], size - at)  # the GIL is released in the copy
            except TimeoutError:
                raise Refused(
                    408,
                    Refusal.TIMEOUT,
                    f"the request body sent nothing for {self.settings.body_timeout_s:g} s "
                    f"({at} bytes arrived)",
                    close=True,
                ) from None
            if n == 0:
                raise ConnectionResetError("client went away mid-body")
            at += n
        return taken
