"""`ddiloco status` against a live synchronizer, and `ddiloco local`'s live table from /v1/status.

A real synchronizer and two real learners train a few dozen steps; then `ddiloco status URL`
runs as a subprocess: `--json` must be the synchronizer's own status (the same learners,
versions and goodput a SyncClient reads), `--once` must show them, the live view must keep
refreshing, and a wrong token or an unreachable URL must be one line and its exit code (2: the
command is wrong, 1: the synchronizer cannot be reached). Then a short `ddiloco local` run
without --quiet prints its live table, which now comes from the same status.

Not tested: `ddiloco status --job` (a port-forward needs a real pod, which only the real-node
integration tests have; its CR-status fallback against the test control plane is not written
yet). Its argument errors (a missing kubeconfig) are in test_cli_errors.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ddiloco.local.processes import Child, terminate_all

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLI = [sys.executable, "-P", "-m", "ddiloco.cli.main"]


def status_cli(*args: str, token: str | None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_")}
    env["COLUMNS"] = "200"  # rich wraps at the terminal width; keep the summary on one line
    if token is not None:
        env["DDILOCO_TOKEN"] = token
    return subprocess.run(
        [*CLI, "status", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def trained(
    tmp_path_factory: pytest.TempPathFactory,
    synchronizer_process: Callable[..., object],
    learner_process: Callable[..., Child],
) -> Iterator[object]:
    """A synchronizer after two learners trained 24 steps each (then exited)."""
    tmp = tmp_path_factory.mktemp("status")
    sync = synchronizer_process(tmp, "tok")
    flags = ("--max-steps", "24", "-H", "4", "-P", "2", "--batch-size", "4")
    learners = [learner_process(tmp, sync, i, 2, *flags) for i in range(2)]
    try:
        sync.start()  # type: ignore[attr-defined]
        for child in learners:
            child.start()
        deadline = time.time() + 180
        while any(c.alive() for c in learners):
            assert time.time() < deadline, "learners did not finish"
            time.sleep(0.2)
        assert all(c.exit_code() == 0 for c in learners), [c.log_path.read_text() for c in learners]
        yield sync
    finally:
        terminate_all([*learners, sync.child])  # type: ignore[attr-defined]


def test_json_is_the_synchronizers_status(trained: object) -> None:
    sync: object = trained
    done = status_cli(sync.url, "--json", token="tok")  # type: ignore[attr-defined]
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    client = sync.client()  # type: ignore[attr-defined]
    direct = client.status().model_dump()
    client.close()
    assert {x["learner_id"] for x in shown["learners"]} == {"l0", "l1"}
    for key in ("global_version", "merges", "tokens_merged", "goodput", "contributions_merged"):
        assert shown[key] == direct[key], key  # nothing trains any more: the numbers stand
    assert [f["version"] for f in shown["fragments"]] == [f["version"] for f in direct["fragments"]]
    assert shown["global_version"] > 0 and shown["goodput"] > 0


def test_once_shows_learners_versions_and_goodput(trained: object) -> None:
    sync: object = trained
    raw = json.loads(status_cli(sync.url, "--json", token="tok").stdout)  # type: ignore[attr-defined]
    done = status_cli(sync.url, "--once", token="tok")  # type: ignore[attr-defined]
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"goodput {raw['goodput']:.3f}" in out
    assert f"global version {raw['global_version']} ({raw['merges']} merges)" in out
    assert f"merged work {raw['merged_work_ratio']:.3f}" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    for ls in raw["learners"]:
        row = rows[ls["learner_id"]]
        cells = [c.strip() for c in row.split("│")[1:-1]]
        assert cells[3] == str(ls["step"]), row  # learner, state, inc, step, ...
        assert cells[2] == str(ls["incarnation"]), row
        share = ls["contributions"] / sum(x["contributions"] for x in raw["learners"])
        assert cells[5] == f"{share:.1%}", row
    for f in raw["fragments"]:
        assert any(
            c.split("│")[1].strip() == str(f["index"])
            and c.split("│")[3].strip() == str(f["version"])
            for c in out.splitlines()
            if c.count("│") > 3
        ), f


def test_live_view_refreshes(trained: object) -> None:
    sync: object = trained
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_")}
    env["DDILOCO_TOKEN"] = "tok"
    proc = subprocess.Popen(
        [*CLI, "status", sync.url, "--interval", "0.3"],  # type: ignore[attr-defined]
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        time.sleep(4.0)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=20)
    assert out.count("ddiloco status  http://") >= 3, out[-2000:]  # piped: a view per refresh
    assert "Traceback" not in err


def test_wrong_token_and_unreachable_url(trained: object) -> None:
    sync: object = trained
    for args in ((sync.url, "--once"), (sync.url, "--json")):  # type: ignore[attr-defined]
        done = status_cli(*args, token="wrong")
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("ddiloco status: error: ")
        assert "401" in done.stderr and len(done.stderr.strip().splitlines()) == 1
        assert done.stdout == ""
    down = status_cli("http://127.0.0.1:1", "--once", token="tok")
    assert down.returncode == 1, down.stderr
    assert down.stderr.startswith("ddiloco status: error: cannot reach http://127.0.0.1:1")
    assert len(down.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(300)
def test_local_live_table_reads_the_status(tmp_path: Path) -> None:
    """Not --quiet and not a terminal: the live table is printed every 10 s, the first one
    at the first tick; it comes from /v1/status (fragments, tokens/s) with local's restarts."""
    cmd = [*CLI, "local", "--learners", "2", "--max-seconds", "6", "--hot-spares", "0"]
    cmd += ["--out", str(tmp_path / "run")]
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "ddiloco local  t=" in out
    header = next(line for line in out.splitlines() if "tokens/s" in line)
    for col in ("learner", "state", "step", "tokens/s", "share", "loss", "restarts"):
        assert col in header, header
    assert "fragments" in out and "goodput" in out
    for lid in ("learner-0", "learner-1"):
        assert any(line.split("│")[1:2] == [f" {lid} "] for line in out.splitlines()), out
    assert "ddiloco local: summary" in out  # the end-of-run summary stays
