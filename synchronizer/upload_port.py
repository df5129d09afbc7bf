"""The upload port (DDILOCO_UPLOAD_PORT, "the upload port"): fragment bytes both ways, without
Python touching them. Update bodies are read straight from the socket into their buffer;
served fragments are written to the socket straight from their encoded buffer.

    server = UploadServer(sync, tokens, settings)      # app.py's lifespan, DDILOCO_UPLOAD_PORT
    server.start()                                     # -> the bound port, told at join
    ...
    server.close()                                     # stops accepting, lets requests finish

Why a second listener (bench/RESULTS.md, "Figures behind the code"): uvicorn hands a large HTTP/1.1
body to the app in 64-256 KiB chunks through the event loop, which costs more CPU than the
synchronizer's own work on it; a thread per connection that calls `recv_into` on the body's own
buffer costs a tenth of that, with the GIL released while the kernel copies. Downloads are the
same in reverse, and M times over: every merge of a fragment is fetched by every learner, and
through the main port each copy went through uvicorn's HTTP/2 (pure-Python h2, a 64 KiB window)
in 16 KiB frames. Here the served payload (served_buffers.py: encoded once per merge) goes to
`socket.sendmsg` from its own memory (over TLS, `SSLSocket.send` of slices of it, encrypted
from where it lies), the GIL released while the kernel copies; the download holds a reference
to the buffer until it is sent, so a later merge never encodes into it meanwhile.

This port serves two routes over HTTP/1.1 (TLS and mutual TLS with the main port's certificate
and client CA), each with the main port's contract and `{"error", "detail"}` bodies:
- `POST /v1/fragments/{p}/updates`: the same credentials (auth.py: 401 without one, 403 for a
  spare's, and `Synchronizer.submit` checks that the update's learner is the credential's), the
  same refusals before a byte of the body is read (401, 403, 421, 413 on a declared
  Content-Length over the fragment's limit);
- `GET /v1/fragments/{p}` (`?held=<token>`: a delta from the learner's copy, wire/broadcast.py):
  the served fragment with its `X-DDiLoCo-Version` header, for any
  valid credential (401 without one), 421 from a shard that does not own p, 422 for a fragment
  that does not exist, 409 before the job is initialized (`Synchronizer.fragment`, as the main
  port answers). A GET with a body is 400.
Everything else (join, heartbeats, HTTP/2) stays on the main port; a request for another route
here gets 404 or 405 saying so.

Parsing. A request head is parsed by h11 (the parser of uvicorn's h11 mode, already in the
image), never by hand: a malformed request line, header field, Content-Length (signs, hex,
exponents, empty, over 20 digits, two that differ), a NUL or bare CR in a value, a missing or
repeated Host are 400. The port is stricter than h11 where h11 is lenient on purpose: line
endings other than CRLF and obsolete line folding are 400 (a bare-LF head is not taken for
a head that never ended, and a folded field is not read as another one), and so is a
Transfer-Encoding beside a Content-Length (two framings: the smuggling case); a chunked body
with no length is 411 (learners always declare theirs). A refused head closes the
connection, and so does any answer to a request that says `Connection: close`. The body is
never handed to the parser: it goes from the socket into its buffer.

Holding nothing for a slow or silent client. A connection's first head must be whole
`HEAD_TIMEOUT_S` after its accept (a TLS handshake step that waits as long ends it too), else
it is closed; a head without a valid credential is 401 and closed. At most `MAX_ANONYMOUS`
connections may be waiting for their first credential, and one accepted past that closes
the oldest of them, so sockets that send nothing, however many, cannot keep a learner out:
its connection sends its head at once and is then counted against its credential, at most
`MAX_PER_CREDENTIAL` for a learner's (one learner cannot take the port), with no cap of its
own for the job key's (the synchronizer's own clients, administrators), `MAX_CONNECTIONS`
in all. A connection past `MAX_CONNECTIONS` is answered 503 (over TLS: closed, before any
handshake), and so is a request past its credential's cap; the learner posts that update
to the main port instead (learner/streaming.py). A body must send something every
`body_timeout_s` and be whole in `body_timeout_s` + its size at `MIN_BODY_RATE`, else 408
and close. A download is held to the same bounds the other way: a client that stops reading
(its receive window full for `body_timeout_s`) or reads slower than `MIN_BODY_RATE` beyond
that is cut off, closing the connection, so its thread and its hold on the served buffer end.
A kept-alive connection idle for `IDLE_S` is closed.
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
import urllib.parse
from collections import Counter
from http import HTTPStatus
from typing import Any, Final

import h11

from ddiloco.synchronizer.buffers import BODIES
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.wire.auth import Principal, Tokens, authenticate
from ddiloco.wire.errors import Refusal, SyncError
from ddiloco.wire.protocol import API_PREFIX, CONTENT_TYPE, HELD_QUERY, VERSION_HEADER

log = logging.getLogger(__name__)

MAX_HEAD: Final = 64 << 10
"""The largest request line plus headers (431 above): a learner's is under 1 KiB."""
MAX_CONNECTIONS: Final = 256
"""Connections held at once, authenticated or not; one accepted over it is turned away."""
MAX_ANONYMOUS: Final = 64
"""Connections that have not yet sent a head with a valid credential; one accepted over it
closes the oldest of them (which has had the most time to send its head)."""
MAX_PER_CREDENTIAL: Final = 4
"""Connections one learner's credential may hold per shard: a learner posts over one and
downloads over another, so this leaves room for a restart's leftovers and no more."""
HEAD_TIMEOUT_S: Final = 2.0
"""A new connection's first head must be whole this long after its accept (a learner sends
its head with its body's first bytes, right after connecting); a kept-alive connection's
next head, this long after its first byte."""
MIN_BODY_RATE: Final = 1 << 20
"""Bytes per second a body must average (beyond `body_timeout_s` of grace): a 32 MB body gets
32 s more. Far below any link a learner could keep up over, and the learner's own client
gives up after 60 s; a body trickled to keep the per-read timeout alive ends with a 408."""
IDLE_S: Final = 15.0
"""A kept-alive connection with no new request for this long is closed."""
CLOSE_WAIT_S: Final = 5.0
"""How long `close` lets requests in flight finish."""
_ROUTE: Final = re.compile(rf"^{re.escape(API_PREFIX)}/fragments/(\d{{1,9}})/updates(\?.*)?$")
_FRAGMENT: Final = re.compile(rf"^{re.escape(API_PREFIX)}/fragments/(\d{{1,9}})(\?.*)?$")
SEND_SLICE: Final = 1 << 20
"""Bytes handed to one TLS write (each is encrypted from the served buffer where it lies);
between writes the download's deadline is checked."""
SEND_PARTS: Final = 64
"""Buffers handed to one `sendmsg` (far under IOV_MAX)."""
_HEAD_END: Final = re.compile(rb"\n\r?\n")
"""Where a head ends as h11 finds it (a blank line, with or without its CR)."""
_NOT_CRLF: Final = re.compile(rb"(?<!\r)\n|\r(?!\n)|\n[ \t]")
"""A bare LF, a bare CR, or a line folded onto the one before (obs-fold)."""
_QUOTED: Final = re.compile(r":? *(bytearray\(|b'|b\").*", re.DOTALL)
"""The request's own bytes that h11 quotes in an error (from there to the end)."""


