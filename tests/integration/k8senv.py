"""k8senv: a real Kubernetes control plane for the integration tests, built from Go modules.

One etcd serves N clusters; each cluster is a kube-apiserver (own --etcd-prefix, port and
kubeconfig), kube-controller-manager, kube-scheduler and kwok, which fakes a small pool of GPU
nodes (and the kubelet's pod lifecycle on them). No Docker, no images. Recipe and figures:
tests/k8senv/README.md. Standard library only, so CI can run it before the venv matters.

    python tests/integration/k8senv.py build             # build once per machine (CI's build step)
    python tests/integration/k8senv.py up --clusters 3   # start, print kubeconfigs, Ctrl-C stops
    python tests/integration/k8senv.py up --clusters 1 --real-node   # + a real node (realnode.py)
    python tests/integration/k8senv.py up --regions 2 --link 50mbit,40ms --forward 8470:30470
                               # two clusters, a real node each, the remote one behind a shaped
                               # link (wanlink.py); region-a's pods reach home's NodePort 30470
                               # at <link address>:8470
    python tests/integration/k8senv.py up --clusters 1 --kueue   # + Kueue (kueueenv.py)
    python tests/integration/k8senv.py key               # cache key and directory (for CI caches)

Binaries live in ~/.cache/ddiloco/k8senv/<version-key>/ (XDG_CACHE_HOME is honoured); the key
hashes tests/k8senv/'s go.mod, go.sum, *.go, *.sh and *.yaml files, so a version bump rebuilds.
DDILOCO_K8SENV_BIN=<dir> uses prebuilt binaries instead. The pytest fixtures that use this module
are in tests/integration/conftest.py.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from realnode import RealNode
    from wanlink import RegionLink

log = logging.getLogger("k8senv")

K8SENV_DIR: Final = Path(__file__).resolve().parents[1] / "k8senv"
BUILD_SH: Final = K8SENV_DIR / "build.sh"
BUILD_COMMAND: Final = "python tests/integration/k8senv.py build"
MIN_GO: Final = (1, 26, 8)
DEFAULT_CLUSTERS: Final = ("home", "region-a", "region-b")
BINARIES: Final = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "etcd",
    "kwok",
    "helm",
    # the real node (realnode.py)
    "kubelet",
    "kube-proxy",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "coredns",
    "pause.oci.tar",
    "probe.oci.tar",
)
START_TIMEOUT_S: Final = 150.0
STOP_GRACE_S: Final = 10.0
PRUNE_AFTER_S: Final = 30 * 24 * 3600

# Fake nodes: what kwok pretends each one has. Labels make them look like a GPU pool in a region.
FAKE_NODE_ANNOTATION: Final = ("kwok.x-k8s.io/node", "fake")
FAKE_NODE_CAPACITY: Final = {
    "cpu": "32",
    "memory": "256Gi",
    "pods": "110",
    "ephemeral-storage": "1Ti",
    "nvidia.com/gpu": "8",
}
SERVICE_CIDR: Final = "10.96.0.0/16"
POD_CIDR: Final = "10.244.0.0/16"


def _kube_version() -> str:
    """The Kubernetes version build.sh pins (its KUBE_VERSION line), e.g. 'v1.37.2'."""
    m = re.search(r"^KUBE_VERSION=(v\S+)", BUILD_SH.read_text(), re.MULTILINE)
    assert m, f"no KUBE_VERSION= line in {BUILD_SH}"
    return m.group(1)


KUBE_VERSION: Final = _kube_version()


class ToolchainMissing(RuntimeError):
    """The binaries are not built and cannot be built here (no Go, or too old)."""


class BuildFailed(RuntimeError):
    """build.sh ran and failed; the message names its log."""


# --------------------------------------------------------------------------- build and cache


def version_key() -> str:
    """16 hex digits over the build inputs in tests/k8senv (paths and bytes; .go for our own
    programs there)."""
    h = hashlib.sha256()
    files = sorted(
        p
        for p in K8SENV_DIR.rglob("*")
        if p.is_file() and (p.suffix in {".mod", ".sum", ".sh", ".yaml", ".go"})
    )
    for p in files:
        h.update(p.relative_to(K8SENV_DIR).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ddiloco" / "k8senv"


def _is_complete(d: Path) -> bool:
    return (d / "MANIFEST.json").is_file() and all((d / b).is_file() for b in BINARIES)


def find_built() -> Path | None:
    """The directory holding built binaries, or None if they are not built for this key."""
    if prebuilt := os.environ.get("DDILOCO_K8SENV_BIN"):
        d = Path(prebuilt)
        missing = [b for b in BINARIES if not (d / b).is_file()]
        if missing:
            raise BuildFailed(f"DDILOCO_K8SENV_BIN={d} lacks {', '.join(missing)}")
        return d
    final = cache_root() / version_key()
    if _is_complete(final):
        with contextlib.suppress(OSError):
            os.utime(final)  # marks it used, for pruning
        return final
    return None


def failed_build_log() -> Path | None:
    """The log of a failed build for the current key, if the last attempt failed."""
    root, key = cache_root(), version_key()
    return root / f"{key}.build.log" if (root / f"{key}.failed").exists() else None


def go_problem() -> str | None:
    """Why Go cannot build here, or None if `go` is on PATH and new enough."""
    go = shutil.which("go")
    if go is None:
        return "no `go` on PATH"
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True).stdout.strip()
    m = re.match(r"go(\d+)\.(\d+)(?:\.(\d+))?", out)
    if not m:
        return f"cannot parse the Go version {out!r}"
    have = tuple(int(x or 0) for x in m.groups())
    if have < MIN_GO:
        return f"{out} is older than go{'.'.join(map(str, MIN_GO))}"
    return None


def missing_message() -> str:
    """What to run to get the binaries: one command, plus why it may not work yet."""
    msg = f"k8senv binaries are not built (key {version_key()}): run `{BUILD_COMMAND}`"
    if problem := go_problem():
        msg += (
            f" - it needs Go >= {'.'.join(map(str, MIN_GO))} and the Go module proxy "
            f"({problem}; https://go.dev/doc/install)"
        )
    else:
        msg += " (cold build: about 45 min on 2 cores, once per machine)"
    return msg


def run_build_script(
    script: Path, out_dir: Path, logfile: Path, echo: IO[str] | None
) -> tuple[int, float]:
    """`bash script out_dir`, its output into `logfile` (and `echo`, line by line): the exit
    code and the seconds it took. The builds of the control plane and of Kueue share it."""
    t0 = time.monotonic()
    with open(logfile, "w") as out:
        proc = subprocess.Popen(
            ["bash", str(script), str(out_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if echo is not None:
                echo.write(line)
                echo.flush()
        rc = proc.wait()
    return rc, time.monotonic() - t0


def build(echo: IO[str] | None = None) -> Path:
    """Build the binaries for the current key unless another run already did; return their dir.

    One builder per machine: others block on the lock and then reuse its result. The build goes
    into a temporary directory that is renamed into place after MANIFEST.json is written, so an
    interrupted build never looks complete. Output goes to <key>.build.log (and to `echo`).
    """
    if (done := find_built()) is not None:
        return done
    root, key = cache_root(), version_key()
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / key, root / f".{key}.{os.getpid()}"
    logfile, failed = root / f"{key}.build.log", root / f"{key}.failed"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(final):
            return final
        if problem := go_problem():
            raise ToolchainMissing(
                f"cannot build k8senv: {problem}; need Go >= "
                f"{'.'.join(map(str, MIN_GO))} and the Go module proxy"
            )
        shutil.rmtree(tmp, ignore_errors=True)
        rc, seconds = run_build_script(BUILD_SH, tmp, logfile, echo)
        if rc != 0:
            failed.write_text(f"rc={rc}\n")
            shutil.rmtree(tmp, ignore_errors=True)
            raise BuildFailed(f"k8senv build failed (rc={rc}) after {seconds:.0f}s; see {logfile}")
        go = subprocess.run(["go", "version"], capture_output=True, text=True).stdout.strip()
        manifest = {
            "key": key,
            "kube_version": KUBE_VERSION,
            "go": go,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(seconds),
        }
        (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover
        os.rename(tmp, final)
        failed.unlink(missing_ok=True)
        _prune(root, keep=key)
    log.info("k8senv built in %.0fs (%.1f min) into %s", seconds, seconds / 60, final)
    return final


def _prune(root: Path, keep: str) -> None:
    """Remove cache entries not used for 30 days (called with the lock held)."""
    now = time.time()
    for d in root.iterdir():
        if d.is_dir() and d.name != keep and now - d.stat().st_mtime > PRUNE_AFTER_S:
            shutil.rmtree(d, ignore_errors=True)
            (root / f"{d.name}.build.log").unlink(missing_ok=True)


def ensure_built() -> Path:
    """The binaries' directory, building them first if needed.

    Raises ToolchainMissing (no usable Go) or BuildFailed.
    """
    return find_built() or build()


# --------------------------------------------------------------------------- processes

_LIBC: Final = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG: Final = 1


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGKILL when the thread that started it dies.

    Linux ties PDEATHSIG to the parent *thread*; spawn from the main thread (pytest fixtures and
    the launcher do). The getppid check covers a parent that died before prctl ran.
    """

    def preexec() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def spawn(
    argv: Sequence[str | Path], logfile: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start argv with stdout+stderr appended to logfile, in its own session, dying with us."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "ab") as out:
        return subprocess.Popen(
            [str(a) for a in argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()),
        )


@dataclass
class Proc:
    """One child process of the control plane and its log."""

    name: str
    popen: subprocess.Popen[bytes]
    logfile: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 50) -> str:
        try:
            text = self.logfile.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


