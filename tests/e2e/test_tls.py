"""TLS between learners and the synchronizer, with real processes on loopback.

    .venv/bin/python -m pytest -q tests/e2e/test_tls.py -m e2e -p no:cacheprovider

A `ddiloco synchronizer` serving HTTPS (mutual TLS) and a `ddiloco learner` that trains
against it over HTTP/2 negotiated by ALPN; peers with the wrong CA, no client certificate,
or cleartext are refused; the token file rotates under the running learner. Then a
server-only TLS synchronizer, and `ddiloco local --mtls` end to end.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddiloco.learner.sync_client import ClientTLS, SyncClient, SyncRefused, SyncUnavailable
from ddiloco.local.processes import Child, ddiloco_command, env_with, free_port, terminate_all
from ddiloco.wire import tls
from ddiloco.wire.auth import TokenFile

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
OLD, NEW = "tok-old-7f3a2c", "tok-new-91bc4d"


@dataclass
class Certs:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    def client(self, name: str) -> ClientTLS:
        return ClientTLS(self.ca, self.dir / f"{name}.crt", self.dir / f"{name}.key")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("certs")
    ca = tls.issue_ca("e2e CA", days=2)
    tls.write_pem(ca.cert_pem, d / "ca.crt")
    tls.write_pair(
        tls.issue_server(ca, ["localhost"], ["127.0.0.1"]), d / "server.crt", d / "server.key"
    )
    for name in ("l0", "probe"):
        tls.write_pair(tls.issue_client(ca, name), d / f"{name}.crt", d / f"{name}.key")
    other = tls.issue_ca("someone else's CA")
    tls.write_pem(other.cert_pem, d / "other-ca.crt")
    tls.write_pair(tls.issue_client(other, "l0"), d / "intruder.crt", d / "intruder.key")
    return Certs(d)


def wait_for(pred: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def write_token(path: Path, text: str) -> None:
    """Replace the file the way kubelet does: a new inode renamed over the old path."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def start_sync(
    tmp: Path, certs: Certs, token_file: Path, *, mtls: bool, upload: int | None = None
) -> tuple[Child, str]:
    port = free_port()
    argv = ddiloco_command(
        "synchronizer",
        "--port",
        str(port),
        "--state-dir",
        str(tmp / "state"),
        "--tls-cert",
        str(certs.dir / "server.crt"),
        "--tls-key",
        str(certs.dir / "server.key"),
        *(["--tls-client-ca", str(certs.ca)] if mtls else []),
        *(["--upload-port", str(upload)] if upload else []),
    )
    env = env_with(DDILOCO_TOKEN_FILE=str(token_file))
    env.pop("DDILOCO_TOKEN", None)
    child = Child("synchronizer", argv, env, tmp / "sync.log")
    child.start()
    url = f"https://127.0.0.1:{port}"
    probe = SyncClient(url, "x", timeout=2, tls=certs.client("probe"))
    wait_for(lambda: probe.healthy() or not child.alive(), 60, "the synchronizer to serve HTTPS")
    assert child.alive(), child.log_path.read_text()[-3000:]
    return child, url


def metric(client: SyncClient, name: str, **labels: str) -> float:
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in client.request("GET", "/metrics")[2].decode().splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def adopted(log: Path) -> int:
    if not log.exists():
        return 0
    return sum(1 for line in log.read_text().splitlines() if '"event":"adopt"' in line)


