"""realnode: one real Kubernetes node joined to a k8senv cluster, so that pods run real containers.

The node is kubelet + containerd (+ containerd-shim-runc-v2, Debian's runc) + kube-proxy (iptables)
+ CoreDNS, all built by tests/k8senv/build.sh, running as root inside namespaces of their own:

* a holder process (our pause program under `unshare --pid --fork --kill-child --mount
  --mount-proc --net`) owns a new PID, mount and network namespace; every node process is started
  in them with `nsenter --target <holder> --pid --mount --net` (not `ip netns exec`, which remounts
  /sys and hides the cgroup mounts). When the holder dies, the kernel kills everything in its PID
  namespace (kubelet, containerd, shims, containers); the mount namespace (tmpfs on /run and
  /var/lib/kubelet, pod volume and rootfs mounts) and the network namespace (pod netns, iptables
  rules, the veth pair, the host route) go with it. The launcher holds `unshare` with
  PR_SET_PDEATHSIG, so even `kill -9` of pytest leaves no process, mount, netns or link behind.
  Only empty cgroup directories (`/sys/fs/cgroup/*/ddk-node-<pid>-<cluster>`) survive a crash; the next
  start removes those of dead pids.
* networking: a veth pair, host end 10.213.<slot>.1/30, node end 10.213.<slot>.2/30; the apiserver
  of the node's cluster binds the host end (k8senv.ControlPlane does that when real_node=True).
  Pods get 10.214.<slot>.0/24 on a CNI bridge inside the node netns (Debian's bridge, host-local,
  portmap and loopback plugins); the host has a route to it over the veth. The node netns has no
  default route, so nothing leaves the machine. Services: kube-proxy in iptables mode with
  masqueradeAll; CoreDNS (kubernetes plugin, cluster.local) listens on the node address and
  backs the selector-less Service kube-system/kube-dns at 10.96.0.10, the kubelet's clusterDNS.
* storage: a default StorageClass `standard` and a tiny provisioner thread that gives every
  pending claim of that class a hostPath PersistentVolume (a 0777 directory under the run dir,
  pinned to this node) and deletes released ones with their directory.

Used through k8senv (`ControlPlane(..., nodes_per_cluster=0, real_node=True)`,
`python tests/integration/k8senv.py up --real-node`); tests/k8senv/README.md has the recipe and
the figures. Linux, root, cgroup v1 or hybrid, and the commands unshare, nsenter, ip, iptables,
mount; runc at /usr/sbin/runc; CNI plugins in /usr/lib/cni.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tarfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import k8senv

log = logging.getLogger("k8senv.realnode")

PAUSE_IMAGE: Final = "ddiloco.local/k8senv/pause:v1"  # = PAUSE_IMAGE in tests/k8senv/build.sh
PROBE_IMAGE: Final = "ddiloco.local/k8senv/probe:v1"  # = PROBE_IMAGE in tests/k8senv/build.sh
NODE_LABEL: Final = ("ddiloco.dev/real-node", "true")
RUNC: Final = "/usr/sbin/runc"
CNI_BIN_DIR: Final = "/usr/lib/cni"
CNI_PLUGINS: Final = ("bridge", "host-local", "loopback", "portmap")
COMMANDS: Final = ("unshare", "nsenter", "ip", "iptables", "iptables-save", "mount", "sysctl")
CLUSTER_DNS_IP: Final = "10.96.0.10"  # inside k8senv.SERVICE_CIDR
CLUSTER_DOMAIN: Final = "cluster.local"
STORAGE_CLASS: Final = "standard"
PROVISIONER: Final = "ddiloco.dev/hostpath"
PV_LABEL: Final = ("ddiloco.dev/provisioner", "hostpath")
CGROUP_PREFIX: Final = "ddk-node-"
CGROUP_FS: Final = Path("/sys/fs/cgroup")
HOST_LINK_PREFIX: Final = "ddkh"
SLOT_LOCK: Final = Path("/run/lock/ddiloco-realnode.lock")
NODE_READY_TIMEOUT_S: Final = 120.0
CTR_SOCKET: Final = "/run/containerd/containerd.sock"  # inside the node's mount namespace


@dataclass(frozen=True)
class Slot:
    """The node's addresses: slot k owns 10.213.k.0/30 (veth) and 10.214.k.0/24 (pods)."""

    index: int

    @property
    def host_ip(self) -> str:
        return f"10.213.{self.index}.1"

    @property
    def node_ip(self) -> str:
        return f"10.213.{self.index}.2"

    @property
    def pod_cidr(self) -> str:
        return f"10.214.{self.index}.0/24"

    @property
    def host_link(self) -> str:
        return f"{HOST_LINK_PREFIX}{self.index}"