def pid_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie (Linux /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _free_ports(n: int) -> list[int]:
    """n distinct loopback ports that were free a moment ago."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# --------------------------------------------------------------------------- clusters


@dataclass(frozen=True)
class Cluster:
    """One simulated cluster (region): how to reach its apiserver as cluster-admin.

    `token` is a bearer token in group system:masters; keep it out of logs and assertion messages.
    """

    name: str
    server: str
    kubeconfig: Path
    ca_file: Path
    token: str = field(repr=False)

    def api(self, method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
        """One JSON request to the apiserver (stdlib only); raises urllib.error.HTTPError."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.server + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self.token}",
                "Content-Type": "application/json",
                "Accept": "application/json",
            },
        )
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
            return json.loads(resp.read() or b"null")

    def ready(self) -> bool:
        """True once GET /readyz answers 200 (all post-start hooks done)."""
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        with urllib.request.urlopen(self.server + "/readyz", context=ctx, timeout=5) as resp:
            return resp.status == 200

    def api_client(self) -> Any:
        """A `kubernetes.client.ApiClient` for this cluster (needs the `kubernetes` package)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))


def wait_until(
    what: str, probe: Callable[[], Any], timeout: float = 60.0, interval: float = 0.2
) -> Any:
    """Call probe() until it returns something truthy, and return that; TimeoutError after timeout.

    Exceptions from probe() count as "not yet" (the last one is chained to the TimeoutError), so
    a probe may simply read an object that does not exist yet.
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            if result := probe():
                return result
        except Exception as e:
            last = e
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}") from last
        time.sleep(interval)