def _held(target: str) -> str | None:
    """A download's `held` query parameter (wire/broadcast.py: the token of the learner's copy),
    the last one given as on the main port; None when absent."""
    _, _, query = target.partition("?")
    values = urllib.parse.parse_qs(query).get(HELD_QUERY, [])
    return values[-1] if values else None


class Refused(Exception):
    """A request answered with an error; `close`: the rest of the connection is unreadable."""

    def __init__(
        self, status: int, kind: str, detail: str, *, close: bool = False, **headers: str
    ) -> None:
        super().__init__(detail)
        self.status, self.kind, self.detail, self.close = status, kind, detail, close
        self.headers = headers


def bad_request(detail: str) -> Refused:
    return Refused(400, "bad_request", detail, close=True)


class Request:
    """The parsed head of one request: header names lower-cased, a repeated field's values
    joined with ", " (RFC 9110 5.3)."""

    def __init__(self, method: str, target: str, headers: dict[str, str]) -> None:
        self.method, self.target, self.headers = method, target, headers

    @property
    def close(self) -> bool:
        """The client asked for the connection to end after this request."""
        tokens = self.headers.get("connection", "").lower().split(",")
        return "close" in (t.strip() for t in tokens)


def parse_head(head: bytes) -> Request:
    """A request's head, from its request line through the blank line that ends it, parsed
    by h11 plus the checks h11 leaves out (the module docstring); `Refused` when malformed."""
    if _NOT_CRLF.search(head):
        raise bad_request("request head lines must end with CRLF, unfolded")
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    parser.receive_data(head)
    try:
        event = parser.next_event()
    except h11.RemoteProtocolError as e:  # its 501 (a coding other than chunked) is ours to 400
        reason = _QUOTED.sub("", str(e))  # never the line itself: it may hold a credential
        if e.error_status_hint == 431:
            raise Refused(431, "request_header_fields_too_large", reason, close=True) from None
        raise bad_request(f"malformed request: {reason}") from None
    if not isinstance(event, h11.Request):  # cannot happen with a whole head; still a 400
        raise bad_request("incomplete request head")
    if event.http_version != b"1.1":
        raise Refused(
            505, "http_version_not_supported", "the upload port speaks HTTP/1.1", close=True
        )
    headers: dict[str, str] = {}
    for name, value in event.headers:  # h11 has merged equal Content-Lengths into one
        key, text = name.decode("ascii"), value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    if "transfer-encoding" in headers and "content-length" in headers:
        raise bad_request("Transfer-Encoding beside Content-Length: two framings of one body")
    return Request(event.method.decode("ascii"), event.target.decode("ascii"), headers)