def test_learner_over_mtls_h2_and_token_rotation(tmp_path: Path, certs: Certs) -> None:
    sync_token, learner_token = tmp_path / "sync-token", tmp_path / "learner-token"
    write_token(sync_token, f"{OLD}\n")
    write_token(learner_token, f"{OLD}\n")
    upload = free_port()  # the learner's uploads go there, over mutual TLS (upload_port.py)
    sync, url = start_sync(tmp_path, certs, sync_token, mtls=True, upload=upload)
    learner = Child(
        "l0",
        ddiloco_command(
            "learner",
            "--sync-url",
            url,
            "--learner-id",
            "l0",
            "-H",
            "8",
            "-P",
            "2",
            "--threads",
            "1",
            "--log-every",
            "0",
            "--log-path",
            str(tmp_path / "l0.jsonl"),
            "--ca-file",
            str(certs.ca),
            "--client-cert",
            str(certs.dir / "l0.crt"),
            "--client-key",
            str(certs.dir / "l0.key"),
        ),
        {
            k: v
            for k, v in env_with(DDILOCO_TOKEN_FILE=str(learner_token), OMP_NUM_THREADS="1").items()
            if k != "DDILOCO_TOKEN"
        },
        tmp_path / "l0.log",
    )
    # the test's own calls go over HTTP/1.1, so every HTTP/2 request the server counts is
    # the learner's (its heartbeats and downloads; uploads default to HTTP/1.1)
    admin = SyncClient(url, TokenFile(sync_token), timeout=10, tls=certs.client("probe"))
    admin.http2 = False
    try:
        learner.start()

        def merged_and_adopted() -> bool:
            assert learner.alive(), learner.log_path.read_text()[-3000:]
            return admin.status().global_version >= 3 and adopted(tmp_path / "l0.jsonl") >= 1

        wait_for(merged_and_adopted, 180, "merges the learner adopted")
        assert admin.http_version == "HTTP/1.1"
        assert metric(admin, "ddiloco_http_requests_total", scheme="https", version="2") > 0
        assert metric(admin, "ddiloco_http_requests_total", scheme="http", version="2") == 0
        accepted = admin.status().contributions_merged  # each from one upload or more
        assert accepted >= 1
        assert metric(admin, "ddiloco_upload_port_requests_total", code="200", scheme="https") >= (
            accepted
        )
        up_url = f"https://127.0.0.1:{upload}"

        # a client of ours over HTTP/2: ALPN picked h2
        h2 = SyncClient(url, OLD, timeout=5, tls=certs.client("probe"))
        assert h2.status().initialized and h2.http_version == "HTTP/2"

        # refused: the wrong CA, no client certificate, one from another CA, cleartext
        refused = {
            "wrong CA": SyncClient(url, OLD, timeout=5, tls=ClientTLS(certs.dir / "other-ca.crt")),
            "no client cert": SyncClient(url, OLD, timeout=5, tls=ClientTLS(certs.ca)),
            "foreign client cert": SyncClient(
                url,
                "old",
                timeout=5,
                tls=ClientTLS(certs.ca, certs.dir / "intruder.crt", certs.dir / "intruder.key"),
            ),
            "cleartext": SyncClient(url.replace("https", "http"), OLD, timeout=5),
            "cleartext HTTP/1.1": SyncClient(
                url.replace("https", "http"), OLD, timeout=5, http2=False
            ),
        }
        for why, client in refused.items():
            with pytest.raises(SyncUnavailable):
                client.status()
                pytest.fail(f"{why}: answered")
        # and the same at the upload port: no update gets in without a client certificate
        for tls_files in (ClientTLS(certs.ca), ClientTLS(certs.dir / "other-ca.crt")):
            intruder = SyncClient(up_url, OLD, timeout=5, tls=tls_files, http2=False, sendmsg=True)
            with pytest.raises(SyncUnavailable):
                intruder.post_update(0, b"{}")
            with pytest.raises(SyncUnavailable):  # as parts, from their memory (upload_sender.py)
                intruder.post_update(0, [b"{", memoryview(b"}")])
        assert sync.alive()

        # rotation step 1: both tokens valid; the learner, still on the old one, goes on
        write_token(sync_token, f"{NEW}\n{OLD}\n")
        v = admin.status().global_version
        old_client = SyncClient(url, OLD, timeout=5, tls=certs.client("probe"), http2=False)
        new_client = SyncClient(url, NEW, timeout=5, tls=certs.client("probe"), http2=False)
        assert old_client.status().initialized and new_client.status().initialized
        wait_for(lambda: admin.status().global_version >= v + 2, 120, "merges on the old token")
        # the learner's Secret is updated: it moves to the new token by itself
        write_token(learner_token, f"{NEW}\n")
        time.sleep(1.5)
        # step 2: only the new token is valid
        write_token(sync_token, f"{NEW}\n")
        with pytest.raises(SyncRefused) as e:
            old_client.status()
        assert e.value.status == 401 and e.value.kind == "unauthorized"
        assert new_client.status().initialized
        v = admin.status().global_version
        wait_for(lambda: admin.status().global_version >= v + 2, 120, "merges on the new token")
        assert learner.alive()
        # the one 401 the server gave is the old client's: the learner never sent a stale token
        assert metric(admin, "ddiloco_refusals_total", reason="unauthorized") == 1
        assert "401" not in learner.log_path.read_text()

        # a client whose token file changed without a visible stat change re-reads on a 401
        f = tmp_path / "same-size"
        write_token(f, f"{OLD}\n")
        lazy = TokenFile(f, max_age_s=3600)
        stale = SyncClient(url, lazy, timeout=5, tls=certs.client("probe"))
        st = f.stat()
        f.write_text(f"{NEW}\n")  # in place: same inode and size
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the same mtime
        assert stale.status().initialized  # 401 with "old", re-read, retried with "new"
        assert stale.token == NEW
        assert metric(admin, "ddiloco_refusals_total", reason="unauthorized") == 2
    finally:
        terminate_all([learner, sync])
    logs = sync.log_path.read_text() + learner.log_path.read_text()
    assert "BEGIN" not in logs and OLD not in logs and NEW not in logs  # no key, no token


