"""The learner's HTTP/1.1 client of the upload port: an update's parts sent straight from their
own memory, a fragment's body read straight into its own buffer; no user-space copy either way.

    sender = PartsSender("http://127.0.0.1:8471", timeout=60.0, tls=ClientTLS())
    status, headers, payload = sender.post(path, parts, content_type, token)
    status, headers, body = sender.get(path, token)     # body: a bytearray the tensors view

Why not libcurl for this one request (bench/RESULTS.md, "Figures behind the code"): pycurl hands a
body of several buffers (`codec.pieces`: the safetensors header, then each tensor's own memory) to
libcurl through a Python read callback that returns bytes, so every chunk is copied twice in user
space (the slice into bytes, then into libcurl's upload buffer) before the kernel's copy into the
socket; at the synchronizer's ingest rate that took a large share of the cores it shares with
the synchronizer. Here the head and the parts go to `socket.sendmsg`, the kernel reading each part where it
lies (over TLS the ssl module encrypts each piece from its own memory). A download is the same in
reverse: libcurl hands a body to Python in 16 KiB bytes chunks to be joined (and safetensors'
loader copies it twice more); here the body goes by `recv_into` into one buffer of its declared
length, which the fragment's tensors then view (sync_client.py). Everything else a learner does stays
on libcurl.

The contract is libcurl's, as `SyncClient` relies on it: one kept-alive connection, made
again (and the request sent once more) when the kept-alive one is found closed before any
of the answer arrived; a server that answers before it has read the body (401, 413, 421) is
heard, not taken for a broken pipe: the body goes in `SLICE`-byte pieces with a look for an
early answer between them; a connection never made is `unreached`; a request that takes
longer than `timeout` is abandoned. TLS verifies the server against `ClientTLS.ca_file`
(else the system's trust store), hostname included, and presents the client certificate
when one is configured.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Final
from urllib.parse import urlsplit

from ddiloco.wire.tls import ClientTLS

__all__ = ["MAX_DOWNLOAD", "MAX_HEAD", "SLICE", "Failed", "PartsSender"]

SLICE: Final = 4 << 20
"""Body bytes handed to the kernel per call: between calls, an early answer is looked for."""
MAX_HEAD: Final = 64 << 10
"""The largest response head read (the synchronizer's are a few hundred bytes)."""
MAX_BODY: Final = 16 << 20
"""The largest response body read for a POST (a JSON answer)."""
MAX_DOWNLOAD: Final = 1 << 40
"""The largest response body read for a GET (a fragment: its Content-Length is allocated)."""
CONNECT_TIMEOUT_S: Final = 3.0


class Failed(ConnectionError):
    """The request did not get an answer. `unreached`: no connection was made at all;
    `reset`: the server reset or closed the connection before any of an answer (a port at
    its connection cap turns a TLS connection away so); `fresh`: it failed on a new
    connection (a reused one that fails before any answer is tried again on a new one)."""

    def __init__(
        self, message: str, *, unreached: bool = False, reset: bool = False, fresh: bool = True
    ) -> None:
        super().__init__(message)
        self.unreached, self.reset, self.fresh = unreached, reset, fresh


RESETS: Final = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, ssl.SSLEOFError)
"""The errors of a connection the server reset or closed (not a timeout, not a certificate)."""