def _wait(what: str, ready: Callable[[], bool], procs: Sequence[Proc], deadline: float) -> None:
    """Poll ready() until it is true; fail early, with its log, if one of procs exits."""
    while True:
        for p in procs:
            if not p.alive():
                raise RuntimeError(
                    f"k8senv: {p.name} exited with {p.popen.returncode} while "
                    f"waiting for {what}; last lines of {p.logfile}:\n{p.tail()}"
                )
        try:
            if ready():
                return
        except (OSError, urllib.error.URLError, ValueError):
            pass
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.logfile}\n{p.tail(20)}" for p in procs)
            raise TimeoutError(f"k8senv: timed out waiting for {what}\n{logs}")
        time.sleep(0.25)


def _openssl(*args: str | Path) -> None:
    if shutil.which("openssl") is None:
        raise RuntimeError(
            "k8senv needs the `openssl` command for its certificates (Debian: "
            "`apt-get install openssl`)"
        )
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _write_pki(pki: Path, extra_ips: Sequence[str] = ()) -> None:
    """A CA, one serving cert for every apiserver (127.0.0.1 and extra_ips: the real node's
    host address), and a service-account key."""
    pki.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req",
        "-x509",
        *ec,
        "-days",
        "3650",
        "-subj",
        "/CN=k8senv-ca",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout",
        pki / "ca.key",
        "-out",
        pki / "ca.crt",
    )
    _openssl(
        "req",
        *ec,
        "-subj",
        "/CN=kube-apiserver",
        "-keyout",
        pki / "apiserver.key",
        "-out",
        pki / "apiserver.csr",
    )
    (pki / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,"
        + "".join(f"IP:{ip}," for ip in extra_ips)
        + "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,"
        "DNS:kubernetes.default.svc.cluster.local\nextendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        pki / "apiserver.csr",
        "-CA",
        pki / "ca.crt",
        "-CAkey",
        pki / "ca.key",
        "-CAcreateserial",
        "-days",
        "3650",
        "-extfile",
        pki / "server.ext",
        "-out",
        pki / "apiserver.crt",
    )
    # RSA: the SA signing key (KCM signs service-account tokens with it as well).
    _openssl("genrsa", "-out", pki / "sa.key", "2048")