def test_server_only_tls(tmp_path: Path, certs: Certs) -> None:
    token = tmp_path / "token"
    write_token(token, "t0\n")
    sync, url = start_sync(tmp_path, certs, token, mtls=False)
    try:
        ok = SyncClient(url, "t0", timeout=5, tls=ClientTLS(certs.ca))
        assert not ok.status().initialized and ok.http_version == "HTTP/2"
        h1 = SyncClient(url, "t0", timeout=5, tls=ClientTLS(certs.ca), http2=False)
        assert h1.healthy() and h1.http_version == "HTTP/1.1"
        by_name = SyncClient(url.replace("127.0.0.1", "localhost"), "t0", tls=ClientTLS(certs.ca))
        assert by_name.healthy()
        # no CA given: the system trust store, which does not know the job's CA
        with pytest.raises(SyncUnavailable, match="certificate"):
            SyncClient(url, "t0", timeout=5).status()
        with pytest.raises(SyncRefused) as e:
            SyncClient(url, "wrong", timeout=5, tls=ClientTLS(certs.ca)).status()
        assert e.value.status == 401
        # `ddiloco status` over HTTPS: HTTP/1.1 by ALPN (it offered h2 once, and the server's
        # HTTP/2 frames came back to an HTTP/1.1 request)
        got = subprocess.run(
            [sys.executable, "-m", "ddiloco.cli.main", "status", url, "--ca", str(certs.ca),
             "--json"],
            capture_output=True, text=True, timeout=60, env={**os.environ, "DDILOCO_TOKEN": "t0"},
        )  # fmt: skip
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["initialized"] is False
    finally:
        terminate_all([sync])


def test_local_mtls_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "ddiloco.cli.main",
        "local",
        "--learners",
        "2",
        "--max-seconds",
        "15",
        "-H",
        "8",
        "-P",
        "2",
        "--mtls",
        "--out",
        str(out),
        "--quiet",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads((out / "report.json").read_text())
    assert r["tls"]["enabled"] and r["tls"]["mutual"]
    assert r["tls"]["url"].startswith("https://127.0.0.1:")
    assert r["tls"]["http_version"] == "HTTP/2"
    assert r["config"]["tls"] and r["config"]["mtls"]
    assert r["merges"] > 0 and r["tokens_merged"] > 0
    assert len(r["eval_history"]) >= 1  # the evaluator talked to the synchronizer over TLS
    keys = sorted(p.name for p in (out / "tls").glob("*.key"))
    assert keys == ["launcher.key", "learner-0.key", "learner-1.key", "server.key"], keys
    assert all(stat.S_IMODE((out / "tls" / k).stat().st_mode) == 0o600 for k in keys)
    assert not (out / "tls" / "ca.key").exists()
    pair = tls.KeyPair.load(out / "tls" / "server.crt", out / "tls" / "server.key")
    assert pair.ip_addresses == ["127.0.0.1"] and pair.dns_names == ["localhost"]
    assert "mutual (HTTP/2)" in done.stdout
