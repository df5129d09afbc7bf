"""image: the project's container image, built for real from the repo's Dockerfile, no registry.

The base is made from Debian packages (debootstrap, no Docker Hub) and imported into podman's
storage; the image is the Dockerfile built on it by buildah with layer caching, torch from PyPI
(PyTorch's index is not reachable here). Standard library only, so CI can run it before the
venv matters. Figures: tests/integration/IMAGE.md.

    python tests/integration/image.py build        # base + image (cold: ~20 min, warm: seconds)
    python tests/integration/image.py key          # the tags the current tree builds
    python tests/integration/image.py save out.tar # a docker-archive for `ctr images import`

Tags: localhost/ddiloco-python:3.11-bookworm-<key> (the base; key over its recipe below) and
localhost/ddiloco:<key> (key over the base tag, the build arguments and every file the build
context holds: Dockerfile, .dockerignore, pyproject.toml and what the Dockerfile COPYs), so any
project change gives a new tag, while buildah's layer cache reuses the torch and dependency
layers unless their inputs changed. Older tags of ours are untagged (the newest KEEP_IMAGES
kept) and the dangling images derived from our bases pruned, so storage does not grow.

Needs root, podman, buildah, runc and debootstrap (apt: podman buildah runc debootstrap uidmap
fuse-overlayfs containernetworking-plugins iptables). The host here has cgroup v1, so every
build and run uses `--runtime runc` and explicit `--ulimit`s (raising them is not permitted).
DDILOCO_IMAGE_TORCH_INDEX_URL sets the Dockerfile's TORCH_INDEX_URL (default PyPI; empty:
PyTorch's index for the flavour).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

REPO: Final = Path(__file__).resolve().parents[2]
DOCKERFILE: Final = REPO / "Dockerfile"
DOCKERIGNORE: Final = REPO / ".dockerignore"
BUILD_COMMAND: Final = "python tests/integration/image.py build"

IMAGE_REPO: Final = "localhost/ddiloco"
BASE_REPO: Final = "localhost/ddiloco-python"
BASE_LABEL: Final = "dev.ddiloco.base.key"
"""Carried by the base and so by every image built on it: it scopes our prune."""
KEEP_IMAGES: Final = 3
"""Tags of localhost/ddiloco kept: the one just built and the two newest others."""
PRUNE_AFTER_H: Final = 72
DEFAULT_TORCH_INDEX_URL: Final = "https://pypi.org/simple"
HOST_CA_BUNDLE: Final = "/etc/ssl/certs/ca-certificates.crt"
TOOLS: Final = {
    "podman": "podman",
    "buildah": "buildah",
    "runc": "runc",
    "debootstrap": "debootstrap",
    "unshare": "util-linux",
    "chroot": "coreutils",
    "tar": "tar",
}
"""Programs the build needs, and the Debian package of each."""

# --------------------------------------------------------------------------- the base's recipe
# Everything below up to base_key() is hashed into the base's tag: edit it and the base is
# rebuilt (and with it the image). Shaped like python:3.11-slim-bookworm where the Dockerfile
# relies on it: `python` on PATH, `python -m venv` with pip, groupadd/useradd, CA certificates
# in /etc/ssl, netbase and tzdata, LANG=C.UTF-8. Python is Debian's 3.11 (with bookworm-security
# updates), not the upstream build the official image compiles. pycurl's wheel bundles its own
# libcurl, so no libcurl4.

DEBIAN_SUITE: Final = "bookworm"
DEBIAN_MIRROR: Final = "http://deb.debian.org/debian"
BASE_PACKAGES: Final = (
    "python3.11",
    "python3.11-venv",
    "python-is-python3",
    "ca-certificates",
    "passwd",
    "netbase",
    "tzdata",
)
BASE_SHAPE: Final = r"""
set -eu
export DEBIAN_FRONTEND=noninteractive LC_ALL=C
# Later installs (apt-get in images built on this base) skip docs too, like Debian's slim images.
cat > /etc/dpkg/dpkg.cfg.d/ddiloco-slim <<'X'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
X
cat > /etc/apt/apt.conf.d/ddiloco-slim <<'X'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
X
rm -f /etc/apt/sources.list
cat > /etc/apt/sources.list.d/debian.sources <<'X'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
X
apt-get update -q
apt-get upgrade -y -q
apt-get install -y -q "$@"
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/debconf/*-old /var/lib/dpkg/*-old
rm -rf /var/log/* /tmp/* /var/tmp/* /root/.cache
find /usr/share/doc -mindepth 1 -not -type d -not -name copyright -delete
find /usr/share/doc -mindepth 1 -type d -empty -delete
rm -rf /usr/share/man/* /usr/share/info/* /usr/share/locale/* /usr/share/lintian
: > /etc/hostname
# What the Dockerfile relies on, checked before the base is kept.
python -m venv /tmp/venv-check
/tmp/venv-check/bin/pip --version
rm -rf /tmp/venv-check
command -v groupadd useradd
test -s /etc/ssl/certs/ca-certificates.crt
python --version
"""
BASE_CHANGES: Final = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["python3"]',
)


def base_key() -> str:
    """12 hex digits over the base's recipe."""
    recipe = {
        "suite": DEBIAN_SUITE,
        "mirror": DEBIAN_MIRROR,
        "variant": "minbase",
        "packages": BASE_PACKAGES,
        "shape": BASE_SHAPE,
        "changes": BASE_CHANGES,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def base_tag() -> str:
    return f"{BASE_REPO}:3.11-{DEBIAN_SUITE}-{base_key()}"


# --------------------------------------------------------------------------- plumbing


class ToolMissing(RuntimeError):
    """A program the build needs is not installed (the message names it and its package)."""


class BuildFailed(RuntimeError):
    """A build step ran and failed; the message names its log."""


class Progress:
    """Progress lines with the seconds elapsed since it was made: `[image   12.3s] ...`."""

    def __init__(self, out: IO[str] | None = None) -> None:
        self.t0 = time.monotonic()
        self.out = out if out is not None else sys.stderr

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def __call__(self, msg: str) -> None:
        self.out.write(f"[image {self.elapsed():7.1f}s] {msg}\n")
        self.out.flush()


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ddiloco" / "image"


def require_tools(*names: str) -> None:
    """Raise ToolMissing naming every program of `names` (default: all of TOOLS) not on PATH."""
    missing = [n for n in (names or tuple(TOOLS)) if shutil.which(n) is None]
    if missing:
        pkgs = sorted({TOOLS.get(n, n) for n in missing})
        raise ToolMissing(
            f"cannot build the image: {', '.join(missing)} not found on PATH "
            f"(Debian: apt-get install {' '.join(pkgs)}; run as root)"
        )
    if os.geteuid() != 0:
        raise ToolMissing("cannot build the image: debootstrap, chroot and podman need root")


NPROC_CAP: Final = 32768
"""nproc above this fails in runc here even under our own limit (buildah's default value)."""


def ulimit_args() -> list[str]:
    """--ulimit flags no higher than this process's limits (a container may not raise them)."""
    out = []
    for name, which, cap in (
        ("nofile", resource.RLIMIT_NOFILE, 1 << 20),
        ("nproc", resource.RLIMIT_NPROC, NPROC_CAP),
    ):
        soft, hard = resource.getrlimit(which)
        hard = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
        soft = hard if soft == resource.RLIM_INFINITY else min(soft, hard)
        out += ["--ulimit", f"{name}={soft}:{hard}"]
    return out


def podman(
    *args: str, check: bool = True, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise BuildFailed(f"podman {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
    return proc


def image_exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def inspect(tag: str) -> dict[str, Any]:
    """`podman image inspect` of one image (Config, Labels, Size, ...)."""
    return json.loads(podman("image", "inspect", tag).stdout)[0]


def image_size(tag: str) -> int:
    """Bytes of the image's layers, uncompressed (base included), as podman counts them."""
    return int(inspect(tag)["Size"])


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """An exclusive lock per machine (flock): a second builder waits, then reuses the result."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run_logged(
    argv: Sequence[str], logfile: Path, progress: Progress, show: re.Pattern[str]
) -> None:
    """Run argv with its output in logfile; lines matching `show` also go to progress."""
    with open(logfile, "w") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if show.search(line):
                progress(line.rstrip()[:160])
        rc = proc.wait()
    if rc != 0:
        tail = "".join(logfile.read_text().splitlines(keepends=True)[-25:])
        raise BuildFailed(f"{argv[0]} failed (rc={rc}); log {logfile}; last lines:\n{tail}")


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    return [p for p in points if p.startswith(prefix)]


def _remove_tree(path: Path) -> None:
    """rmtree, refusing if anything is still mounted below (a chroot's /proc, say)."""
    if not path.exists():
        return
    if left := _mounts_under(path):
        raise BuildFailed(f"not removing {path}: still mounted below it: {left}")
    shutil.rmtree(path, ignore_errors=True)


def _write_manifest(name: str, data: dict[str, Any]) -> None:
    (cache_root() / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")


def read_manifest(name: str) -> dict[str, Any]:
    """What the last build of `base` or `image` recorded (tag, seconds, size), or {}."""
    try:
        return json.loads((cache_root() / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}


# --------------------------------------------------------------------------- the base


def ensure_base(progress: Progress | None = None) -> str:
    """The base image's tag, building it first if this recipe was never built here."""
    progress = progress or Progress()
    tag = base_tag()
    require_tools("podman")
    if image_exists(tag):
        return tag
    require_tools()
    with _locked("base"):
        if image_exists(tag):
            return tag
        _build_base(tag, progress)
        _remove_old(BASE_REPO, keep=tag, progress=progress)
        _prune_dangling(progress)
    return tag


def _build_base(tag: str, progress: Progress) -> None:
    t0 = time.monotonic()
    root = cache_root()
    work = Path(tempfile.mkdtemp(prefix="base-", dir=root))
    rootfs, tarball = work / "rootfs", work / "rootfs.tar"
    try:
        progress(f"base {tag}: debootstrap --variant=minbase {DEBIAN_SUITE} (log {root}/base.log)")
        # In a private mount namespace: whatever debootstrap and the chroot mount (/proc, /sys)
        # is gone when they exit, even if they fail halfway.
        _run_logged(
            [
                "unshare", "--mount", "--propagation", "private",
                "debootstrap", "--variant=minbase", "--components=main",
                DEBIAN_SUITE, str(rootfs), DEBIAN_MIRROR,
            ],
            root / "base.log",
            progress,
            re.compile(r"^I: (Retrieving Release|Validating Packages|Extracting|Installing core|Base system installed)|^[EW]: "),
        )  # fmt: skip
        progress("base: apt-get upgrade (bookworm-security) and install " + " ".join(BASE_PACKAGES))
        script = work / "shape.sh"
        script.write_text(BASE_SHAPE)
        shutil.copy(script, rootfs / "shape.sh")
        _run_logged(
            [
                "unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount -t proc proc "$0/proc" && exec chroot "$0" /usr/bin/env -i '
                "PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root /bin/sh /shape.sh \"$@\"",
                str(rootfs), *BASE_PACKAGES,
            ],
            root / "base-shape.log",
            progress,
            re.compile(r"^(Setting up python3\.11 |Python \d|pip \d|E: (?!Can not write log))"),
        )  # fmt: skip
        (rootfs / "shape.sh").unlink()
        if left := _mounts_under(rootfs):
            raise BuildFailed(f"the base's chroot left mounts behind: {left}")
        _run_logged(
            ["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf", str(tarball), "."],
            root / "base-tar.log",
            progress,
            re.compile(r"^tar: "),
        )
        changes = [*BASE_CHANGES, f"LABEL {BASE_LABEL}={base_key()}"]
        changes.append(
            "LABEL dev.ddiloco.base.recipe="
            f'"debootstrap minbase {DEBIAN_SUITE} + {" ".join(BASE_PACKAGES)}"'
        )
        argv = ["import", "--message", f"ddiloco base {base_key()}"]
        for change in changes:
            argv += ["--change", change]
        podman(*argv, str(tarball), tag)
    finally:
        _remove_tree(work)
    seconds = time.monotonic() - t0
    size = image_size(tag)
    _write_manifest("base", {"tag": tag, "build_seconds": round(seconds, 1), "size": size})
    progress(f"base {tag} built in {seconds:.0f}s, {size / 1e6:.0f} MB")


# --------------------------------------------------------------------------- the image


@dataclass(frozen=True)
class Context:
    """The build context, staged: exactly the files the Dockerfile can COPY, minus .dockerignore."""

    files: tuple[str, ...]
    """Paths relative to the repo, sorted."""

    def digest(self) -> str:
        h = hashlib.sha256()
        for rel in self.files:
            path = REPO / rel
            mode = "x" if os.access(path, os.X_OK) else "-"
            h.update(f"{rel}\0{mode}\0".encode() + path.read_bytes() + b"\0")
        return h.hexdigest()

    def stage(self, into: Path) -> None:
        for rel in self.files:
            dest = into / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest)


def _ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore as (negated, regex) pairs, Docker's matching: `**` spans folders, `*` not."""
    out = []
    lines = DOCKERIGNORE.read_text().splitlines() if DOCKERIGNORE.exists() else []
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pat = line.removeprefix("!").strip().strip("/")
        rx = ""
        i = 0
        while i < len(pat):
            if pat.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
            elif pat.startswith("**", i):
                rx, i = rx + ".*", i + 2
            elif pat[i] == "*":
                rx, i = rx + "[^/]*", i + 1
            elif pat[i] == "?":
                rx, i = rx + "[^/]", i + 1
            else:
                rx, i = rx + re.escape(pat[i]), i + 1
        out.append((negated, re.compile(rx + r"\Z")))
    return out


def _ignored(rel: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """True if rel or a folder above it matches (the last matching pattern decides)."""
    parts = rel.split("/")
    for n in range(1, len(parts) + 1):
        prefix = "/".join(parts[:n])
        verdict = None
        for negated, rx in patterns:
            if rx.match(prefix):
                verdict = not negated
        if verdict:
            return True
    return False


def copy_sources(dockerfile: str | None = None) -> list[str]:
    """The build-context sources of the Dockerfile's COPY/ADD lines (not COPY --from=)."""
    text = dockerfile if dockerfile is not None else DOCKERFILE.read_text()
    joined = re.sub(r"\\\n", " ", text)
    out: list[str] = []
    for line in joined.splitlines():
        words = line.split()
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from") for w in words[1:]) or len(args) < 2:
            continue
        out += [a.rstrip("/") for a in args[:-1]]
    return out


def build_context() -> Context:
    patterns = _ignore_patterns()
    files = {"Dockerfile"} | ({".dockerignore"} if DOCKERIGNORE.exists() else set())
    for src in copy_sources():
        path = REPO / src
        if not path.exists():
            raise BuildFailed(f"the Dockerfile COPYs {src}, which does not exist")
        found = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for p in found:
            rel = p.relative_to(REPO).as_posix()
            if not _ignored(rel, patterns):
                files.add(rel)
    return Context(tuple(sorted(files)))


def torch_index_url() -> str:
    return os.environ.get("DDILOCO_IMAGE_TORCH_INDEX_URL", DEFAULT_TORCH_INDEX_URL)


def ca_bundle() -> Path | None:
    """The host's CA bundle, lent to the build's RUN steps so that pip trusts what the host
    trusts (a TLS-intercepting proxy in front of PyPI, as here). DDILOCO_IMAGE_CA_BUNDLE
    names another file; empty lends none."""
    value = os.environ.get("DDILOCO_IMAGE_CA_BUNDLE")
    if value is None:
        value = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or HOST_CA_BUNDLE
    path = Path(value) if value else None
    return path.resolve() if path is not None and path.is_file() else None


def build_args(base: str) -> dict[str, str]:
    return {"PYTHON_IMAGE": base, "TORCH_INDEX_URL": torch_index_url()}


def image_key(base: str | None = None, context: Context | None = None) -> str:
    """16 hex digits over the base tag, the build arguments and the build context's files."""
    base = base or base_tag()
    context = context or build_context()
    h = hashlib.sha256(b"ddiloco-image-1\0")
    h.update(json.dumps(build_args(base), sort_keys=True).encode() + b"\0")
    h.update(context.digest().encode())
    return h.hexdigest()[:16]


def image_tag(key: str | None = None) -> str:
    return f"{IMAGE_REPO}:{key or image_key()}"


def ensure_image(progress: Progress | None = None) -> str:
    """The image's tag (localhost/ddiloco:<key>) for the current tree, building it if needed."""
    progress = progress or Progress()
    require_tools("podman")
    base = ensure_base(progress)
    context = build_context()
    tag = image_tag(image_key(base, context))
    if image_exists(tag):
        return tag
    require_tools("podman", "buildah", "runc")
    with _locked("image"):
        if image_exists(tag):
            return tag
        _build_image(tag, base, context, progress)
        _remove_old(IMAGE_REPO, keep=tag, progress=progress, spare=KEEP_IMAGES - 1)
        _prune_dangling(progress)
    return tag


def _build_image(tag: str, base: str, context: Context, progress: Progress) -> None:
    t0 = time.monotonic()
    root = cache_root()
    ctx = Path(tempfile.mkdtemp(prefix="context-", dir=root))
    try:
        context.stage(ctx)
        argv = ["buildah", "bud", "--layers", "--force-rm", "--pull=never", "--runtime", "runc"]
        argv += [*ulimit_args(), "--network", "host"]
        if bundle := ca_bundle():  # RUN steps only; the image keeps its own bundle
            argv += ["--volume", f"{bundle}:/etc/ssl/certs/ca-certificates.crt:ro"]
        for name, value in build_args(base).items():
            argv += ["--build-arg", f"{name}={value}"]
        argv += ["--tag", tag, "--file", str(ctx / "Dockerfile"), str(ctx)]
        progress(f"image {tag}: buildah bud ({len(context.files)} files; log {root}/image.log)")
        _run_logged(
            argv,
            root / "image.log",
            progress,
            re.compile(r"^(STEP \d+/\d+: (FROM|RUN|COPY)|--> Using cache|COMMIT |Successfully)"),
        )
    finally:
        _remove_tree(ctx)
    seconds = time.monotonic() - t0
    size = image_size(tag)
    _write_manifest(
        "image", {"tag": tag, "base": base, "build_seconds": round(seconds, 1), "size": size}
    )
    progress(f"image {tag} built in {seconds:.0f}s, {size / 1e9:.2f} GB")


def _remove_old(repo: str, keep: str, progress: Progress, spare: int = 0) -> None:
    """Remove our tags of `repo` other than `keep`, sparing the `spare` newest of them.

    `podman rmi` of a tag also removes the intermediate images only it used (its own top
    layers); an image still parent of another (an old base) is untagged instead.
    """
    listed = json.loads(
        podman("images", "--format", "json", "--filter", f"reference={repo}").stdout
    )
    others = []
    for img in listed:
        for name in img.get("Names") or []:
            if name.startswith(repo + ":") and name != keep:
                others.append((img.get("Created", 0), img["Id"], name))
    others.sort(reverse=True)
    for _, image_id, name in others[spare:]:
        if podman("rmi", name, check=False).returncode == 0:
            progress(f"removed old {name}")
        elif podman("untag", image_id, name, check=False).returncode == 0:
            progress(f"untagged old {name} (still a parent)")


def _prune_dangling(progress: Progress) -> None:
    """Remove dangling images derived from our bases, made over PRUNE_AFTER_H hours ago:
    the build-only stages' layers of past builds. Recent ones stay, as the layer cache of the
    next build (the wheel stage's pinned setuptools, say)."""
    proc = podman(
        "image", "prune", "--force", "--filter", f"label={BASE_LABEL}",
        "--filter", f"until={PRUNE_AFTER_H}h", check=False,
    )  # fmt: skip
    removed = [ln for ln in proc.stdout.split() if ln]
    if removed:
        progress(f"pruned {len(removed)} dangling image(s) of ours older than {PRUNE_AFTER_H}h")


# --------------------------------------------------------------------------- archive


def save_archive(tag: str, path: Path, progress: Progress | None = None) -> Path:
    """Write `tag` as a docker-archive (for `ctr -n k8s.io images import`, `docker load`).

    Uncompressed, the size of the image. Written next to `path` and renamed into place; its
    manifest.json is checked to name `tag`.
    """
    progress = progress or Progress()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    t0 = time.monotonic()
    try:
        podman("save", "--format", "docker-archive", "--output", str(tmp), tag, timeout=1800)
        with tarfile.open(tmp) as tar:
            member = tar.extractfile("manifest.json")
            assert member is not None
            manifest = json.load(member)
        tags = [t for entry in manifest for t in entry.get("RepoTags") or []]
        if tag not in tags:
            raise BuildFailed(f"{tmp}: manifest.json names {tags}, not {tag}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    progress(
        f"saved {tag} to {path}: {path.stat().st_size / 1e9:.2f} GB in {time.monotonic() - t0:.0f}s"
    )
    return path


# --------------------------------------------------------------------------- command line


def _storage_bytes() -> int:
    out = subprocess.run(
        ["du", "-sxb", "/var/lib/containers/storage"], capture_output=True, text=True, check=False
    ).stdout
    return int(out.split()[0]) if out else -1


def _cmd_build(args: argparse.Namespace) -> int:
    progress = Progress(sys.stdout)
    before = _storage_bytes() if args.du else 0
    try:
        base = ensure_base(progress)
        t_base = progress.elapsed()
        tag = ensure_image(progress)
    except (ToolMissing, BuildFailed) as e:
        print(f"image: {e}", file=sys.stderr)
        return 1
    total = progress.elapsed()
    print(f"base:  {base}  ({image_size(base) / 1e6:.0f} MB; this run {t_base:.1f}s)")
    print(f"image: {tag}  ({image_size(tag) / 1e9:.2f} GB; this run {total - t_base:.1f}s)")
    for name in ("base", "image"):
        if m := read_manifest(name):
            print(f"last {name} build: {m.get('tag')} in {m.get('build_seconds')}s")
    if args.du:
        after = _storage_bytes()
        print(f"/var/lib/containers/storage: {after / 1e9:.2f} GB ({(after - before) / 1e9:+.2f})")
    print(tag)
    return 0


def _cmd_key(_: argparse.Namespace) -> int:
    print(f"base  {base_tag()}")
    print(f"image {image_tag(image_key(base_tag()))}")
    return 0


def _cmd_save(args: argparse.Namespace) -> int:
    progress = Progress(sys.stdout)
    try:
        tag = args.tag or ensure_image(progress)
        save_archive(tag, Path(args.path), progress)
    except (ToolMissing, BuildFailed) as e:
        print(f"image: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="image.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or reuse) the base and the image; print the tag")
    b.add_argument("--du", action="store_true", help="also measure /var/lib/containers growth")
    sub.add_parser("key", help="print the tags the current tree builds")
    s = sub.add_parser("save", help="write a docker-archive of the image")
    s.add_argument("path")
    s.add_argument("--tag", help="image to save (default: build or reuse the current one)")
    args = parser.parse_args(argv)
    return {"build": _cmd_build, "key": _cmd_key, "save": _cmd_save}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
