"""kueueenv: Kueue's real controller manager next to a k8senv cluster, built from its Go module.

    python tests/integration/kueueenv.py build     # once per machine (tests/run.sh does it)
    python tests/integration/kueueenv.py key       # cache key and directory (for CI caches)
    python tests/integration/k8senv.py up --kueue  # a control plane with Kueue in its home cluster

The binary, Kueue's CRDs and its webhook configurations (tests/kueue/build.sh copies the last
two from the same module) live in ~/.cache/ddiloco/kueue/<key>/ (XDG_CACHE_HOME is honoured);
the key hashes tests/kueue/'s go.mod, go.sum and build.sh, so a version bump rebuilds, and it is
apart from k8senv's key, so Kueue never rebuilds the control plane. DDILOCO_KUEUE_BIN=<dir>
uses a prebuilt directory instead.

    kq = start_on(plane, run_dir)   # CRDs, webhooks, the manager; once its webhooks answer
    kq.stop()

Kueue serves its webhooks on 127.0.0.1 and the apiserver calls them there: the webhook
configurations and the CRDs' conversion webhooks name `https://127.0.0.1:<port>/...` URLs.
Kueue's internal certificate management stays on (its CA bundle injection is what it runs
with in production), seeded with a Secret made here whose serving certificate names both the
webhook Service's DNS name, which Kueue checks, and 127.0.0.1, which the apiserver dials; Kueue
keeps a valid certificate it finds and writes it into its certificate directory's place.
Standard library only (openssl for the certificates, as k8senv).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from k8senv import ControlPlane, Proc

log = logging.getLogger("kueueenv")

KUEUE_DIR: Final = Path(__file__).resolve().parents[1] / "kueue"
BUILD_SH: Final = KUEUE_DIR / "build.sh"
BUILD_COMMAND: Final = "python tests/integration/kueueenv.py build"
FILES: Final = ("kueue", "crds.yaml", "webhooks.yaml")
NAMESPACE: Final = "kueue-system"
WEBHOOK_SERVICE: Final = "kueue-webhook-service"
WEBHOOK_SECRET: Final = "kueue-webhook-server-cert"
CA_NAME: Final = "kueue-ca"  # the CA's name Kueue's certificate check expects
# CRDs whose versions Kueue converts (its config/components/crd/patches/webhook_in_*.yaml).
CONVERTED: Final = (
    "localqueues.kueue.x-k8s.io",
    "clusterqueues.kueue.x-k8s.io",
    "workloads.kueue.x-k8s.io",
    "cohorts.kueue.x-k8s.io",
    "multikueueclusters.kueue.x-k8s.io",
)
START_TIMEOUT_S: Final = 180.0  # its CRDs are 1.6 MB: a busy apiserver takes a while
PRUNE_AFTER_S: Final = 30 * 24 * 3600


def _k8senv() -> Any:
    """The k8senv module (beside this file), by path, once."""
    if (mod := sys.modules.get("k8senv")) is None:
        spec = importlib.util.spec_from_file_location(
            "k8senv", Path(__file__).with_name("k8senv.py")
        )
        assert spec is not None and spec.loader is not None
        mod = sys.modules["k8senv"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod


def kueue_version() -> str:
    """The Kueue version build.sh pins (its KUEUE_VERSION line), e.g. 'v0.17.0'."""
    m = re.search(r"^KUEUE_VERSION=(v\S+)", BUILD_SH.read_text(), re.MULTILINE)
    assert m, f"no KUEUE_VERSION= line in {BUILD_SH}"
    return m.group(1)


class BuildFailed(RuntimeError):
    """build.sh ran and failed, or the toolchain is missing; the message says which."""


# --------------------------------------------------------------------------- build and cache


def version_key() -> str:
    """16 hex digits over tests/kueue's go.mod, go.sum and build.sh (paths and bytes)."""
    h = hashlib.sha256()
    for p in sorted(q for q in KUEUE_DIR.iterdir() if q.suffix in {".mod", ".sum", ".sh"}):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ddiloco" / "kueue"


def _is_complete(d: Path) -> bool:
    return (d / "MANIFEST.json").is_file() and all((d / f).is_file() for f in FILES)


def find_built() -> Path | None:
    """The directory holding the built binary and manifests, or None if not built for this key."""
    if prebuilt := os.environ.get("DDILOCO_KUEUE_BIN"):
        d = Path(prebuilt)
        if missing := [f for f in FILES if not (d / f).is_file()]:
            raise BuildFailed(f"DDILOCO_KUEUE_BIN={d} lacks {', '.join(missing)}")
        return d
    final = cache_root() / version_key()
    if _is_complete(final):
        with contextlib.suppress(OSError):
            os.utime(final)  # marks it used, for pruning
        return final
    return None


def missing_message() -> str:
    msg = f"Kueue is not built (key {version_key()}): run `{BUILD_COMMAND}`"
    if problem := _k8senv().go_problem():
        msg += f" - it needs Go and the Go module proxy ({problem})"
    return msg


