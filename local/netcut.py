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

The same relay is the latency half of a wide-area link (local/wanlink.py), where the kernel
cannot delay packets (no netem):

    proxy = CutProxy(None, listen_host="0.0.0.0", netns="wan-a", delay_s=0.02)

listens inside network namespace `wan-a`, takes each connection's real destination from the
kernel (an iptables REDIRECT sent it here: SO_ORIGINAL_DST), and holds every chunk `delay_s`
before passing it on, in both directions (a round trip gains 2 x delay_s). The queue of
held bytes per direction is bounded, so a fast sender is slowed to the link's pace instead of
filling memory.

It is also the delaying relay of k8senv's region link (tests/integration/wanlink.py):

    proxy = CutProxy(node_port, home_node_ip, listen_host=link_host_ip, listen_port=8470,
                     delay_s=0.02)

listens on a fixed port of the link's host end and relays to a NodePort of the home node.
Bytes are counted per direction (`bytes_to_target`, `bytes_to_client`) and connections relayed
(`connections`), so a test can see that traffic crossed the link both ways.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

_LINGER_RESET = struct.pack("ii", 1, 0)  # close() sends RST instead of FIN
_SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h: where a REDIRECTed connection was going
_CLONE_NEWNET = 0x40000000
_HELD_CAP = 16 << 20
"""Bytes a delaying relay holds per direction before it stops reading (backpressure)."""


@contextlib.contextmanager
def in_netns(name: str | None) -> Iterator[None]:
    """Run the body in network namespace `name` (an `ip netns` name; None: stay): sockets
    created inside belong to it for their whole life. Only the calling thread moves
    (setns(2) is per thread), and it moves back on exit. Needs CAP_SYS_ADMIN."""
    if name is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        there = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
        try:
            if libc.setns(there, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
        finally:
            os.close(there)
        try:
            yield
        finally:
            if libc.setns(here, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns back from {name}: {os.strerror(err)}")
    finally:
        os.close(here)


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a connection REDIRECTed to this relay was addressed (IPv4)."""
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack("!2xH4s8x", raw)
    return socket.inet_ntoa(addr), int(port)


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
    is cut. Counts cuts and connections reset, for the report, and bytes relayed.

    `target_port` None: transparent, each connection goes where it was addressed (the
    kernel's SO_ORIGINAL_DST). `netns`: listen and connect inside that network namespace.
    `delay_s`: one-way delay added to every byte, both directions. `listen_port` 0: any free
    port (`port` says which)."""

    def __init__(
        self,
        target_port: int | None,
        target_host: str = "127.0.0.1",
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        netns: str | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.target = None if target_port is None else (target_host, target_port)
        self.netns = netns
        self.delay_s = delay_s
        with in_netns(netns):
            self.listener = socket.create_server((listen_host, listen_port))
        self.port = int(self.listener.getsockname()[1])
        self.address = f"{listen_host}:{self.port}"
        """Where the relay listens, "host:port"."""
        self.url = f"http://127.0.0.1:{self.port}"
        self.bytes_to_target = 0
        """Bytes passed on from clients to their upstream, closed connections included."""
        self.bytes_to_client = 0
        """Bytes passed on from upstreams back to their clients."""
        self.connections = 0
        """Connections relayed (accepted and connected upstream), closed ones included."""
        self.lock = threading.Lock()
        self.pairs: dict[tuple[socket.socket, socket.socket], int] = {}
        """Open pairs -> pumps still running (2, then 1; the last one closes both)."""
        self.is_cut = False
        self.closed = False
        self.cuts = 0
        self.resets = 0

    @property
    def bytes_relayed(self) -> int:
        """Bytes passed on, both directions together."""
        return self.bytes_to_target + self.bytes_to_client

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
                target = self.target or original_destination(client)
                with in_netns(self.netns):
                    upstream = socket.create_connection(target, timeout=5.0)
                upstream.settimeout(None)
            except OSError:
                _reset(client)  # the synchronizer is down: pass the failure on
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = (client, upstream)
            with self.lock:
                self.pairs[pair] = 2
                self.connections += 1
            for src, dst in (pair, pair[::-1]):
                threading.Thread(target=self._pump, args=(src, dst, pair), daemon=True).start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, pair: tuple[socket.socket, socket.socket]
    ) -> None:
        to_target = src is pair[0]
        if self.delay_s > 0:
            self._delayed(src, dst, to_target)
        else:
            try:
                while data := src.recv(1 << 16):
                    dst.sendall(data)
                    self._count(to_target, len(data))
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

    def _count(self, to_target: bool, n: int) -> None:
        with self.lock:
            if to_target:
                self.bytes_to_target += n
            else:
                self.bytes_to_client += n

    def _delayed(self, src: socket.socket, dst: socket.socket, to_target: bool) -> None:
        """Relay src -> dst with every chunk held `delay_s` after it arrived: this thread
        reads, a second one writes when each chunk is due. EOF is passed on when due too."""
        held: collections.deque[tuple[float, bytes]] = collections.deque()
        cond = threading.Condition()
        state = {"bytes": 0, "broken": False}

        def write() -> None:
            while True:
                with cond:
                    while not held and not state["broken"]:
                        cond.wait()
                    if state["broken"]:
                        return
                    due, data = held[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    if not data:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(data)
                    self._count(to_target, len(data))
                except OSError:
                    with cond:
                        state["broken"] = True
                        cond.notify_all()
                    return
                with cond:
                    held.popleft()
                    state["bytes"] -= len(data)
                    cond.notify_all()

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        try:
            while data := src.recv(1 << 16):
                with cond:
                    while state["bytes"] > _HELD_CAP and not state["broken"]:
                        cond.wait()
                    if state["broken"]:
                        break
                    held.append((time.monotonic() + self.delay_s, data))
                    state["bytes"] += len(data)
                    cond.notify_all()
        except OSError:
            pass
        with cond:
            held.append((time.monotonic() + self.delay_s, b""))
            cond.notify_all()
        writer.join()


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
