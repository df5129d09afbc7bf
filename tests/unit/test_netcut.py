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