def build(echo: IO[str] | None = None) -> Path:
    """Build for the current key unless another run already did; return the directory.

    One builder per machine (a lock); the build goes into a temporary directory renamed into
    place after MANIFEST.json is written, so an interrupted build never looks complete.
    """
    if (done := find_built()) is not None:
        return done
    root, key = cache_root(), version_key()
    root.mkdir(parents=True, exist_ok=True)
    final, tmp, logfile = root / key, root / f".{key}.{os.getpid()}", root / f"{key}.build.log"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(final):
            return final
        if problem := _k8senv().go_problem():
            raise BuildFailed(f"cannot build Kueue: {problem}; need Go and the Go module proxy")
        shutil.rmtree(tmp, ignore_errors=True)
        rc, seconds = _k8senv().run_build_script(BUILD_SH, tmp, logfile, echo)
        if rc != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise BuildFailed(f"Kueue build failed (rc={rc}) after {seconds:.0f}s; see {logfile}")
        go = subprocess.run(["go", "version"], capture_output=True, text=True).stdout.strip()
        manifest = {
            "key": key,
            "kueue_version": kueue_version(),
            "go": go,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(seconds),
        }
        (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        now = time.time()
        for d in root.iterdir():
            if d.is_dir() and d.name != key and now - d.stat().st_mtime > PRUNE_AFTER_S:
                shutil.rmtree(d, ignore_errors=True)
    log.info("Kueue built in %.0fs into %s", seconds, final)
    return final


# --------------------------------------------------------------------------- running it


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _write_certs(pki: Path) -> None:
    """A CA named as Kueue expects and a serving certificate for the webhook Service's DNS name
    (what Kueue validates) and 127.0.0.1 (what the apiserver dials). RSA keys in PKCS#1 form:
    the only form Kueue's certificate rotator parses a CA key in."""
    k8senv = _k8senv()
    pki.mkdir(parents=True, exist_ok=True)
    for key in ("ca.key", "tls.key"):
        k8senv._openssl("genrsa", "-traditional", "-out", pki / key, "2048")
    k8senv._openssl(
        "req", "-x509", "-new", "-key", pki / "ca.key", "-days", "3650",
        "-subj", f"/O=kueue/CN={CA_NAME}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        "-addext", f"subjectAltName=DNS:{CA_NAME}",
        "-out", pki / "ca.crt",
    )  # fmt: skip
    k8senv._openssl(
        "req", "-new", "-key", pki / "tls.key", "-subj", f"/CN={WEBHOOK_SERVICE}.{NAMESPACE}.svc",
        "-out", pki / "tls.csr",
    )  # fmt: skip
    (pki / "tls.ext").write_text(
        f"subjectAltName=DNS:{WEBHOOK_SERVICE}.{NAMESPACE}.svc,IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    )
    k8senv._openssl(
        "x509", "-req", "-in", pki / "tls.csr", "-CA", pki / "ca.crt", "-CAkey", pki / "ca.key",
        "-CAcreateserial", "-days", "3650", "-extfile", pki / "tls.ext", "-out", pki / "tls.crt",
    )  # fmt: skip


def _yaml_docs(text: str) -> list[dict[str, Any]]:
    import yaml  # the venv's PyYAML: only starting Kueue needs it, never the build

    return [d for d in yaml.safe_load_all(text) if d]


class Kueue:
    """Kueue's controller manager as a child process, serving one cluster of a ControlPlane.

    start() installs Kueue's CRDs (their conversion webhooks pointed at the manager), its
    namespace and webhook Secret, the webhook configurations of Kueue's own resources (Kueue
    admits Workloads the operator makes: no batch/v1 Job or Pod webhooks are registered), then
    starts the manager and waits until a dry-run ResourceFlavor passes its webhooks.
    """

    def __init__(self, bindir: Path, plane: ControlPlane, cluster: str, run_dir: Path) -> None:
        self.bindir = Path(bindir)
        self.plane = plane
        self.cluster = cluster
        self.run_dir = Path(run_dir).resolve()
        self.proc: Proc | None = None
        self.webhook_port = 0
        self.health_port = 0

    @property
    def log(self) -> Path:
        return self.run_dir / "kueue.log"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def tail(self, lines: int = 50) -> str:
        return self.proc.tail(lines) if self.proc is not None else ""

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        try:
            self._start(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, deadline: float) -> None:
        k8senv = _k8senv()
        cl = self.plane.clusters[self.cluster]
        run, pki = self.run_dir, self.run_dir / "pki"
        run.mkdir(parents=True, exist_ok=True)
        self.webhook_port, self.health_port = k8senv._free_ports(2)
        _write_certs(pki)
        ca = (pki / "ca.crt").read_bytes()
        base = f"https://127.0.0.1:{self.webhook_port}"

        crds = _yaml_docs((self.bindir / "crds.yaml").read_text())
        for crd in crds:
            if crd["metadata"]["name"] in CONVERTED:
                crd["spec"]["conversion"] = {
                    "strategy": "Webhook",
                    "webhook": {
                        "clientConfig": {"url": f"{base}/convert", "caBundle": _b64(ca)},
                        "conversionReviewVersions": ["v1"],
                    },
                }
        hooks = []
        for cfg in _yaml_docs((self.bindir / "webhooks.yaml").read_text()):
            kind = "mutating" if cfg["kind"].startswith("Mutating") else "validating"
            cfg["metadata"] = {"name": f"kueue-{kind}-webhook-configuration"}
            cfg["webhooks"] = [
                {
                    **w,
                    "clientConfig": {
                        "url": base + w["clientConfig"]["service"]["path"],
                        "caBundle": _b64(ca),
                    },
                }
                for w in cfg["webhooks"]
                if "-kueue-x-k8s-io-" in w["clientConfig"]["service"]["path"]
            ]
            hooks.append(cfg)
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": WEBHOOK_SECRET, "namespace": NAMESPACE},
            "data": {
                name: _b64((pki / name).read_bytes())
                for name in ("ca.crt", "ca.key", "tls.crt", "tls.key")
            },
        }
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        docs = [namespace, *crds]
        # CRDs are too large for client-side apply's last-applied annotation.
        self.plane.kubectl(
            self.cluster, "apply", "--server-side", "--force-conflicts", "-f", "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}),
        )  # fmt: skip
        self.plane.kubectl(
            self.cluster, "wait", "--for=condition=Established", "--timeout=60s",
            *[f"crd/{c['metadata']['name']}" for c in crds],
        )  # fmt: skip
        self.plane.kubectl(
            self.cluster, "apply", "--server-side", "--force-conflicts", "-f", "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [secret, *hooks]}),
        )  # fmt: skip

        certs = run / "certs"  # Kueue's certificate directory: seeded like the Secret
        certs.mkdir(exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            shutil.copyfile(pki / name, certs / name)
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"host": "127.0.0.1", "port": self.webhook_port, "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {
                "enable": True,
                "webhookServiceName": WEBHOOK_SERVICE,
                "webhookSecretName": WEBHOOK_SECRET,
            },
            "integrations": {"frameworks": ["batch/job"]},
            # The visibility API would be an aggregated apiserver on a fixed port; not needed.
            # Workload slices (alpha): a partially admitted job grows when quota frees.
            "featureGates": {"VisibilityOnDemand": False, "ElasticJobsViaWorkloadSlices": True},
        }
        (run / "config.yaml").write_text(json.dumps(config, indent=2) + "\n")
        env = {**os.environ, "KUBECONFIG": str(cl.kubeconfig)}
        popen = k8senv.spawn(
            [self.bindir / "kueue", f"--config={run / 'config.yaml'}", "--zap-log-level=2"],
            self.log,
            env=env,
        )
        self.proc = k8senv.Proc("kueue", popen, self.log)
        k8senv._wait(
            "Kueue /readyz",
            lambda: _get_ok(f"http://127.0.0.1:{self.health_port}/readyz"),
            [self.proc],
            deadline,
        )
        probe = {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": "kueueenv-probe"},
        }
        k8senv._wait(
            "Kueue's webhooks",
            lambda: bool(
                cl.api("POST", "/apis/kueue.x-k8s.io/v1beta2/resourceflavors?dryRun=All", probe)
            ),
            [self.proc],
            deadline,
        )

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; idempotent. Leaves the CRDs installed."""
        p = self.proc
        if p is None or not p.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.popen.wait(timeout=10)


def start_on(plane: ControlPlane, run_dir: Path, cluster: str | None = None) -> Kueue:
    """A started Kueue in one cluster of a started plane (default: its first, home); raises
    BuildFailed naming the build command when Kueue is not built."""
    bindir = find_built()
    if bindir is None:
        raise BuildFailed(missing_message())
    kq = Kueue(bindir, plane, cluster or plane.names[0], run_dir)
    kq.start()
    return kq


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except urllib.error.HTTPError:
        return False


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(prog="kueueenv.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build Kueue into the cache (once per machine)")
    sub.add_parser("key", help="print the version key and the cache directory")
    args = parser.parse_args(argv)
    if args.cmd == "key":
        print(f"{version_key()} {cache_root() / version_key()}")
        return 0
    t0 = time.monotonic()
    try:
        d = build(echo=sys.stdout)
    except BuildFailed as e:
        print(f"kueueenv: {e}", file=sys.stderr)
        return 1
    manifest = json.loads((d / "MANIFEST.json").read_text())
    print(
        f"kueueenv: Kueue {manifest.get('kueue_version')} in {d} (this run "
        f"{time.monotonic() - t0:.0f}s; build took {manifest.get('build_seconds', '?')}s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
