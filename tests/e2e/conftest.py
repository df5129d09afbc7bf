"""Shared by the end-to-end tests: a real `ddiloco synchronizer` process on a loopback port.

proc = synchronizer_process(tmp_path, "tok", "--no-grace", DDILOCO_QUORUM="3")
try:
    proc.start()          # and waits until /healthz answers
    proc.child.kill()     # SIGKILL; proc.start() again restarts it on the same state
finally:
    terminate_all([proc.child])
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddiloco.learner.sync_client import SyncClient
from ddiloco.local.processes import Child, ddiloco_command, env_with, free_port


def ddiloco_run(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """A `ddiloco` subprocess to its end, with os.environ plus `env`, one torch thread."""
    return subprocess.run(
        ddiloco_command(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        check=False,
    )


def one_line_error(
    done: subprocess.CompletedProcess[str], prog: str, code: int | None = None
) -> str:
    """The single `ddiloco <prog>: error: ...` line of a failed run: exit status `code`, or
    any non-zero one when None, and no traceback."""
    if code is None:
        assert done.returncode != 0, done.stdout[-2000:]
    else:
        assert done.returncode == code, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ddiloco {prog}: error: "), lines
    return lines[0]


@dataclass
class SyncProcess:
    child: Child
    port: int
    token: str
    state: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.child.log_path

    def client(self, timeout: float = 10.0) -> SyncClient:
        return SyncClient(self.url, self.token, timeout=timeout)

    def start(self, timeout_s: float = 60.0) -> None:
        self.child.start()
        probe, deadline = self.client(timeout=2), time.time() + timeout_s
        while not probe.healthy():
            assert self.child.alive() and time.time() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.1)


def make_synchronizer(tmp: Path, token: str, *flags: str, **env: str) -> SyncProcess:
    """An (unstarted) synchronizer on a free port, state in tmp/state, log in tmp/sync.log."""
    port = free_port()
    argv = ddiloco_command(
        "synchronizer", "--port", str(port), "--state-dir", str(tmp / "state"), *flags
    )
    child = Child("synchronizer", argv, env_with(DDILOCO_TOKEN=token, **env), tmp / "sync.log")
    return SyncProcess(child, port, token, tmp / "state")


@pytest.fixture(scope="session")
def synchronizer_process() -> Callable[..., SyncProcess]:
    return make_synchronizer


def make_learner(
    tmp: Path, sync: SyncProcess, index: int, num_learners: int, *flags: str, **env: str
) -> Child:
    """An (unstarted) learner `l<index>` of `sync`'s job, one thread, steps logged to
    tmp/l<index>.jsonl."""
    argv = ddiloco_command(
        "learner",
        "--sync-url",
        sync.url,
        "--learner-id",
        f"l{index}",
        "--learner-index",
        str(index),
        "--num-learners",
        str(num_learners),
        "--threads",
        "1",
        "--log-every",
        "0",
        "--log-path",
        str(tmp / f"l{index}.jsonl"),
        *flags,
    )
    env = env_with(DDILOCO_TOKEN=sync.token, OMP_NUM_THREADS="1", **env)
    return Child(f"l{index}", argv, env, tmp / f"l{index}.log")


@pytest.fixture(scope="session")
def learner_process() -> Callable[..., Child]:
    return make_learner


@dataclass
class ReportedRun:
    """A finished short `ddiloco local` run: its output folder, report and TensorBoard folder."""

    out: Path
    report: dict
    tensorboard: Path


@pytest.fixture(scope="session")
def reported_run(tmp_path_factory: pytest.TempPathFactory) -> ReportedRun:
    """One real 10-second run (2 learners, a pause and a kill) shared by the report tests."""
    import json
    import subprocess
    import sys

    tmp = tmp_path_factory.mktemp("reported-run")
    cmd = [sys.executable, "-P", "-m", "ddiloco.cli.main", "local", "--learners", "2"]
    cmd += ["--max-seconds", "10", "--seed", "1", "--chaos", "kill+pause", "--hot-spares", "0"]
    cmd += ["--out", str(tmp / "run"), "--tensorboard", str(tmp / "tb"), "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp / "run" / "report.json").read_text())
    return ReportedRun(tmp / "run", report, tmp / "tb" / "run")