def problems() -> list[str]:
    """What this machine lacks for a real node (empty when it can run one)."""
    out = []
    if os.geteuid() != 0:
        out.append("must run as root (namespaces, mounts, cgroups, iptables)")
    out += [f"no `{c}` command" for c in COMMANDS if shutil.which(c) is None]
    if not os.access(RUNC, os.X_OK):
        out.append(f"no runc at {RUNC} (Debian: apt-get install runc)")
    out += [
        f"no CNI plugin {CNI_BIN_DIR}/{p} (Debian: apt-get install containernetworking-plugins)"
        for p in CNI_PLUGINS
        if not os.access(f"{CNI_BIN_DIR}/{p}", os.X_OK)
    ]
    if not (CGROUP_FS / "memory").is_dir():
        out.append(f"no cgroup v1 memory hierarchy under {CGROUP_FS} (this setup is cgroup v1)")
    return out


def _run(*argv: str | Path, input: str | None = None, timeout: float = 60) -> str:
    """Run a command; return its stdout; raise with its stderr when it fails."""
    p = subprocess.run(
        [str(a) for a in argv], input=input, capture_output=True, text=True, timeout=timeout
    )
    if p.returncode != 0:
        raise RuntimeError(
            f"realnode: `{' '.join(map(str, argv))}` failed ({p.returncode}): "
            f"{p.stderr.strip() or p.stdout.strip()}"
        )
    return p.stdout


def _cgroup_controllers() -> list[Path]:
    """Every cgroup hierarchy root: v1 (cpu, memory, ..., systemd) and the hybrid's unified one
    (runc creates the containers' cgroups there too)."""
    return sorted(d for d in CGROUP_FS.iterdir() if d.is_dir() and not d.is_symlink())


