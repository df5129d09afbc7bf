"""s3server: a real S3-compatible server for the tests, built from its Go module.

The server is VersityGW (github.com/versity/versitygw, Apache-2.0), an S3 gateway that stores
buckets as directories and objects as files of a POSIX directory: multipart upload, ranged GET,
ListObjectsV2 and SigV4 authentication are the real thing, served by one static binary.

    python tests/s3server.py build      # once per machine (tests/run.sh does it); prints the path
    python tests/s3server.py path       # where the binary is (or would be) cached

The binary lives in ~/.cache/ddiloco/s3server/versitygw-<version>/ (XDG_CACHE_HOME is honoured),
never in the repo; a build is skipped when that exact version is already there, and a version
bump below builds anew. Go's own caches stay where `go env` says. DDILOCO_S3SERVER_BIN=<file>
uses a prebuilt binary instead. The build never runs inside pytest: the session fixture
`s3_server` (tests/conftest.py) skips, or fails with CI=true, when the binary is missing.

    server = start(tmp_dir)             # a free loopback port, fresh keys, one bucket
    server.env()                        # AWS_* variables for a subprocess (s3fs, botocore)
    server.filesystem()                 # an s3fs.S3FileSystem signed with the same keys
    server.stop()

A pod of the k8senv real node (tests/integration/realnode.py) reaches the host only at the host
end of the node's veth, `real_node.host_ip`: start(dir, hosts=("127.0.0.1", node.host_ip))
listens there too (the host's loopback is another network namespace's).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import s3fs

    from ddiloco.local.processes import Child

MODULE: Final = "github.com/versity/versitygw"
VERSION: Final = "v1.8.0"
BINARY: Final = "versitygw"
BUILD_COMMAND: Final = "python tests/s3server.py build"
HEALTH_PATH: Final = "/health"
REGION: Final = "us-east-1"
START_TIMEOUT_S: Final = 30.0


class NotBuilt(RuntimeError):
    """The server binary is not in the cache (run BUILD_COMMAND)."""


class BuildFailed(RuntimeError):
    """`go install` of the server failed, or built something other than the pinned version."""


# --------------------------------------------------------------------------- build and cache


def cache_dir() -> Path:
    """The directory that holds this version's binary."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ddiloco" / "s3server" / f"{BINARY}-{VERSION}"


def binary_path() -> Path:
    """Where the binary is, or would be once built (DDILOCO_S3SERVER_BIN overrides)."""
    if prebuilt := os.environ.get("DDILOCO_S3SERVER_BIN"):
        return Path(prebuilt)
    return cache_dir() / BINARY


def find_built() -> Path | None:
    """The binary if it is there, else None."""
    path = binary_path()
    return path if path.is_file() and os.access(path, os.X_OK) else None


def build(echo: bool = True) -> Path:
    """Build the pinned version with `go install` into the cache unless it is there already.

    One builder at a time (a lock file beside the cache); the binary is installed into a
    temporary directory and renamed into place, so an interrupted build never looks done.
    """
    if (done := find_built()) is not None:
        return done
    final = cache_dir()
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (done := find_built()) is not None:
            return done
        if shutil.which("go") is None:
            raise BuildFailed(f"cannot build {MODULE}: no `go` on PATH")
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        tmp.chmod(0o755)
        try:
            env = dict(os.environ, GOBIN=str(tmp), CGO_ENABLED="0", GOFLAGS="-buildvcs=false")
            # `go install pkg@version` builds with the module's own go.mod and go.sum; the
            # version string is stamped as versitygw's Makefile does.
            argv = [
                "go", "install", "-trimpath",
                "-ldflags", f"-s -w -X main.Version={VERSION}",
                f"{MODULE}/cmd/{BINARY}@{VERSION}",
            ]  # fmt: skip
            t0 = time.monotonic()
            # Run from the cache dir: outside our repo, so no main module is in play.
            proc = subprocess.run(
                argv, cwd=tmp, env=env, capture_output=not echo, text=True, check=False
            )
            if proc.returncode != 0:
                why = "its output is above" if echo else proc.stderr.strip()[-2000:]
                raise BuildFailed(f"`{' '.join(argv)}` failed (rc={proc.returncode}): {why}")
            out = subprocess.run(
                [str(tmp / BINARY), "--version"], capture_output=True, text=True, check=True
            ).stdout
            if VERSION not in out:
                raise BuildFailed(f"{BINARY} --version says {out.strip()!r}, expected {VERSION}")
            shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if echo:
        size = (final / BINARY).stat().st_size / 2**20
        print(
            f"s3server: built {MODULE}@{VERSION} in {time.monotonic() - t0:.0f}s ({size:.0f} MiB)"
        )
    return final / BINARY


def missing_message() -> str:
    return f"{BINARY} {VERSION} is not built: run `{BUILD_COMMAND}` (needs Go and the module proxy)"


# --------------------------------------------------------------------------- the server


@dataclass(frozen=True)
class S3Request:
    """One line of the server's access log: the S3 operation (`GetObject`, `PutObject`,
    `ListObjectsV2`, ...), its bucket and key, the HTTP status and S3 error code, and the access
    key that signed it ("-" when none was accepted)."""

    operation: str
    bucket: str
    key: str
    status: int
    error: str
    requester: str


