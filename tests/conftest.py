"""Shared fixtures: a real synchronizer served over h2c on a loopback port, in-process, and
a real S3-compatible server (tests/s3server.py) for the session.

def test_x(sync_server): client = sync_server.client("learner-0")
def test_y(s3_server): fs = s3_server.filesystem(); env = s3_server.env()
def test_z(s3_env): ...  # this process's AWS_* variables point at s3_env (the same server)
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from ddiloco.learner.sync_client import SyncClient
from ddiloco.local.processes import free_port
from ddiloco.synchronizer.app import create_app
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
    return _load_by_path(name, BENCH / f"{name}.py")


def _load_by_path(name: str, path: Path) -> Any:
    """A helper module of tests/ by path (--import-mode=importlib puts nothing on sys.path),
    registered once under its own name so test modules can `import` it."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


s3server = _load_by_path("s3server", Path(__file__).with_name("s3server.py"))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real S3-compatible server (VersityGW, tests/s3server.py) on a free loopback port over
    a temporary directory, with fresh keys and the bucket `s3_server.bucket`; stopped at the
    end of the session. Skips when its binary is not built (fails with CI=true: the build
    step, `python tests/s3server.py build`, must run before pytest)."""
    if s3server.find_built() is None:
        msg = s3server.missing_message()
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(f"{msg} [CI=true: the build step must run before pytest]", pytrace=False)
        pytest.skip(msg)
    server = s3server.start(tmp_path_factory.mktemp("s3server"), access_log=True)
    try:
        yield server
    finally:
        server.stop()
        assert not server.child.alive(), "the S3 server outlived stop()"


@pytest.fixture
def s3_env(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`s3_server`, with this process's AWS_* variables pointing at it (as a pod's would), for
    code that reads credentials from the environment. s3fs caches filesystems by their
    options, not by the environment, so its cache is emptied before and after: no filesystem
    of another test's endpoint is reused, and none of this one's outlives it."""
    import s3fs

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield s3_server
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