class ControlPlane:
    """One etcd and N clusters of kube-apiserver, KCM, kube-scheduler and kwok, as child processes.

    State: the child processes (`procs`), and per cluster a `Cluster` in `clusters` (same order as
    `names`; the first one is `home`). Everything lives under `run_dir`: pki/, etcd/, one folder
    of logs per cluster, and <cluster>.kubeconfig. start() raises (after stopping what it started)
    if a process exits or a readiness wait passes its deadline; stop() is idempotent.
    Use as a context manager, or call start() and stop().
    """

    def __init__(
        self,
        bindir: Path,
        run_dir: Path,
        names: Sequence[str] = DEFAULT_CLUSTERS,
        *,
        nodes_per_cluster: int = 2,
        real_node: bool = False,
        real_nodes: int = 0,
        link: str | None = None,
    ) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"names must be distinct and non-empty, got {list(names)}")
        for n in names:
            if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n):
                raise ValueError(f"cluster name {n!r} must be a DNS label")
        real_nodes = max(real_nodes, 1 if real_node else 0)
        if not 0 <= real_nodes <= len(names):
            raise ValueError(f"real_nodes must be in 0..{len(names)}, got {real_nodes}")
        if link is not None and real_nodes < 2:
            raise ValueError("a link joins regions with real nodes: needs real_nodes >= 2")
        if nodes_per_cluster < (0 if real_nodes else 1):
            raise ValueError(f"nodes_per_cluster must be >= 1, got {nodes_per_cluster}")
        self.bindir = Path(bindir)
        self.run_dir = Path(run_dir).resolve()
        self.names = list(names)
        self.nodes_per_cluster = nodes_per_cluster
        self.clusters: dict[str, Cluster] = {}
        self.procs: list[Proc] = []
        self._token = secrets.token_urlsafe(32)
        # real_node=True: one real node (realnode.py) joins the first cluster, whose apiserver
        # then listens on the node's host-side address instead of 127.0.0.1. real_nodes=n: the
        # first n clusters get one each (regions with real containers).
        self.real_nodes: dict[str, RealNode] = {
            name: _sibling("realnode").RealNode(
                self.bindir, self.run_dir / ("node" if i == 0 else f"node-{name}"), name
            )
            for i, name in enumerate(self.names[:real_nodes])
        }
        self.real_node: RealNode | None = self.real_nodes.get(self.names[0])
        # link="RATE,RTT": every other region with a real node reaches the home region only
        # over a shaped link of its own (wanlink.py); `links` by region name.
        self.link_spec = None if link is None else _sibling("wanlink").LinkSpec.parse(link)
        self.links: dict[str, RegionLink] = {}

    # -- public helpers

    @property
    def home(self) -> Cluster:
        return self.clusters[self.names[0]]

    def bin(self, name: str) -> Path:
        """Path of one built binary, e.g. plane.bin("helm")."""
        p = self.bindir / name
        if not p.is_file():
            raise FileNotFoundError(f"k8senv has no binary {name!r} in {self.bindir}")
        return p

    def env(self) -> dict[str, str]:
        """os.environ with the binaries first on PATH (kubectl, helm, ...)."""
        return {**os.environ, "PATH": f"{self.bindir}{os.pathsep}{os.environ.get('PATH', '')}"}

    def kubectl(
        self,
        cluster: str,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run our kubectl against one cluster; output captured as text."""
        argv = [
            str(self.bin("kubectl")),
            f"--kubeconfig={self.clusters[cluster].kubeconfig}",
            *args,
        ]
        return subprocess.run(
            argv, input=input, capture_output=True, text=True, check=check, timeout=timeout
        )

    def create_namespace(self, name: str, clusters: Sequence[str] | None = None) -> None:
        """Namespace `name` in `clusters` (the home cluster's by default), returned once each
        has its default ServiceAccount (kube-controller-manager makes it a moment later)."""
        for cluster in clusters or self.names[:1]:
            self.kubectl(cluster, "create", "namespace", name)
            wait_until(
                f"default ServiceAccount in {cluster}",
                lambda c=cluster: (
                    self.kubectl(c, "-n", name, "get", "sa", "default", check=False).returncode == 0
                ),
                timeout=30,
            )

    def import_image(self, archive: Path, cluster: str | None = None) -> list[str]:
        """Import an image archive (OCI or docker-archive tar) into a real node's containerd
        (the home cluster's, or `cluster`'s); returns the image names (pods must not pull:
        imagePullPolicy IfNotPresent or Never)."""
        node = self.real_nodes.get(cluster or self.names[0])
        if node is None:
            raise RuntimeError(f"import_image: no real node in {cluster or self.names[0]}")
        return node.import_image(archive)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def node_names(self, cluster: str) -> list[str]:
        return [f"{cluster}-gpu-{i}" for i in range(self.nodes_per_cluster)]

    def apiserver(self, cluster: str) -> Proc:
        """The kube-apiserver process of one cluster."""
        for p in self.procs:
            if p.name == "kube-apiserver" and p.logfile.parent.name == cluster:
                return p
        raise KeyError(f"k8senv has no kube-apiserver for cluster {cluster!r}")

    @contextlib.contextmanager
    def frozen(self, cluster: str) -> Iterator[None]:
        """Within the block, the cluster's kube-apiserver is stopped (SIGSTOP): its port still
        accepts TCP connections (the kernel queues them) but nothing answers, like a hung or
        black-holed apiserver. It is continued (SIGCONT) when the block ends, however it ends:
        the plane is shared by the whole session. Don't call that cluster inside the block
        without a timeout (the kubernetes client's default is none)."""
        proc = self.apiserver(cluster)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            _wait(
                f"{cluster} kube-apiserver /readyz after thawing",
                self.clusters[cluster].ready,
                [proc],
                time.monotonic() + 60,
            )

    # -- lifecycle

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        t0 = time.monotonic()
        try:
            self._start(deadline)
        except BaseException:
            self.stop()
            raise
        log.info("k8senv: %d cluster(s) ready in %.1fs", len(self.names), time.monotonic() - t0)

    def _start(self, deadline: float) -> None:
        run, pki = self.run_dir, self.run_dir / "pki"
        run.mkdir(parents=True, exist_ok=True)
        for rnode in self.real_nodes.values():
            rnode.create_network()  # before the apiserver, which binds node.host_ip
            self.procs += rnode.procs
        if self.link_spec is not None:
            wl = _sibling("wanlink")
            for name in self.names[1 : len(self.real_nodes)]:
                self.links[name] = wl.RegionLink(self.real_nodes[name], self.link_spec)
                self.links[name].create()
        _write_pki(pki, [n.host_ip for n in self.real_nodes.values()])
        for rnode in self.real_nodes.values():
            rnode.write_certs(pki)
        tokens = run / "tokens.csv"
        tokens.write_text(f'{self._token},admin,admin-uid,"system:masters"\n')
        tokens.chmod(0o600)
        etcd_port, peer_port, *api_ports = _free_ports(2 + len(self.names))

        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        etcd = self._spawn(
            "etcd",
            run / "etcd.log",
            [
                self.bin("etcd"),
                "--name=k8senv",
                f"--data-dir={run / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=k8senv={peer_url}",
                "--unsafe-no-fsync=true",
                "--auto-compaction-retention=1",
                "--quota-backend-bytes=2147483648",
                "--log-level=warn",
            ],
        )
        _wait("etcd /health", lambda: _get_ok(f"{etcd_url}/health"), [etcd], deadline)

        apiservers = []
        for name, port in zip(self.names, api_ports, strict=True):
            rnode = self.real_nodes.get(name)
            addr = rnode.host_ip if rnode is not None else "127.0.0.1"
            server = f"https://{addr}:{port}"
            self.clusters[name] = Cluster(
                name, server, run / f"{name}.kubeconfig", pki / "ca.crt", self._token
            )
            self._write_kubeconfig(self.clusters[name])
            apiservers.append(
                self._spawn(
                    "kube-apiserver",
                    run / name / "kube-apiserver.log",
                    [
                        self.bin("kube-apiserver"),
                        f"--etcd-servers={etcd_url}",
                        f"--etcd-prefix=/{name}/registry",
                        f"--bind-address={addr}",
                        f"--advertise-address={addr}",
                        f"--secure-port={port}",
                        f"--cert-dir={run / name / 'certs'}",
                        f"--tls-cert-file={pki / 'apiserver.crt'}",
                        f"--tls-private-key-file={pki / 'apiserver.key'}",
                        f"--client-ca-file={pki / 'ca.crt'}",
                        f"--token-auth-file={tokens}",
                        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                        f"--service-account-key-file={pki / 'sa.key'}",
                        f"--service-account-signing-key-file={pki / 'sa.key'}",
                        f"--service-cluster-ip-range={SERVICE_CIDR}",
                        "--authorization-mode=Node,RBAC",
                        "--endpoint-reconciler-type=none",
                        "--allow-privileged=true",
                        "--profiling=false",
                        "--default-not-ready-toleration-seconds=10",
                        "--default-unreachable-toleration-seconds=10",
                        # later flags win: the real node's replace --endpoint-reconciler-type
                        *(rnode.apiserver_flags(pki) if rnode is not None else []),
                    ],
                )
            )
        for cl, proc in zip(self.clusters.values(), apiservers, strict=True):
            _wait(f"{cl.name} kube-apiserver /readyz", cl.ready, [etcd, proc], deadline)

        for cl in self.clusters.values():
            kcfg = f"--kubeconfig={cl.kubeconfig}"
            logs = run / cl.name
            self._spawn(
                "kube-controller-manager",
                logs / "kube-controller-manager.log",
                [
                    self.bin("kube-controller-manager"),
                    kcfg,
                    "--leader-elect=false",
                    f"--service-account-private-key-file={pki / 'sa.key'}",
                    f"--root-ca-file={pki / 'ca.crt'}",
                    f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                    f"--cluster-signing-key-file={pki / 'ca.key'}",
                    "--bind-address=127.0.0.1",
                    "--secure-port=0",
                ],
            )
            self._spawn(
                "kube-scheduler",
                logs / "kube-scheduler.log",
                [
                    self.bin("kube-scheduler"),
                    kcfg,
                    "--leader-elect=false",
                    "--bind-address=127.0.0.1",
                    "--secure-port=0",
                ],
            )
            if self.nodes_per_cluster == 0:
                continue  # no fake nodes: no kwok
            self._spawn(
                "kwok",
                logs / "kwok.log",
                [
                    self.bin("kwok"),
                    kcfg,
                    f"--config={self.bindir / 'kwok-stages.yaml'}",
                    "--manage-all-nodes=false",
                    "--manage-nodes-with-annotation-selector=" + "=".join(FAKE_NODE_ANNOTATION),
                    "--node-lease-duration-seconds=40",
                    f"--cidr={POD_CIDR}",
                    "--node-ip=10.0.0.1",
                ],
            )
            for node in self.node_names(cl.name):
                cl.api("POST", "/api/v1/nodes", self._node_manifest(cl.name, node))

        for cl in self.clusters.values():
            _wait(
                f"{cl.name}: {self.nodes_per_cluster} fake node(s) Ready",
                lambda cl=cl: self._nodes_ready(cl),
                self.procs,
                deadline,
            )
            _wait(
                f"{cl.name}: ServiceAccount default/default (kube-controller-manager)",
                lambda cl=cl: bool(
                    cl.api("GET", "/api/v1/namespaces/default/serviceaccounts/default")
                ),
                self.procs,
                deadline,
            )
        for name, rnode in self.real_nodes.items():
            self.procs += rnode.start(self.clusters[name], pki, deadline)

    def stop(self) -> None:
        """Stop everything in reverse order: SIGTERM, then SIGKILL after a grace period."""
        tiers: list[list[Proc]] = [
            [
                p
                for p in self.procs
                if p.name in ("kwok", "kube-scheduler", "kube-controller-manager")
            ],
            [p for p in self.procs if p.name == "kube-apiserver"],
            [p for p in self.procs if p.name == "etcd"],
        ]
        for link in self.links.values():
            link.close()
        for rnode in self.real_nodes.values():
            rnode.stop_clients()  # or the apiserver's shutdown waits on their streams
        for i, tier in enumerate(tiers):
            if i == 2:
                # After the apiservers (whose shutdown talks to itself on the node's host
                # address, which goes with the node): the whole node at once.
                for rnode in self.real_nodes.values():
                    rnode.stop()
            for p in tier:
                if p.alive():
                    p.popen.send_signal(signal.SIGTERM)
            end = time.monotonic() + STOP_GRACE_S
            for p in tier:
                try:
                    p.popen.wait(timeout=max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("k8senv: %s (pid %d) ignored SIGTERM, killing it", p.name, p.pid)
                    p.popen.kill()
                    p.popen.wait()

    # -- internals

    def _spawn(self, name: str, logfile: Path, argv: Sequence[str | Path]) -> Proc:
        proc = Proc(name, spawn(argv, logfile), logfile)
        self.procs.append(proc)
        return proc

    def _write_kubeconfig(self, cl: Cluster) -> None:
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "preferences": {},
            "clusters": [
                {
                    "name": cl.name,
                    "cluster": {"server": cl.server, "certificate-authority": str(cl.ca_file)},
                }
            ],
            "users": [{"name": f"{cl.name}-admin", "user": {"token": cl.token}}],
            "contexts": [
                {
                    "name": cl.name,
                    "context": {
                        "cluster": cl.name,
                        "user": f"{cl.name}-admin",
                        "namespace": "default",
                    },
                }
            ],
            "current-context": cl.name,
        }
        # JSON is YAML; written 0600 because it holds the token.
        fd = os.open(cl.kubeconfig, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(cfg, f, indent=2)

    def _node_manifest(self, cluster: str, node: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node,
                "annotations": {
                    FAKE_NODE_ANNOTATION[0]: FAKE_NODE_ANNOTATION[1],
                    "node.alpha.kubernetes.io/ttl": "0",
                },
                "labels": {
                    "type": "kwok",
                    "kubernetes.io/hostname": node,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "node.kubernetes.io/instance-type": "kwok-gpu-8",
                    "topology.kubernetes.io/region": cluster,
                    "topology.kubernetes.io/zone": f"{cluster}-1",
                    "nvidia.com/gpu.present": "true",
                },
            },
            "status": {"capacity": FAKE_NODE_CAPACITY, "allocatable": FAKE_NODE_CAPACITY},
        }

    def _nodes_ready(self, cl: Cluster) -> bool:
        nodes = cl.api("GET", "/api/v1/nodes?labelSelector=type%3Dkwok")["items"]
        ready = [
            n
            for n in nodes
            for c in n.get("status", {}).get("conditions") or []
            if c["type"] == "Ready" and c["status"] == "True"
        ]
        return len(ready) == self.nodes_per_cluster


def _get_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status == 200


# --------------------------------------------------------------------------- command line


def _cmd_build(_: argparse.Namespace) -> int:
    t0 = time.monotonic()
    try:
        bindir = build(echo=sys.stdout)
    except (ToolchainMissing, BuildFailed) as e:
        print(f"k8senv: {e}", file=sys.stderr)
        return 1
    manifest = (
        json.loads((bindir / "MANIFEST.json").read_text())
        if (bindir / "MANIFEST.json").is_file()
        else {}
    )
    print(
        f"k8senv: binaries in {bindir} (this run {time.monotonic() - t0:.0f}s; "
        f"build took {manifest.get('build_seconds', '?')}s)"
    )
    return 0


def _cmd_key(_: argparse.Namespace) -> int:
    print(f"{version_key()} {cache_root() / version_key()}")
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    bindir = find_built()
    if bindir is None:
        print(missing_message(), file=sys.stderr)
        return 1
    clusters = args.regions or args.clusters
    names = list(DEFAULT_CLUSTERS[:clusters])
    names += [f"region-{chr(ord('a') + i - 1)}" for i in range(len(names), clusters)]
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="k8senv-"))

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    real = args.regions or int(args.real_node)
    nodes = args.nodes if args.nodes is not None else (0 if real else 2)
    plane = ControlPlane(
        bindir, run_dir, names, nodes_per_cluster=nodes, real_nodes=real, link=args.link
    )
    t0 = time.monotonic()
    kq: Any = None  # Kueue (kueueenv.py), with --kueue
    try:
        plane.start()
        if args.kueue:
            kq = _sibling("kueueenv").start_on(plane, run_dir / "kueue")
        print(
            f"k8senv: {len(names)} cluster(s) ready in {time.monotonic() - t0:.1f}s "
            f"(Kubernetes {KUBE_VERSION}); logs under {run_dir}",
            flush=True,
        )
        for cl in plane.clusters.values():
            print(f"  {cl.name:10} {cl.server}  KUBECONFIG={cl.kubeconfig}", flush=True)
        for region, rn in plane.real_nodes.items():
            print(
                f"  real node  {rn.name} ({rn.node_ip}, pods {rn.pod_cidr}) in "
                f"{region}; logs {rn.run_dir}; inside it: nsenter --target "
                f"{rn.holder_pid} --pid --mount --net",
                flush=True,
            )
        home_ip = plane.real_node.node_ip if plane.real_node is not None else ""
        for region, link in plane.links.items():
            print(f"  link       {region} -> home: {link.spec}, home side {link.host_ip}")
            for port, node_port in args.forward:
                addr = link.expose(port, home_ip, node_port)
                print(f"    {region}'s pods reach {home_ip}:{node_port} at {addr}", flush=True)
        if kq is not None:
            print(f"  kueue      in {names[0]}; log {kq.log}", flush=True)
        print(f"  binaries: export PATH={bindir}:$PATH", flush=True)
        print("k8senv: ready; Ctrl-C stops everything", flush=True)
        while True:
            if kq is not None and not kq.alive():
                print(f"k8senv: kueue exited; see {kq.log}", file=sys.stderr)
                return 1
            for p in plane.procs:
                if not p.alive():
                    print(
                        f"k8senv: {p.name} exited ({p.popen.returncode}); see {p.logfile}",
                        file=sys.stderr,
                    )
                    return 1
            time.sleep(1)
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not abort the stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if kq is not None:
            kq.stop()
        plane.stop()
        if not args.keep and not args.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        print("k8senv: stopped", flush=True)


def _port_pair(text: str) -> tuple[int, int]:
    """`PORT:NODEPORT` -> (PORT, NODEPORT)."""
    port, _, node_port = text.partition(":")
    if not (port.isdigit() and node_port.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected PORT:NODEPORT, e.g. 8470:30470")
    return int(port), int(node_port)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(prog="k8senv.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build the binaries into the cache (once per machine)")
    sub.add_parser("key", help="print the version key and the cache directory")
    up = sub.add_parser("up", help="start a control plane until Ctrl-C")
    up.add_argument("--clusters", type=int, default=3, help="number of clusters (default 3)")
    up.add_argument(
        "--nodes", type=int, help="fake GPU nodes per cluster (default 2; 0 with --real-node)"
    )
    up.add_argument(
        "--real-node",
        action="store_true",
        help="join one real node (kubelet, containerd, kube-proxy, CoreDNS) to the first cluster",
    )
    up.add_argument(
        "--regions",
        type=int,
        help="N clusters with a real node each (home, region-a, ...; overrides --clusters)",
    )
    up.add_argument(
        "--link",
        help="RATE,RTT, e.g. 50mbit,40ms: the other regions reach home only over a link with "
        "this rate each way (tbf) and round trip (a delaying relay); needs --regions >= 2",
    )
    up.add_argument(
        "--forward",
        type=_port_pair,
        action="append",
        default=[],
        metavar="PORT:NODEPORT",
        help="relay PORT on each link's home side to the home node's NODEPORT (repeatable)",
    )
    up.add_argument(
        "--kueue",
        action="store_true",
        help="run Kueue's controller manager in the first cluster (kueueenv.py build first)",
    )
    up.add_argument("--run-dir", help="where logs, PKI and kubeconfigs go (default: a temp dir)")
    up.add_argument("--keep", action="store_true", help="keep the temp run dir after stopping")
    args = parser.parse_args(argv)
    if getattr(args, "clusters", 1) < 1:
        parser.error("--clusters must be >= 1")
    if getattr(args, "link", None) and (args.regions or 0) < 2:
        parser.error("--link needs --regions >= 2")
    return {"build": _cmd_build, "key": _cmd_key, "up": _cmd_up}[args.cmd](args)


@contextlib.contextmanager
def running(
    names: Sequence[str] = DEFAULT_CLUSTERS, run_dir: Path | None = None
) -> Iterator[ControlPlane]:
    """A started ControlPlane for scripts: `with k8senv.running() as plane: ...`."""
    bindir = ensure_built()
    with (
        tempfile.TemporaryDirectory(prefix="k8senv-") as tmp,
        ControlPlane(bindir, run_dir or Path(tmp), names) as plane,
    ):
        yield plane


def _sibling(name: str) -> Any:
    """A module beside this file (realnode.py, wanlink.py), loaded by path once."""
    if (mod := sys.modules.get(name)) is None:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        mod = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    sys.modules.setdefault("k8senv", sys.modules[__name__])  # realnode's `import k8senv`
    sys.exit(main())
