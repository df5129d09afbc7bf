"""Shared fixtures: a real synchronizer served over h2c on a loopback port, in-process.

def test_x(sync_server): client = sync_server.client("learner-0")
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from ddiloco.local.processes import free_port
from ddiloco.synchronizer.app import create_app
from ddiloco.synchronizer.client import SyncClient
from ddiloco.synchronizer.config import SyncSettings

TOKEN = "test-token"


@dataclass
class SyncServer:
    url: str
    state_dir: Path
    server: uvicorn.Server
    thread: threading.Thread
    token: str = TOKEN

    def client(self, token: str = TOKEN) -> SyncClient:
        return SyncClient(self.url, token, timeout=10)

    @property
    def sync(self):  # the domain object behind the routes
        return self.server.config.app.state.sync  # type: ignore[union-attr]


def start_sync_server(state_dir: Path, **settings: object) -> SyncServer:
    port = free_port()
    cfg = SyncSettings(token=TOKEN, state_dir=state_dir, port=port, **settings)  # type: ignore[arg-type]
    config = uvicorn.Config(
        create_app(cfg),
        host="127.0.0.1",
        port=port,
        http="zttp",
        http2=True,
        log_level="warning",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    probe = SyncClient(f"http://127.0.0.1:{port}", TOKEN, timeout=2)
    while not (server.started and probe.healthy()):
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("in-process synchronizer did not start")
        time.sleep(0.02)
    return SyncServer(f"http://127.0.0.1:{port}", state_dir, server, thread)


def stop_sync_server(s: SyncServer) -> None:
    s.server.should_exit = True
    s.thread.join(timeout=10)


@pytest.fixture
def sync_server(tmp_path: Path) -> Iterator[SyncServer]:
    s = start_sync_server(tmp_path / "state", quorum=1, grace=False)
    try:
        yield s
    finally:
        stop_sync_server(s)


@pytest.fixture
def make_sync_server(tmp_path: Path) -> Iterator[Callable[..., SyncServer]]:
    """Start in-process synchronizers with the given settings; all stopped at teardown."""
    started: list[SyncServer] = []

    def make(**settings: object) -> SyncServer:
        s = start_sync_server(tmp_path / f"state{len(started)}", **settings)
        started.append(s)
        return s

    try:
        yield make
    finally:
        for s in started:
            stop_sync_server(s)


BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> Any:
    """A bench/ script as a module: bench/ holds scripts, not a package, so they load by path
    (and once: quality.py imports quality_stats from beside itself)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]