# S3 server access log fields: owner bucket [time] ip requester request-id operation key
# request-uri status error-code ... (the time holds a space, hence the brackets).
_ACCESS_LINE: Final = re.compile(
    r"^\S+ (?P<bucket>\S+) \[[^\]]*\] \S+ (?P<requester>\S+) \S+ (?P<op>\S+) (?P<key>\S+) \S+ "
    r"(?P<status>\d+) (?P<error>\S+) "
)


@dataclass
class S3Server:
    """A running server: its endpoint, the root user's keys and one bucket."""

    endpoint_url: str
    access_key: str
    secret_key: str = field(repr=False)
    bucket: str
    data_dir: Path
    child: Child = field(repr=False)
    region: str = REGION
    hosts: tuple[str, ...] = ("127.0.0.1",)
    port: int = 0
    access_log: Path | None = None

    def url(self, *parts: str) -> str:
        """s3://<bucket>/<parts joined by />."""
        return "/".join([f"s3://{self.bucket}", *parts])

    def endpoint_on(self, host: str) -> str:
        """The endpoint as seen through another of the addresses it listens on."""
        assert host in self.hosts, f"{host} is not one of {self.hosts}"
        return f"http://{host}:{self.port}"

    def env(self, host: str | None = None) -> dict[str, str]:
        """The AWS_* variables a subprocess's botocore (and so s3fs) reads."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url if host is None else self.endpoint_on(host),
            "AWS_REGION": self.region,
        }

    def storage_options(self) -> dict[str, object]:
        """Keyword arguments for s3fs.S3FileSystem / fsspec.open(..., **options)."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "endpoint_url": self.endpoint_url,
            "client_kwargs": {"region_name": self.region},
        }

    def filesystem(self) -> s3fs.S3FileSystem:
        """A fresh (not cached) s3fs filesystem with the root user's keys."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint_url + HEALTH_PATH, timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def requests(self) -> list[S3Request]:
        """The requests served so far, oldest first (needs start(..., access_log=True))."""
        assert self.access_log is not None, "started without access_log=True"
        try:
            text = self.access_log.read_text(errors="replace")
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            if m := _ACCESS_LINE.match(line):
                out.append(
                    S3Request(
                        operation=m["op"],
                        bucket=m["bucket"],
                        key=m["key"] if m["key"] != "-" else "",
                        status=int(m["status"]),
                        error=m["error"] if m["error"] != "-" else "",
                        requester=m["requester"],
                    )
                )
        return out

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.child.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        self.child.stop(grace_s=5.0)


def free_port(hosts: Sequence[str]) -> int:
    """A port that is free on the first of hosts (and, checked, on the others)."""
    for _ in range(20):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = int(s.getsockname()[1])
        try:
            for h in hosts[1:]:
                with socket.socket() as s:
                    s.bind((h, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {hosts}")


def start(
    root: Path,
    *,
    bucket: str = "ddiloco-test",
    hosts: Sequence[str] = ("127.0.0.1",),
    binary: Path | None = None,
    access_log: bool = False,
) -> S3Server:
    """Start the server over root/data on a free port of `hosts`, with fresh random keys, wait
    until it answers, and create `bucket`. The keys reach the server through its environment,
    never its command line. With `access_log`, every request is logged to root/access.log
    (S3's server access log format: `S3Server.requests()` reads it). Raises NotBuilt when the
    binary is missing."""
    from ddiloco.local.processes import Child  # the venv's; building needs only the stdlib

    exe = binary or find_built()
    if exe is None:
        raise NotBuilt(missing_message())
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    access_key = "DDK" + secrets.token_hex(8).upper()
    secret_key = secrets.token_urlsafe(30)
    port = free_port(hosts)
    (root / "iam").mkdir(exist_ok=True)
    # --iam-dir: the internal IAM service, which (like AWS) answers an unknown access key with
    # 403 InvalidAccessKeyId; single-account mode's answer is a 404 of its own.
    argv = [str(exe), "--quiet", "--health", HEALTH_PATH, "--region", REGION]
    argv += ["--iam-dir", str(root / "iam")]
    if access_log:
        argv += ["--access-log", str(root / "access.log")]
    for h in hosts:
        argv += ["--port", f"{h}:{port}"]
    argv += ["posix", str(data)]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "ROOT_ACCESS_KEY_ID": access_key,
        "ROOT_SECRET_ACCESS_KEY": secret_key,
    }
    child = Child("s3server", argv, env, root / "s3server.log")
    child.start()
    server = S3Server(
        endpoint_url=f"http://{hosts[0]}:{port}",
        access_key=access_key,
        secret_key=secret_key,
        bucket=bucket,
        data_dir=data,
        child=child,
        hosts=tuple(hosts),
        port=port,
        access_log=root / "access.log" if access_log else None,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.healthy():
            if not child.alive():
                raise RuntimeError(
                    f"{BINARY} exited (rc={child.exit_code()}):\n{server.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{BINARY} did not answer in {START_TIMEOUT_S:.0f}s")
            time.sleep(0.05)
        # CreateBucket without a LocationConstraint: like AWS, the server refuses the one
        # s3fs.mkdir sends for us-east-1.
        server.filesystem().call_s3("create_bucket", Bucket=bucket)
    except BaseException:
        server.stop()
        raise
    return server


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("command", choices=["build", "path"])
    args = p.parse_args(argv)
    if args.command == "path":
        print(binary_path())
        return 0
    try:
        print(build())
    except BuildFailed as e:
        print(f"s3server: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