def response_head(
    status: int,
    length: int,
    *,
    close: bool,
    content_type: str = "application/json",
    **headers: str,
) -> bytes:
    """A response's status line and headers through the blank line (`_` in a name: `-`)."""
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Error"
    lines = [
        f"HTTP/1.1 {status} {reason}",
        f"content-type: {content_type}",
        f"content-length: {length}",
        *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items()),
    ]
    if close:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def response(status: int, body: bytes, *, close: bool, **headers: str) -> bytes:
    return response_head(status, len(body), close=close, **headers) + body


def error_body(kind: str, detail: str) -> bytes:
    return json.dumps({"error": str(kind), "detail": detail}).encode()


class Connection:
    """One accepted connection: its socket (`sock`, the TLS one over TLS; `raw` below it)
    and whose credential it holds (None: none yet)."""

    def __init__(self, raw: socket.socket) -> None:
        self.raw = raw
        self.sock: socket.socket = raw
        self.accepted = time.monotonic()
        self.principal: Principal | None = None


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
        self.conns: set[Connection] = set()
        """Every connection with a thread (`close` wakes the idle ones)."""
        self.anonymous: dict[Connection, None] = {}
        """Connections with no credential yet, oldest first."""
        self.held: Counter[Principal] = Counter()
        """Connections per credential."""
        self.authenticated = 0
        self.answers: Counter[tuple[str, str]] = Counter()
        """Answers by (scheme, status code): ddiloco_upload_port_requests_total."""
        sync.metrics.watch_uploads(self.answers)
        self.updates = 0
        """Updates answered 200."""
        self.downloads = 0
        """Fragments sent whole."""
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
            "Upload port %d (%s, POST %s/fragments/{p}/updates, GET %s/fragments/{p})",
            self.port,
            self.scheme,
            API_PREFIX,
            API_PREFIX,
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
        for c in conns:  # idle keep-alives: wake their threads, which then exit
            with contextlib.suppress(OSError):
                c.raw.shutdown(socket.SHUT_RDWR)
        if self.thread is not None:
            self.thread.join(timeout=CLOSE_WAIT_S)

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return  # closed
            c = Connection(raw)
            with self.cond:
                evict = len(self.anonymous) >= MAX_ANONYMOUS
                held = len(self.anonymous) - evict + self.authenticated
                full = self.closing or held >= MAX_CONNECTIONS
                if not full:
                    if evict:  # the oldest silent one makes room (its thread then ends)
                        oldest = next(iter(self.anonymous))
                        del self.anonymous[oldest]
                        with contextlib.suppress(OSError):
                            oldest.raw.shutdown(socket.SHUT_RDWR)
                    self.conns.add(c)
                    self.anonymous[c] = None
            if full:
                self._turn_away(raw)
                continue
            threading.Thread(target=self._serve, args=(c,), name="upload", daemon=True).start()

    def _turn_away(self, raw: socket.socket) -> None:
        """503 and close, without a thread: the answer fits a new socket's send buffer."""
        with self.counting:  # over TLS too, where the close is the answer
            self.answers[(self.scheme, "503")] += 1
        with contextlib.suppress(OSError), raw:
            if self.context is None:  # over TLS a cleartext answer would be noise: just close
                raw.setblocking(False)
                body = error_body("unavailable", f"{MAX_CONNECTIONS} upload connections held")
                raw.send(response(503, body, close=True, retry_after="1"))

    def _admit(self, c: Connection, principal: Principal) -> None:
        """Count `c` against `principal` (503 over its cap); from now on it is no longer
        anonymous. A connection already evicted as anonymous ends here."""
        with self.cond:
            if c.principal == principal:
                return
            if c.principal is None and c not in self.anonymous:
                raise ConnectionAbortedError("closed to make room before it authenticated")
            n = self.held[principal]
            if principal.kind != "job" and n >= MAX_PER_CREDENTIAL:
                raise Refused(
                    503,
                    "unavailable",
                    f"{principal} holds {n} upload connections already: post to the main port",
                    close=True,
                    retry_after="1",
                )
            self._release(c)
            c.principal = principal
            self.held[principal] += 1
            self.authenticated += 1

    def _release(self, c: Connection) -> None:
        """Uncount `c` (the caller holds `cond`)."""
        if c.principal is None:
            self.anonymous.pop(c, None)
            return
        self.held[c.principal] -= 1
        if not self.held[c.principal]:
            del self.held[c.principal]
        self.authenticated -= 1
        c.principal = None

    # ---- one connection --------------------------------------------------------
    def _serve(self, c: Connection) -> None:
        try:
            c.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c.raw.settimeout(HEAD_TIMEOUT_S)
            if self.context is not None:
                c.sock = self.context.wrap_socket(c.raw, server_side=True)  # mTLS checked here
            pending = b""
            deadline: float | None = c.accepted + HEAD_TIMEOUT_S
            while not self.closing:
                head, pending = self._read_head(c.sock, pending, deadline)
                deadline = None
                if head is None:
                    return
                with self.cond:
                    self.busy += 1
                try:
                    keep, pending = self._handle(c, head, pending)
                finally:
                    with self.cond:
                        self.busy -= 1
                        self.cond.notify_all()
                if not keep:
                    return
        except (OSError, ssl.SSLError) as e:  # a reset, a failed handshake, an eviction
            log.debug("Upload connection ended: %r", e)
        finally:
            with self.cond:
                self.conns.discard(c)
                self._release(c)
            with contextlib.suppress(OSError):
                c.sock.close()

    def _read_head(
        self, conn: socket.socket, pending: bytes, deadline: float | None
    ) -> tuple[bytes | None, bytes]:
        """The next request's head through its blank line, and what followed it. (None, b"")
        at a clean end, or when the head is not whole by `deadline` (None: `HEAD_TIMEOUT_S`
        after its first byte, which may take `IDLE_S` to come)."""
        buf = bytearray(pending)
        if deadline is None and buf:
            deadline = time.monotonic() + HEAD_TIMEOUT_S
        chunk = bytearray(16 << 10)
        searched = 0
        while True:
            end = _HEAD_END.search(buf, searched)
            if end is not None:
                if end.end() > MAX_HEAD:
                    break
                return bytes(buf[: end.end()]), bytes(buf[end.end() :])
            if len(buf) > MAX_HEAD:
                break
            searched = max(0, len(buf) - 2)
            left = IDLE_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return None, b""
            conn.settimeout(left)
            try:
                n = conn.recv_into(chunk)
            except TimeoutError:
                return None, b""  # silent, idle, or a head that stalled: close quietly
            if n == 0:
                return None, b""
            buf += chunk[:n]
            if deadline is None:
                deadline = time.monotonic() + HEAD_TIMEOUT_S
        detail = f"request head over {MAX_HEAD} bytes"
        self._send(conn, 431, error_body("request_header_fields_too_large", detail), close=True)
        return None, b""

    def _handle(self, c: Connection, head: bytes, rest: bytes) -> tuple[bool, bytes]:
        """Answer one request; (keep the connection, bytes already read past its body)."""
        with self.counting:  # += on a Counter is not atomic across threads
            self.protocols[(self.scheme, "1.1")] += 1  # as the main port's middleware counts
        closing, what = False, "request"
        try:
            req = parse_head(head)
            what = "download" if req.method == "GET" else "upload"
            closing = req.close
            principal, p = self._check(c, req)
            if req.method == "GET":
                self._download(c.sock, req, p, closing)
                return not closing, rest
            size = self._size(req, p)
            if req.headers.get("expect", "").lower() == "100-continue":
                c.sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            body, rest = self._read_body(c.sock, size, rest)
            try:
                answer = self.sync.submit(body, p, principal).model_dump_json().encode()
            finally:  # submit keeps nothing of the body (decoded into buffers of its own)
                BODIES.give(body)
        except Refused as e:
            if e.kind in {r.value for r in Refusal}:
                self.sync.reject(e.kind)
            log.warning("Refused %s: %s %s", what, e.kind, e.detail)
            close = e.close or closing
            self._send(c.sock, e.status, error_body(e.kind, e.detail), close=close, **e.headers)
            return not close, rest
        except SyncError as e:  # refused by the synchronizer itself: the body was read whole
            self.sync.reject(e.kind)
            log.warning("Refused %s: %s", what, e)
            self._send(c.sock, e.status, error_body(str(e.kind), str(e)), close=closing)
            return not closing, rest
        except (OSError, ssl.SSLError):
            raise
        except Exception as e:  # a bug: the learner retries, the log says what
            log.error("Failed %s: %r", what, e)
            body = error_body("internal", "see the synchronizer's log")
            self._send(c.sock, 500, body, close=True)
            return False, b""
        self._send(c.sock, 200, answer, close=closing)
        with self.counting:
            self.updates += 1
        return not closing, rest

    def _download(self, conn: socket.socket, req: Request, p: int, closing: bool) -> None:
        """Send the served fragment p from its encoded buffer (`Synchronizer.fragment`: 421,
        422, 409 as on the main port). A client that stops reading is cut off (the module
        docstring): the connection ends, as a send error."""
        if req.headers.get("content-length", "0") != "0" or "transfer-encoding" in req.headers:
            raise bad_request("a GET has no body")
        held = _held(req.target)
        version, payload = self.sync.fragment(p, held)  # the buffer is held until it is sent
        head = response_head(
            200,
            len(payload),
            close=closing,
            content_type=CONTENT_TYPE,
            **{VERSION_HEADER.lower().replace("-", "_"): str(version)},
        )
        with self.counting:
            self.answers[(self.scheme, "200")] += 1
        try:
            self._write(conn, [memoryview(head), payload])
        except TimeoutError as e:
            log.warning("Download of fragment %d cut off: %s", p, e)
            raise ConnectionAbortedError(str(e)) from None
        with self.counting:
            self.downloads += 1

    def _write(self, conn: socket.socket, parts: list[memoryview]) -> None:
        """Send `parts` in order from their own memory: `sendmsg` in cleartext (the kernel reads
        each part where it lies), `SEND_SLICE`-byte writes over TLS. TimeoutError when a write
        waits `body_timeout_s`, or when the whole is not sent in `body_timeout_s` + its size at
        `MIN_BODY_RATE`."""
        queue = [v.cast("B") if v.format != "B" else v for v in parts if v.nbytes]
        size = sum(v.nbytes for v in queue)
        per_write = self.settings.body_timeout_s
        start = time.monotonic()
        deadline = start + per_write + size / MIN_BODY_RATE
        tls = isinstance(conn, ssl.SSLSocket)
        sent_all = 0
        while queue:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"read slower than {MIN_BODY_RATE} bytes/s: {sent_all} of {size} bytes "
                    f"in {time.monotonic() - start:.1f} s"
                )
            conn.settimeout(min(per_write, left))
            try:
                # the GIL released while the kernel copies (or the ssl module encrypts)
                sent = conn.send(queue[0][:SEND_SLICE]) if tls else conn.sendmsg(queue[:SEND_PARTS])
            except TimeoutError:
                if left > per_write:
                    raise TimeoutError(
                        f"read nothing for {per_write:g} s ({sent_all} of {size} bytes sent)"
                    ) from None
                continue  # the deadline: raised at the top
            sent_all += sent
            while queue and sent >= queue[0].nbytes:
                sent -= queue.pop(0).nbytes
            if sent:
                queue[0] = queue[0][sent:]

    def _send(self, conn: socket.socket, status: int, body: bytes, **headers: Any) -> None:
        with self.counting:
            self.answers[(self.scheme, str(status))] += 1
        conn.sendall(response(status, body, **headers))

    @property
    def requests(self) -> int:
        """Updates answered 200 here (tests and the bench tell the port was used by it)."""
        return self.updates

    def _check(self, c: Connection, req: Request) -> tuple[Principal, int]:
        """Route, method and credential, before anything of the body (refusals close the
        connection: its unread body would be taken for the next request); the credential's
        principal, counted against its cap, and the fragment."""
        match, method = _ROUTE.match(req.target), "POST"
        if match is None:
            match, method = _FRAGMENT.match(req.target), "GET"
        if match is None:
            raise Refused(
                404,
                "not_found",
                f"the upload port serves only POST {API_PREFIX}/fragments/{{p}}/updates and "
                f"GET {API_PREFIX}/fragments/{{p}}; everything else is on the main port",
                close=True,
            )
        if req.method != method:
            raise Refused(
                405, "method_not_allowed", f"only {method} here", close=True, allow=method
            )
        principal = authenticate(req.headers.get("authorization", ""), self.tokens)
        if principal is None:
            raise Refused(
                401,
                Refusal.UNAUTHORIZED,
                "missing or wrong bearer token",
                close=True,
                www_authenticate="Bearer",
            )
        if not principal.trains() and method == "POST":  # a spare, an evaluator: readers
            raise Refused(
                403, Refusal.FORBIDDEN, f"{principal} has no learner slot to update for", close=True
            )
        self._admit(c, principal)
        return principal, int(match.group(1))

    def _size(self, req: Request, p: int) -> int:
        """The body's declared size, checked against the fragment's owner and limit."""
        try:
            self.sync.check_owner(p)
        except SyncError as e:
            raise Refused(e.status, e.kind, str(e), close=True) from None
        value = req.headers.get("content-length")
        if value is None:  # h11 took any length given as digits; chunked is all that is left
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
        return size

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
        of `rest` it took. 408 when a read waits `body_timeout_s`, or when the whole body
        is not in `body_timeout_s` + size / `MIN_BODY_RATE` (time spent waiting for a merge
        here, not for the client, is added to that)."""
        size = len(view)
        at = taken = min(len(rest), size)
        view[:at] = rest[:at]
        per_read = self.settings.body_timeout_s
        start = time.monotonic()
        deadline = start + per_read + size / MIN_BODY_RATE
        gate = self.sync.computing
        while at < size:
            if gate.active:  # a merge computing gets the cores first
                waited = time.monotonic()
                gate.wait()
                deadline += time.monotonic() - waited
            left = deadline - time.monotonic()
            if left <= 0:
                raise Refused(
                    408,
                    Refusal.TIMEOUT,
                    f"the request body arrived slower than {MIN_BODY_RATE} bytes/s: {at} of "
                    f"{size} bytes in {time.monotonic() - start:.1f} s",
                    close=True,
                )
            conn.settimeout(min(per_read, left))
            try:
                n = conn.recv_into(view[at:], size - at)  # the GIL is released in the copy
            except TimeoutError:
                if left > per_read:
                    raise Refused(
                        408,
                        Refusal.TIMEOUT,
                        f"the request body sent nothing for {per_read:g} s ({at} bytes arrived)",
                        close=True,
                    ) from None
                continue  # the deadline: refused at the top
            if n == 0:
                raise ConnectionResetError("client went away mid-body")
            at += n
        return taken
