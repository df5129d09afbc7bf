"""The partition relay (local/netcut.py): relays, resets on cut, refuses while cut, heals.

pytest tests/unit/test_netcut.py
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from ddiloco.local.netcut import CutProxy


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(ConnectionResetError):  # the relay's cut resets us
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield int(server.getsockname()[1])
    stop.set()
    server.close()


def roundtrip(port: int, payload: bytes = b"ping") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        return s.recv(4096)


def test_relay_cut_and_restore(echo_port: int) -> None:
    proxy = CutProxy(echo_port)
    proxy.start()
    try:
        assert roundtrip(proxy.port) == b"ping"
        live = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        live.sendall(b"a")
        assert live.recv(16) == b"a"

        proxy.cut()
        # the open connection dies: EOF or a reset, never an answer
        with pytest.raises((ConnectionError, OSError)):
            live.sendall(b"b")
            if live.recv(16) == b"":
                raise ConnectionResetError("closed")
        live.close()
        # new connections are reset while the cut lasts
        with pytest.raises((ConnectionError, OSError)):
            if roundtrip(proxy.port) == b"":
                raise ConnectionResetError("closed")
        # the relay thread counts the reset after the client has seen it: wait, with a deadline
        deadline = time.monotonic() + 5
        while proxy.resets < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.cuts == 1 and proxy.resets >= 2

        proxy.restore()
        assert roundtrip(proxy.port, b"back") == b"back"
    finally:
        proxy.close()


def test_upstream_down_is_passed_on() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        dead_port = int(s.getsockname()[1])  # closed again below: nothing listens there
    proxy = CutProxy(dead_port)
    proxy.start()
    try:
        with pytest.raises((ConnectionError, OSError)):
            if roundtrip(proxy.port) == b"":
                raise ConnectionResetError("closed")
    finally:
        proxy.close()


def test_delayed_relay_adds_its_delay_each_way_and_keeps_the_bytes(echo_port: int) -> None:
    proxy = CutProxy(echo_port, delay_s=0.05)
    proxy.start()
    try:
        payload = bytes(range(256)) * 4096  # 1 MiB, in many chunks
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            t = time.perf_counter()
            s.sendall(b"p")
            assert s.recv(16) == b"p"
            rtt = time.perf_counter() - t
            s.sendall(payload)
            got = b""
            while len(got) < len(payload):
                got += s.recv(1 << 16)
        assert 0.1 <= rtt < 0.5, rtt  # 50 ms there, 50 ms back
        assert got == payload
        assert proxy.bytes_relayed >= 2 * len(payload)
    finally:
        proxy.close()


@pytest.mark.parametrize("delay_s", [0.0, 0.02])
def test_relay_on_a_given_port_counts_each_direction_and_connections(delay_s: float) -> None:
    """The region link's use (tests/integration/wanlink.py): a fixed listening port, and bytes
    counted per direction, so traffic is seen to have crossed both ways."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        for _ in range(2):
            conn, _ = server.accept()
            with conn:
                got = 0
                while data := conn.recv(1 << 16):
                    got += len(data)
                conn.sendall(str(got).encode())

    threading.Thread(target=serve, daemon=True).start()
    with socket.create_server(("127.0.0.1", 0)) as s:
        free_port = int(s.getsockname()[1])
    proxy = CutProxy(int(server.getsockname()[1]), listen_port=free_port, delay_s=delay_s)
    proxy.start()
    try:
        assert proxy.port == free_port and proxy.address == f"127.0.0.1:{free_port}"
        sent = [300_000, 5]
        replies = b""
        for n in sent:
            with socket.create_connection(("127.0.0.1", free_port), timeout=5) as c:
                c.sendall(b"x" * n)
                c.shutdown(socket.SHUT_WR)
                reply = b""
                while data := c.recv(64):
                    reply += data
            assert reply == str(n).encode()
            replies += reply
        # a pump counts a chunk after passing it on: wait for the counts, with a deadline
        deadline = time.monotonic() + 5
        while proxy.bytes_relayed < sum(sent) + len(replies) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.bytes_to_target == sum(sent)
        assert proxy.bytes_to_client == len(replies)
        assert proxy.bytes_relayed == sum(sent) + len(replies)
        assert proxy.connections == 2
    finally:
        proxy.close()
        server.close()
