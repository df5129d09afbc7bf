"""The shaped link (local/wanlink.py): the set rate and round trip are what a TCP connection
between the two namespaces measures, a cut stops the bytes and a heal lets the same
connection carry on.

pytest tests/e2e/test_wanlink.py     # root, `ip netns`, tc, iptables; ~15 s
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from ddiloco.local.wanlink import WanLink, available, in_netns

why_not = available()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"no shaped link: {why_not}")


class Sink:
    """A server in the home namespace: echoes b"p", counts every other byte it receives."""

    def __init__(self, link: WanLink) -> None:
        with in_netns(link.home.ns):
            self.server = socket.create_server(("0.0.0.0", 0))
        self.port = int(self.server.getsockname()[1])
        self.received = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        try:
            while data := conn.recv(1 << 16):
                if data == b"p":
                    conn.sendall(b"p")
                else:
                    self.received += len(data)
        except OSError:
            pass


@pytest.fixture
def link() -> Iterator[WanLink]:
    with WanLink(rate="20mbit", rtt_ms=40) as wan:
        yield wan


def dial(link: WanLink, port: int) -> socket.socket:
    """A connection from the remote namespace to the home side's address."""
    with in_netns(link.remote.ns):
        conn = socket.create_connection((link.home.ip, port), timeout=20)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def blast(conn: socket.socket, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        chunk = b"x" * 65536
        try:
            while not stop.is_set():
                conn.sendall(chunk)
        except OSError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_rate_and_round_trip(link: WanLink) -> None:
    sink = Sink(link)
    conn = dial(link, sink.port)
    rtts = []
    for _ in range(5):
        t = time.perf_counter()
        conn.sendall(b"p")
        assert conn.recv(1) == b"p"
        rtts.append((time.perf_counter() - t) * 1000)
    assert min(rtts) >= 38.0 and sorted(rtts)[2] <= 45.0, rtts

    stop = threading.Event()
    blast(conn, stop)
    time.sleep(1.0)  # past the first burst and the relay's first held chunks
    got, t0 = sink.received, time.perf_counter()
    time.sleep(3.0)
    mbit = (sink.received - got) * 8 / (time.perf_counter() - t0) / 1e6
    stop.set()
    assert 17.0 <= mbit <= 23.0, f"{mbit:.2f} Mbit/s on a 20mbit link"
    sent = link.counters()
    assert sent["remote_to_home"] > 7_000_000 > sent["home_to_remote"]
    conn.close()


def test_cut_stops_bytes_and_heal_resumes_them(link: WanLink) -> None:
    sink = Sink(link)
    conn = dial(link, sink.port)
    stop = threading.Event()
    blast(conn, stop)
    time.sleep(1.0)
    assert sink.received > 1_000_000

    link.cut()
    time.sleep(0.5)  # what the relay held (20 ms) and the queue (50 ms) drain
    during = sink.received
    time.sleep(2.0)
    assert sink.received == during, "bytes crossed a cut link"
    with pytest.raises(OSError), in_netns(link.remote.ns):  # new connections hang
        socket.create_connection((link.home.ip, sink.port), timeout=1.0)

    link.heal()
    deadline = time.monotonic() + 15  # TCP's retransmission back-off after a 2.5 s silence
    while sink.received < during + 1_000_000 and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    assert sink.received >= during + 1_000_000, "the same connection did not resume"
    conn.close()


def test_link_is_gone_after_exit() -> None:
    import subprocess

    with WanLink(rate="10mbit", rtt_ms=10) as wan:
        names = (wan.home.ns, wan.remote.ns)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(n in listed for n in names)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