class PartsSender:
    """One kept-alive HTTP/1.1 connection to `base_url` (http or https) for bodies of parts.
    Not thread-safe: one per `SyncClient`, as its curl handle."""

    def __init__(self, base_url: str, *, timeout: float, tls: ClientTLS | None = None) -> None:
        url = urlsplit(base_url)
        self.https = url.scheme.lower() == "https"
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if self.https else 80)
        self.prefix = url.path.rstrip("/")
        self.authority = url.netloc.rpartition("@")[2]
        self.timeout = timeout
        self.tls = tls or ClientTLS()
        self._context: ssl.SSLContext | None = None
        self.sock: socket.socket | None = None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def post(
        self,
        path: str,
        parts: Sequence[bytes | bytearray | memoryview],
        content_type: str,
        token: str,
    ) -> tuple[int, dict[str, str], bytes]:
        """POST the parts, in order, as one body; (status, headers lower-cased, body).
        Raises `Failed` when no answer came."""
        if any(c in f"{path}{token}{content_type}" for c in "\r\n"):
            raise ValueError("a line break in a request's path, token or content type")
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(v.nbytes for v in views)
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.authority}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {size}\r\nUser-Agent: ddiloco\r\n\r\n"
        ).encode("latin-1")
        deadline = time.monotonic() + self.timeout
        try:
            status, headers, body = self._exchange(head, views, deadline, MAX_BODY)
        except Failed as e:
            if e.fresh:
                raise
            status, headers, body = self._exchange(head, views, deadline, MAX_BODY)  # it had gone
        return status, headers, bytes(body)

    def get(self, path: str, token: str) -> tuple[int, dict[str, str], bytearray]:
        """GET `path`; (status, headers lower-cased, body), the body read by `recv_into` into
        a buffer of its declared length (the caller's to keep). Raises `Failed` when no answer
        came."""
        if any(c in f"{path}{token}" for c in "\r\n"):
            raise ValueError("a line break in a request's path or token")
        head = (
            f"GET {self.prefix}{path} HTTP/1.1\r\nHost: {self.authority}\r\n"
            f"Authorization: Bearer {token}\r\nUser-Agent: ddiloco\r\n\r\n"
        ).encode("latin-1")
        deadline = time.monotonic() + self.timeout
        try:
            return self._exchange(head, [], deadline, MAX_DOWNLOAD)
        except Failed as e:
            if e.fresh:
                raise
            return self._exchange(head, [], deadline, MAX_DOWNLOAD)  # the kept-alive one had gone

    def _connection(self, deadline: float) -> tuple[socket.socket, bool]:
        """The kept-alive connection, or a new one; (socket, fresh)."""
        if self.sock is not None:
            return self.sock, False
        try:
            raw = socket.create_connection(
                (self.host, self.port), timeout=min(CONNECT_TIMEOUT_S, self._left(deadline))
            )
        except OSError as e:
            raise Failed(f"connect to {self.host}:{self.port}: {e}", unreached=True) from None
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw.settimeout(self._left(deadline))
            sock: socket.socket = raw
            if self.https:
                sock = self._ssl().wrap_socket(raw, server_hostname=self.host)
        except (OSError, ssl.SSLError) as e:
            raw.close()
            reset = isinstance(e, RESETS)
            raise Failed(f"TLS with {self.host}:{self.port}: {e}", reset=reset) from None
        self.sock = sock
        return sock, True

    def _ssl(self) -> ssl.SSLContext:
        if self._context is None:
            ctx = ssl.create_default_context(cafile=self.tls.ca_file)  # verifies, hostname too
            if self.tls.cert_file is not None and self.tls.key_file is not None:
                ctx.load_cert_chain(self.tls.cert_file, self.tls.key_file)
            ctx.set_alpn_protocols(["http/1.1"])
            self._context = ctx
        return self._context

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Failed(f"no answer from {self.host}:{self.port} in {self.timeout:g} s")
        return left

    def _exchange(
        self, head: bytes, views: list[memoryview], deadline: float, max_body: int
    ) -> tuple[int, dict[str, str], bytearray]:
        sock, fresh = self._connection(deadline)
        try:
            # a reset while sending: the server answered and closed with the body unread (the
            # answer is in our receive queue, ahead of the reset), or it had closed the
            # kept-alive connection (nothing to read: sent again on a new one)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._send(sock, head, views, deadline)
            return self._answer(sock, deadline, max_body)
        except Failed as e:  # fresh: a byte of the answer came, or the connection was new
            self.close()
            e.fresh = e.fresh or fresh
            raise
        except (OSError, ssl.SSLError) as e:
            self.close()
            reset = isinstance(e, RESETS)
            raise Failed(f"{self.host}:{self.port}: {e}", reset=reset, fresh=fresh) from None

    def _send(
        self, sock: socket.socket, head: bytes, views: list[memoryview], deadline: float
    ) -> bool:
        """Send the head and the body; True when the server answered before it took all of
        the body (the rest is not sent: it will close the connection after its answer)."""
        queue = [memoryview(head), *(v for v in views if v.nbytes)]
        while queue:
            batch, room = [], SLICE
            while queue and room > 0:  # up to SLICE bytes of the next parts, as views
                v = queue[0]
                take = v[:room]
                batch.append(take)
                room -= take.nbytes
                if take.nbytes == v.nbytes:
                    queue.pop(0)
                else:
                    queue[0] = v[take.nbytes :]
            sock.settimeout(self._left(deadline))
            if self.https:
                for piece in batch:
                    sock.sendall(piece)
            else:
                self._sendmsg_all(sock, batch, deadline)
            if queue and self._readable(sock):
                return  # an early answer (a refusal) or the end: read it, send no more

    def _sendmsg_all(self, sock: socket.socket, batch: list[memoryview], deadline: float) -> None:
        while batch:
            sent = sock.sendmsg(batch)
            while batch and sent >= batch[0].nbytes:
                sent -= batch[0].nbytes
                batch.pop(0)
            if batch and sent:
                batch[0] = batch[0][sent:]
            if batch:
                sock.settimeout(self._left(deadline))

    @staticmethod
    def _readable(sock: socket.socket) -> bool:
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return True
        return bool(select.select([sock], [], [], 0)[0])

    def _answer(
        self, sock: socket.socket, deadline: float, max_body: int
    ) -> tuple[int, dict[str, str], bytearray]:
        buf = bytearray()
        while (end := buf.find(b"\r\n\r\n")) < 0:
            if len(buf) > MAX_HEAD:
                raise Failed(f"{self.host}:{self.port}: a response head over {MAX_HEAD} bytes")
            buf += self._recv(sock, deadline, bool(buf))
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest.partition(" ")[0]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise Failed(f"{self.host}:{self.port}: not an HTTP/1.1 answer: {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        body = buf[end + 4 :]
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit() or int(length) > max_body:
                raise Failed(f"{self.host}:{self.port}: a Content-Length of {length[:20]!r}")
            body = self._fill(sock, deadline, body, int(length))
        else:  # the body ends with the connection
            while chunk := self._recv(sock, deadline, True, eof_ok=True):
                if len(body) > MAX_BODY:
                    raise Failed(f"{self.host}:{self.port}: a response body over {MAX_BODY}")
                body += chunk
        if length is None or headers.get("connection", "").lower() == "close":
            self.close()
        return int(code), headers, body

    def _fill(self, sock: socket.socket, deadline: float, got: bytearray, size: int) -> bytearray:
        """A body of `size` bytes in one buffer of its own: what came with the head, then
        `recv_into` the rest of it (the GIL released while the kernel copies)."""
        if len(got) >= size:
            del got[size:]
            return got
        body = bytearray(size)
        view = memoryview(body)
        at = len(got)
        view[:at] = got
        while at < size:
            sock.settimeout(self._left(deadline))
            n = sock.recv_into(view[at:], size - at)
            if not n:
                raise Failed(f"{self.host}:{self.port} closed the connection mid-answer")
            at += n
        return body

    def _recv(
        self, sock: socket.socket, deadline: float, began: bool, eof_ok: bool = False
    ) -> bytes:
        sock.settimeout(self._left(deadline))
        chunk = sock.recv(1 << 16)
        if not chunk and not eof_ok:
            what = "mid-answer" if began else "before answering"
            raise Failed(
                f"{self.host}:{self.port} closed the connection {what}",
                reset=not began,
                fresh=began,
            )
        return chunk
