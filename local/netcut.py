"""Network partition for one learner: a loopback TCP relay the launcher can cut and restore.

    proxy = CutProxy(target_port=8470)      # listens on 127.0.0.1:<proxy.port>
    proxy.start()                           # the learner talks to http://127.0.0.1:<proxy.port>
    proxy.cut()                             # open connections reset, new ones reset on accept
    proxy.restore()                         # connections accepted and relayed again
    proxy.close()

Chaos scenario 3 of bench/RESULTS.md ("cut a learner off the network"), made real without
root: the learner's process keeps running, its HTTP/2 connections die with a reset and every
reconnect is reset until the cut ends, which is what a dropped route looks like to libcurl.
One relay per learner; the learner is started with the relay's URL. Bytes are relayed by two
threads per connection (a learner holds two or three connections).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading

log = logging.getLogger(__name__)

_LINGER_RESET = struct.pack("ii", 1, 0)  # close() sends RST instead of FIN


def _reset(sock: socket.socket) -> None:
    """Abort a connection: the peer sees a reset. SHUT_RD first wakes a thread blocked in
    recv on it (Linux does not on close alone) without sending a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        sock.close()


class CutProxy:
    """State: the listening socket, the open (client, upstream) pairs, and whether the link
    is cut. Counts cuts and connections reset, for the report."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.pairs: dict[tuple[socket.socket, socket.socket], int] = {}
        """Open pairs -> pumps still running (2, then 1; the last one closes both)."""
        self.is_cut = False
        self.closed = False
        self.cuts = 0
        self.resets = 0

    def start(self) -> None:
        threading.Thread(target=self._accept_loop, name=f"netcut-{self.port}", daemon=True).start()

    def cut(self) -> None:
        with self.lock:
            self.is_cut = True
            self.cuts += 1
            pairs, self.pairs = list(self.pairs), {}
        for a, b in pairs:
            _reset(a)
            _reset(b)
            self.resets += 1

    def restore(self) -> None:
        with self.lock:
            self.is_cut = False

    def close(self) -> None:
        self.closed = True
        self.cut()
        with contextlib.suppress(OSError):
            self.listener.close()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.is_cut:
                _reset(client)
                self.resets += 1
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5.0)
                upstream.settimeout(None)
            except OSError:
                _reset(client)  # the synchronizer is down: pass the failure on
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = (client, upstream)
            with self.lock:
                self.pairs[pair] = 2
            for src, dst in (pair, pair[::-1]):
                threading.Thread(target=self._pump, args=(src, dst, pair), daemon=True).start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, pair: tuple[socket.socket, socket.socket]
    ) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with self.lock:
            left = self.pairs.get(pair, 0) - 1
            if left > 0:
                self.pairs[pair] = left
                return
            self.pairs.pop(pair, None)
        for s in pair:
            with contextlib.suppress(OSError):
                s.close()


class CutProxies:
    """One `CutProxy` per synchronizer shard, cut and restored together: a learner's link to
    a sharded synchronizer. `url` is the comma list of the relays, in shard order."""

    def __init__(self, target_ports: list[int], target_host: str = "127.0.0.1") -> None:
        self.proxies = [CutProxy(port, target_host) for port in target_ports]
        self.url = ",".join(p.url for p in self.proxies)

    @property
    def cuts(self) -> int:
        return self.proxies[0].cuts

    @property
    def resets(self) -> int:
        return sum(p.resets for p in self.proxies)

    def start(self) -> None:
        for p in self.proxies:
            p.start()

    def cut(self) -> None:
        for p in self.proxies:
            p.cut()

    def restore(self) -> None:
        for p in self.proxies:
            p.restore()

    def close(self) -> None:
        for p in self.proxies:
            p.close()