def _rmdir_tree(root: Path) -> bool:
    """rmdir a cgroup directory bottom-up; True if it is gone."""
    if not root.exists():
        return True
    for dirpath, _dirs, _files in os.walk(root, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
    return not root.exists()


def cleanup_stale() -> list[str]:
    """Remove what dead runs left: cgroup directories of dead launcher pids. Returns them.

    Processes, mounts, network namespaces, links and routes die with a node's holder process, so
    cgroups (empty directories the kernel cannot remove by itself) are all that a crash leaves.
    """
    removed = []
    for ctrl in _cgroup_controllers():
        for d in ctrl.glob(f"{CGROUP_PREFIX}*"):
            pid = d.name.removeprefix(CGROUP_PREFIX).split("-")[0]  # ddk-node-<pid>-<cluster>
            if pid.isdigit() and not k8senv.pid_alive(int(pid)) and _rmdir_tree(d):
                removed.append(str(d))
    return removed


def normalize_image_name(name: str) -> str:
    """A reference as containerd stores it: `busybox:1` -> `docker.io/library/busybox:1`."""
    first, _, rest = name.partition("/")
    if not rest:
        return f"docker.io/library/{name}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{name}"
    return name


def archive_names(archive: Path) -> list[str]:
    """The image names an archive holds: RepoTags of a docker-archive (`podman save`), or the
    io.containerd.image.name / ref.name annotations of an OCI layout tar; normalized."""
    with tarfile.open(archive) as tar:
        members = {m.name.removeprefix("./"): m for m in tar}
        if "manifest.json" in members:
            f = tar.extractfile(members["manifest.json"])
            assert f is not None
            names = [t for entry in json.load(f) for t in entry.get("RepoTags") or []]
        elif "index.json" in members:
            f = tar.extractfile(members["index.json"])
            assert f is not None
            names = []
            for m in json.load(f).get("manifests") or []:
                ann = m.get("annotations") or {}
                ref = ann.get("io.containerd.image.name") or ann.get(
                    "org.opencontainers.image.ref.name", ""
                )
                if "/" in ref or ":" in ref:
                    names.append(ref)
        else:
            raise ValueError(f"{archive}: neither a docker-archive nor an OCI layout tar")
    if not names:
        raise ValueError(f"{archive}: no image names in it (tag the image before saving)")
    return [normalize_image_name(n) for n in names]


def _used_slots() -> set[int]:
    out = _run("ip", "-4", "-o", "addr", "show")
    return {int(m) for m in re.findall(r"inet 10\.213\.(\d+)\.1/", out)}


class RealNode:
    """One real node of the cluster `cluster` (a k8senv.Cluster), with its files under run_dir.

    Call create_network() before the cluster's apiserver starts (it binds `host_ip`), then
    start(...) once the apiserver answers, and stop() at the end (idempotent). `procs` are the
    node's processes (they are also added to the ControlPlane's procs by k8senv).
    """

    def __init__(self, bindir: Path, run_dir: Path, cluster_name: str) -> None:
        self.bindir = Path(bindir)
        self.run_dir = Path(run_dir)
        self.cluster_name = cluster_name
        self.name = f"{cluster_name}-node"
        self.procs: list[k8senv.Proc] = []
        self.slot: Slot | None = None
        # One cgroup root per node: two nodes of one run (two regions) must not share one.
        self.cgroup_root = f"/{CGROUP_PREFIX}{os.getpid()}-{cluster_name}"
        self._holder: k8senv.Proc | None = None
        self._holder_pid = 0
        self._cluster: k8senv.Cluster | None = None
        self._stop = threading.Event()
        self._provisioner: threading.Thread | None = None
        self.provisioned: list[str] = []  # PV names the provisioner created (for tests)

    # -- addresses

    @property
    def holder_pid(self) -> int:
        """The node's PID 1 (host pid): `nsenter --target PID --pid --mount --net` enters it."""
        return self._holder_pid

    @property
    def host_ip(self) -> str:
        assert self.slot is not None, "create_network() first"
        return self.slot.host_ip

    @property
    def node_ip(self) -> str:
        assert self.slot is not None, "create_network() first"
        return self.slot.node_ip

    @property
    def pod_cidr(self) -> str:
        assert self.slot is not None, "create_network() first"
        return self.slot.pod_cidr

    # -- running things inside the node

    def nsenter(self, *argv: str | Path) -> list[str]:
        """argv prefixed so that it runs in the node's PID, mount and network namespaces."""
        return [
            "nsenter",
            f"--target={self._holder_pid}",
            "--pid",
            "--mount",
            "--net",
            "--",
            *map(str, argv),
        ]

    def run(self, *argv: str | Path, input: str | None = None, timeout: float = 60) -> str:
        """Run one command inside the node; return stdout (RuntimeError when it fails)."""
        return _run(*self.nsenter(*argv), input=input, timeout=timeout)

    def ctr(self, *args: str, timeout: float = 120) -> str:
        """`ctr -n k8s.io ARGS` against the node's containerd."""
        return self.run(
            self.bindir / "ctr",
            f"--address={CTR_SOCKET}",
            "--namespace=k8s.io",
            *args,
            timeout=timeout,
        )

    def import_image(self, archive: Path) -> list[str]:
        """Import an image archive (OCI layout or docker-archive tar, e.g. `podman save`) into the
        node's containerd, where the kubelet finds it (use imagePullPolicy IfNotPresent or Never:
        the node cannot pull). Returns the image names it now has from that archive."""
        archive = Path(archive).resolve()
        if not archive.is_file():
            raise FileNotFoundError(archive)
        names = archive_names(archive)
        # (ctr's own output is a progress table that cuts long names; it is not parsed.)
        # The layers' blobs go once unpacked: the snapshots are what containers run from, and
        # keeping both doubles what each node holds on disk (twice the image).
        # (--local: ctr unpacks itself; the transfer API has no way to discard.)
        self.ctr(
            "images", "import", "--local", "--discard-unpacked-layers", str(archive), timeout=600
        )
        have = set(self.images())
        if missing := [n for n in names if n not in have]:
            raise RuntimeError(f"realnode: after importing {archive}, containerd lacks {missing}")
        return names

    def images(self) -> list[str]:
        """Image names in the node's containerd (namespace k8s.io)."""
        out = self.ctr("images", "ls", "--quiet").splitlines()
        return [ln for ln in out if ln.strip() and not ln.startswith("sha256:")]

    # -- lifecycle

    def create_network(self) -> None:
        """Clean stale leftovers, start the holder, and wire the veth pair and addresses."""
        if missing := problems():
            raise RuntimeError("realnode: cannot run a real node here: " + "; ".join(missing))
        if removed := cleanup_stale():
            log.info("realnode: removed stale cgroups of dead runs: %s", removed)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._holder = k8senv.Proc(
            "node-holder",
            k8senv.spawn(
                [
                    "unshare",
                    "--pid",
                    "--fork",
                    "--kill-child=SIGKILL",
                    "--mount",
                    "--mount-proc",
                    "--net",
                    "--",
                    self.bindir / "pause",
                ],
                self.run_dir / "holder.log",
            ),
            self.run_dir / "holder.log",
        )
        self.procs.append(self._holder)
        self._holder_pid = k8senv.wait_until(
            "the node's holder process", self._find_holder, timeout=15, interval=0.05
        )
        # Private to the node: /run (containerd's state and sockets, shim sockets) and
        # /var/lib/kubelet (the kubelet's hard-coded device-plugin socket dir); both vanish
        # with the mount namespace.
        Path("/var/lib/kubelet").mkdir(parents=True, exist_ok=True)
        _run(
            "nsenter", f"--target={self._holder_pid}", "--mount", "--", "sh", "-c",
            "mount -t tmpfs -o mode=0755 ddk-run /run && "
            "mount -t tmpfs -o mode=0700 ddk-kubelet /var/lib/kubelet",
        )  # fmt: skip
        SLOT_LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(SLOT_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two runs must not pick the same slot
            used = _used_slots()
            free = next((i for i in range(256) if i not in used), None)
            if free is None:
                raise RuntimeError("realnode: all 256 address slots 10.213.*.0/30 are in use")
            slot = Slot(free)
            _run(
                "ip", "link", "add", slot.host_link, "type", "veth",
                "peer", "name", "eth0", "netns", str(self._holder_pid),
            )  # fmt: skip
            _run("ip", "addr", "add", f"{slot.host_ip}/30", "dev", slot.host_link)
            _run("ip", "link", "set", slot.host_link, "up")
            self.slot = slot
        self.run("ip", "addr", "add", f"{slot.node_ip}/30", "dev", "eth0")
        self.run("ip", "link", "set", "eth0", "up")
        self.run("ip", "link", "set", "lo", "up")
        self.run("sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        with contextlib.suppress(RuntimeError):  # per-netns since Linux 5.3, absent without it
            self.run("sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=1")
        # The host reaches pods directly (the pod network has no NAT toward the host).
        _run("ip", "route", "add", slot.pod_cidr, "via", slot.node_ip, "dev", slot.host_link)
        log.info(
            "realnode: %s: holder pid %d, host %s, node %s, pods %s",
            self.name, self._holder_pid, slot.host_ip, slot.node_ip, slot.pod_cidr,
        )  # fmt: skip

    def _find_holder(self) -> int:
        """The pid of unshare's child once it runs pause (its namespaces and /proc are set)."""
        assert self._holder is not None
        if not self._holder.alive():
            raise RuntimeError(f"realnode: unshare exited:\n{self._holder.tail()}")
        pid = self._holder.pid
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if kids and os.readlink(f"/proc/{kids[0]}/exe").endswith("/pause"):
            return int(kids[0])
        return 0

    def apiserver_flags(self, pki: Path) -> list[str]:
        """Extra kube-apiserver flags for the node's cluster (after create_network())."""
        return [
            "--endpoint-reconciler-type=lease",  # the `kubernetes` Service gets an endpoint
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
        ]

    def write_certs(self, pki: Path) -> None:
        """Certificates signed by the plane's CA: the apiserver's kubelet client, and the node's
        kubelet (client and serving), kube-proxy and CoreDNS identities (named after the node:
        a plane may have one node per region)."""
        self._cert(pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet")
        n = self.name
        self._cert(pki, f"{n}-kubelet-client", f"/O=system:nodes/CN=system:node:{self.name}")
        self._cert(pki, f"{n}-kube-proxy", "/CN=system:kube-proxy")
        self._cert(pki, f"{n}-coredns", "/CN=ddiloco:coredns")
        self._cert(
            pki,
            f"{n}-kubelet-serving",
            f"/CN={self.name}",
            f"subjectAltName=IP:{self.node_ip},DNS:{self.name}\nextendedKeyUsage=serverAuth\n",
        )

    @staticmethod
    def _cert(pki: Path, name: str, subj: str, ext: str = "extendedKeyUsage=clientAuth\n") -> None:
        key, csr, crt, extf = (pki / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
        extf.write_text(ext)
        k8senv._openssl(
            "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-subj", subj, "-keyout", key, "-out", csr,
        )  # fmt: skip
        k8senv._openssl(
            "x509", "-req", "-in", csr, "-CA", pki / "ca.crt", "-CAkey", pki / "ca.key",
            "-CAcreateserial", "-days", "3650", "-extfile", extf, "-out", crt,
        )  # fmt: skip

    def start(self, cluster: k8senv.Cluster, pki: Path, deadline: float) -> list[k8senv.Proc]:
        """Start containerd, kubelet, kube-proxy and CoreDNS; return once the node is Ready,
        kube-proxy has synced and DNS answers. Returns the node's processes."""
        t0 = time.monotonic()
        self._cluster = cluster
        run = self.run_dir
        for d in ("containerd", "kubelet", "pod-logs", "cni", "cni-ipam", "volumes", "plugins"):
            (run / d).mkdir(parents=True, exist_ok=True)
        self._make_cgroup_root()
        kubeconfigs = {
            who: self._kubeconfig(cluster, pki, who) for who in ("kubelet", "kube-proxy", "coredns")
        }
        env = {
            "PATH": f"{self.bindir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        }

        (run / "containerd.toml").write_text(self._containerd_config())
        (run / "cni" / "10-ddk.conflist").write_text(json.dumps(self._cni_config(), indent=2))
        containerd = self._spawn(
            "containerd",
            [self.bindir / "containerd", f"--config={run / 'containerd.toml'}"],
            env,
        )
        k8senv._wait(
            "containerd's socket",
            self._containerd_up,
            [containerd],
            deadline,
        )
        for archive in ("pause.oci.tar", "probe.oci.tar"):
            self.import_image(self.bindir / archive)
        missing = {PAUSE_IMAGE, PROBE_IMAGE} - set(self.images())
        if missing:
            raise RuntimeError(f"realnode: images not in containerd after import: {missing}")

        self._apply_cluster_objects(cluster)
        (run / "kubelet.yaml").write_text(json.dumps(self._kubelet_config(pki), indent=2))
        kubelet = self._spawn(
            "kubelet",
            [
                self.bindir / "kubelet",
                f"--config={run / 'kubelet.yaml'}",
                f"--kubeconfig={kubeconfigs['kubelet']}",
                f"--root-dir={run / 'kubelet'}",
                f"--cert-dir={run / 'kubelet' / 'pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.node_ip}",
                f"--node-labels={'='.join(NODE_LABEL)}",
                "--v=1",
            ],
            env,
        )
        k8senv._wait(
            f"node {self.name} registered",
            lambda: bool(cluster.api("GET", f"/api/v1/nodes/{self.name}")),
            [containerd, kubelet],
            deadline,
        )
        (run / "kube-proxy.yaml").write_text(
            json.dumps(self._kube_proxy_config(kubeconfigs["kube-proxy"]), indent=2)
        )
        proxy = self._spawn(
            "kube-proxy",
            [self.bindir / "kube-proxy", f"--config={run / 'kube-proxy.yaml'}", "--v=1"],
            env,
        )
        (run / "Corefile").write_text(self._corefile(kubeconfigs["coredns"]))
        coredns = self._spawn("coredns", [self.bindir / "coredns", "-conf", run / "Corefile"], env)
        procs = [containerd, kubelet, proxy, coredns]
        k8senv._wait(f"node {self.name} Ready", lambda: self.ready(cluster), procs, deadline)
        k8senv._wait(
            "kube-proxy synced (/healthz)",
            lambda: k8senv._get_ok(f"http://{self.node_ip}:10256/healthz"),
            procs,
            deadline,
        )
        k8senv._wait(
            "CoreDNS ready (/ready)",
            lambda: k8senv._get_ok(f"http://{self.node_ip}:8181/ready"),
            procs,
            deadline,
        )
        self._provisioner = threading.Thread(
            target=self._provision_loop, name="realnode-provisioner", daemon=True
        )
        self._provisioner.start()
        log.info("realnode: node %s Ready in %.1fs", self.name, time.monotonic() - t0)
        return procs

    def _containerd_up(self) -> bool:
        try:
            return bool(self.ctr("version", timeout=10))
        except RuntimeError:  # no socket yet
            return False

    def ready(self, cluster: k8senv.Cluster | None = None) -> bool:
        """True while the Node reports Ready=True."""
        cl = cluster or self._cluster
        assert cl is not None
        node = cl.api("GET", f"/api/v1/nodes/{self.name}")
        return any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in node.get("status", {}).get("conditions") or []
        )

    def stop_clients(self) -> None:
        """Kill the node's API clients (kubelet, kube-proxy, CoreDNS) but not its containers:
        an apiserver stopping while they run waits for their connections to drain."""
        clients = [p for p in self.procs if p.name in ("kubelet", "kube-proxy", "coredns")]
        for p in clients:
            with contextlib.suppress(OSError, ValueError):  # nsenter's child: the real one
                for child in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split():
                    os.kill(int(child), signal.SIGKILL)
        for p in clients:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=5)

    def stop(self) -> None:
        """Kill the node (everything in its PID namespace) and remove its cgroups. Idempotent."""
        self._stop.set()
        if self._provisioner is not None:
            self._provisioner.join(timeout=10)
        if self._holder is not None and self._holder.alive():
            # unshare's --kill-child SIGKILLs the holder, whose PID namespace then dies whole.
            self._holder.popen.send_signal(signal.SIGKILL)
        for p in self.procs:
            try:
                p.popen.wait(timeout=k8senv.STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
        if self._holder_pid:
            with contextlib.suppress(TimeoutError):
                k8senv.wait_until(
                    "the node's holder to exit",
                    lambda: not k8senv.pid_alive(self._holder_pid),
                    timeout=10,
                    interval=0.05,
                )
        if self.slot is not None:  # gone with the netns; only a failed start can leave it
            subprocess.run(
                ["ip", "link", "del", self.slot.host_link], capture_output=True, check=False
            )
        roots = [ctrl / self.cgroup_root.lstrip("/") for ctrl in _cgroup_controllers()]
        with contextlib.suppress(TimeoutError):
            k8senv.wait_until(
                "the node's cgroups to be removable",
                lambda: all([_rmdir_tree(r) for r in roots]),
                timeout=15,
                interval=0.2,
            )
        if left := [str(r) for r in roots if r.exists()]:
            log.warning("realnode: could not remove cgroups %s", left)
        self._remove_images()

    def _remove_images(self) -> None:
        """Remove the node's image store (gigabytes per imported image) once nothing of the node
        holds a mount under it; the logs stay beside it. pytest keeps its last runs' temporary
        folders, and a few runs' image stores alone would fill the disk."""
        store = self.run_dir / "containerd"
        if not store.exists():
            return
        mounts = Path("/proc/self/mountinfo").read_text()
        if str(self.run_dir) in mounts:
            log.warning("realnode: mounts left under %s; its image store stays", self.run_dir)
            return
        shutil.rmtree(store, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What of this node is still on the host (empty after stop(), for tests): its link,
        its route, its cgroups, host mounts under its run dir, live processes of it."""
        out = []
        if self.slot is not None:
            links = subprocess.run(
                ["ip", "-o", "link", "show"], capture_output=True, text=True
            ).stdout
            if re.search(rf"^\d+: {self.slot.host_link}[@:]", links, re.MULTILINE):
                out.append(f"link {self.slot.host_link}")
            routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
            if self.slot.pod_cidr in routes:
                out.append(f"route {self.slot.pod_cidr}")
        out += [
            f"cgroup {d}"
            for ctrl in _cgroup_controllers()
            if (d := ctrl / self.cgroup_root.lstrip("/")).exists()
        ]
        mounts = Path("/proc/self/mountinfo").read_text()
        out += [f"mount {ln.split()[4]}" for ln in mounts.splitlines() if str(self.run_dir) in ln]
        out += [f"process {p.name} {p.pid}" for p in self.procs if k8senv.pid_alive(p.pid)]
        return out

    # -- internals

    def _spawn(self, name: str, argv: Sequence[str | Path], env: dict[str, str]) -> k8senv.Proc:
        logfile = self.run_dir / f"{name}.log"
        proc = k8senv.Proc(name, k8senv.spawn(self.nsenter(*argv), logfile, env=env), logfile)
        self.procs.append(proc)
        return proc

    def _make_cgroup_root(self) -> None:
        """kubelet wants --cgroup-root to exist in every v1 hierarchy; cpuset needs cpus/mems."""
        for ctrl in _cgroup_controllers():
            d = ctrl / self.cgroup_root.lstrip("/")
            d.mkdir(exist_ok=True)
            if ctrl.name == "cpuset":
                for f in ("cpuset.cpus", "cpuset.mems"):
                    if not (d / f).read_text().strip():
                        (d / f).write_text((ctrl / f).read_text())

    def _kubeconfig(self, cluster: k8senv.Cluster, pki: Path, who: str) -> Path:
        cert = "kubelet-client" if who == "kubelet" else who
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": cluster.name,
                    "cluster": {
                        "server": cluster.server,
                        "certificate-authority": str(pki / "ca.crt"),
                    },
                }
            ],
            "users": [
                {
                    "name": who,
                    "user": {
                        "client-certificate": str(pki / f"{self.name}-{cert}.crt"),
                        "client-key": str(pki / f"{self.name}-{cert}.key"),
                    },
                }
            ],
            "contexts": [{"name": who, "context": {"cluster": cluster.name, "user": who}}],
            "current-context": who,
        }
        path = self.run_dir / f"{who}.kubeconfig"
        path.write_text(json.dumps(cfg, indent=2))
        return path

    def _containerd_config(self) -> str:
        run = self.run_dir
        return f"""\
# The real node's containerd (written by tests/integration/realnode.py). /run is a tmpfs private
# to the node's mount namespace, so state and sockets (shims' too) never reach the host.
version = 4
root = '{run / "containerd"}'
state = '/run/containerd'
imports = []
disabled_plugins = ['io.containerd.nri.v1.nri', 'io.containerd.internal.v1.opt']

[plugins]
  [plugins.'io.containerd.server.v1.grpc']
    address = '{CTR_SOCKET}'
  [plugins.'io.containerd.server.v1.ttrpc']
    address = '{CTR_SOCKET}.ttrpc'

  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '{PAUSE_IMAGE}'

  [plugins.'io.containerd.cri.v1.runtime']
    cdi_spec_dirs = []
    enable_criu = false
    # This sandbox refuses lowering oom_score_adj (the kubelet's own -999 fails the same way);
    # containers otherwise ask for down to -998 (pause, Guaranteed pods) and runc init dies.
    restrict_oom_score_adj = true
    netns_mounts_under_state_dir = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = '{RUNC}'
          Root = '/run/containerd/runc'
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['{CNI_BIN_DIR}']
      conf_dir = '{run / "cni"}'
      max_conf_num = 1

  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = '127.0.0.1'
    stream_server_port = '0'
"""

    def _cni_config(self) -> dict[str, Any]:
        net = ipaddress.ip_network(self.pod_cidr)
        return {
            "cniVersion": "1.0.0",
            "name": "ddk-pods",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "ddk0",
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": str(net), "gateway": str(net[1])}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.run_dir / "cni-ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }

    def _kubelet_config(self, pki: Path) -> dict[str, Any]:
        off = "0%"  # an eviction threshold of 0 never fires: no pressure evictions here
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.node_ip,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 10248,
            "tlsCertFile": str(pki / f"{self.name}-kubelet-serving.crt"),
            "tlsPrivateKeyFile": str(pki / f"{self.name}-kubelet-serving.key"),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(pki / "ca.crt")},
            },
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": f"unix://{CTR_SOCKET}",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "cgroupsPerQOS": True,
            "failCgroupV1": False,
            "failSwapOn": False,
            "clusterDomain": CLUSTER_DOMAIN,
            "clusterDNS": [CLUSTER_DNS_IP],
            "resolvConf": "",  # pods get cluster DNS only; the host's resolver is not inherited
            "podLogsDir": str(self.run_dir / "pod-logs"),
            "volumePluginDir": str(self.run_dir / "plugins"),
            "evictionHard": {
                "memory.available": off,
                "nodefs.available": off,
                "nodefs.inodesFree": off,
                "imagefs.available": off,
                "imagefs.inodesFree": off,
            },
            "evictionPressureTransitionPeriod": "0s",
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "maxPods": 110,
            "serializeImagePulls": False,
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
            "shutdownGracePeriod": "0s",
            "nodeStatusUpdateFrequency": "5s",
            "logging": {"format": "text"},
        }

    def _kube_proxy_config(self, kubeconfig: Path) -> dict[str, Any]:
        return {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "mode": "iptables",
            "hostnameOverride": self.name,
            "clusterCIDR": self.pod_cidr,
            "bindAddress": self.node_ip,
            "healthzBindAddress": f"{self.node_ip}:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            # Masquerade all Service traffic: same-bridge pod-to-Service replies then return
            # through the node's conntrack even without br_netfilter.
            "iptables": {"masqueradeAll": True, "syncPeriod": "30s", "minSyncPeriod": "0s"},
            # Leave the (host-wide) conntrack table settings alone.
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
            },
        }

    def _corefile(self, kubeconfig: Path) -> str:
        return f"""\
# The real node's cluster DNS (written by tests/integration/realnode.py). No upstream: names
# outside {CLUSTER_DOMAIN} are not resolved, nothing leaves the machine.
.:53 {{
    bind {self.node_ip}
    errors
    health {self.node_ip}:8080
    ready {self.node_ip}:8181
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} coredns
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
}}
"""

    def _apply_cluster_objects(self, cl: k8senv.Cluster) -> None:
        """RBAC for CoreDNS, the kube-dns Service backed by CoreDNS on the node, and the default
        StorageClass `standard` (served by the provisioner thread)."""
        objs: list[tuple[str, dict[str, Any]]] = [
            (
                "/apis/rbac.authorization.k8s.io/v1/clusterroles",
                {
                    "metadata": {"name": "ddiloco:coredns"},
                    "rules": [
                        {
                            "apiGroups": [""],
                            "resources": ["services", "pods", "namespaces"],
                            "verbs": ["list", "watch"],
                        },
                        {
                            "apiGroups": ["discovery.k8s.io"],
                            "resources": ["endpointslices"],
                            "verbs": ["list", "watch"],
                        },
                    ],
                },
            ),
            (
                "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
                {
                    "metadata": {"name": "ddiloco:coredns"},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": "ddiloco:coredns",
                    },
                    "subjects": [
                        {
                            "apiGroup": "rbac.authorization.k8s.io",
                            "kind": "User",
                            "name": "ddiloco:coredns",
                        }
                    ],
                },
            ),
            (
                "/api/v1/namespaces/kube-system/services",
                {
                    "metadata": {"name": "kube-dns", "labels": {"k8s-app": "kube-dns"}},
                    "spec": {
                        "clusterIP": CLUSTER_DNS_IP,
                        "ports": [
                            {"name": "dns", "port": 53, "protocol": "UDP"},
                            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                        ],
                    },
                },
            ),
            (
                "/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices",
                {
                    "metadata": {
                        "name": "kube-dns-node",
                        "labels": {
                            "kubernetes.io/service-name": "kube-dns",
                            "endpointslice.kubernetes.io/managed-by": "realnode.ddiloco.dev",
                        },
                    },
                    "addressType": "IPv4",
                    "endpoints": [
                        {
                            "addresses": [self.node_ip],
                            "conditions": {"ready": True},
                            "nodeName": self.name,
                        }
                    ],
                    "ports": [
                        {"name": "dns", "port": 53, "protocol": "UDP"},
                        {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                    ],
                },
            ),
            (
                "/apis/storage.k8s.io/v1/storageclasses",
                {
                    "metadata": {
                        "name": STORAGE_CLASS,
                        "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
                    },
                    "provisioner": PROVISIONER,
                    "reclaimPolicy": "Delete",
                    "volumeBindingMode": "Immediate",
                },
            ),
        ]
        for path, body in objs:
            try:
                cl.api("POST", path, body)
            except urllib.error.HTTPError as e:
                if e.code != 409:  # AlreadyExists: a restarted node on the same cluster
                    raise RuntimeError(f"realnode: POST {path}: {e.code} {e.read()[:500]!r}") from e

    # -- the hostPath provisioner

    def _provision_loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self._provision_once()
            except (OSError, ValueError) as e:  # apiserver briefly away (frozen, stopping)
                log.debug("realnode provisioner: %s", e)

    def _provision_once(self) -> None:
        cl = self._cluster
        assert cl is not None
        for pvc in cl.api("GET", "/api/v1/persistentvolumeclaims", timeout=5)["items"]:
            meta, spec = pvc["metadata"], pvc["spec"]
            if (
                pvc.get("status", {}).get("phase") != "Pending"
                or spec.get("storageClassName") != STORAGE_CLASS
                or spec.get("volumeName")
                or meta.get("deletionTimestamp")
            ):
                continue
            name = f"pvc-{meta['uid']}"
            path = self.run_dir / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o777)  # hostPath ignores fsGroup: any pod uid may write
            pv = {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {
                    "name": name,
                    "labels": {PV_LABEL[0]: PV_LABEL[1]},
                    "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER},
                },
                "spec": {
                    "capacity": {"storage": spec["resources"]["requests"]["storage"]},
                    "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                    "volumeMode": spec.get("volumeMode") or "Filesystem",
                    "persistentVolumeReclaimPolicy": "Delete",
                    "storageClassName": STORAGE_CLASS,
                    "claimRef": {
                        "apiVersion": "v1",
                        "kind": "PersistentVolumeClaim",
                        "namespace": meta["namespace"],
                        "name": meta["name"],
                        "uid": meta["uid"],
                    },
                    "hostPath": {"path": str(path), "type": "Directory"},
                    "nodeAffinity": {
                        "required": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {
                                            "key": "kubernetes.io/hostname",
                                            "operator": "In",
                                            "values": [self.name],
                                        }
                                    ]
                                }
                            ]
                        }
                    },
                },
            }
            try:
                cl.api("POST", "/api/v1/persistentvolumes", pv, timeout=5)
                self.provisioned.append(name)
                log.info(
                    "realnode provisioner: %s for %s/%s", name, meta["namespace"], meta["name"]
                )
            except urllib.error.HTTPError as e:
                if e.code != 409:
                    raise
        sel = "=".join(PV_LABEL).replace("/", "%2F").replace("=", "%3D")
        for pv in cl.api("GET", f"/api/v1/persistentvolumes?labelSelector={sel}", timeout=5)[
            "items"
        ]:
            if pv.get("status", {}).get("phase") in ("Released", "Failed") and not pv[
                "metadata"
            ].get("deletionTimestamp"):
                with contextlib.suppress(urllib.error.HTTPError):
                    cl.api("DELETE", f"/api/v1/persistentvolumes/{pv['metadata']['name']}")
                shutil.rmtree(pv["spec"]["hostPath"]["path"], ignore_errors=True)


def get_text(url: str, timeout: float = 5) -> str:
    """GET url (http, e.g. a pod IP from the host) and return the body as text."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())
