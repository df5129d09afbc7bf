"""The container image, for real: built from the Dockerfile (tests/integration/image.py) and run
in podman containers, no Docker and no registry.

    python tests/integration/image.py build     # once per change (cold ~20 min; warm seconds)
    .venv/bin/pytest tests/integration/test_image.py

The fixture builds the image itself if the current tree's tag is missing (layer caching keeps
that to the project's own layer unless torch or the dependencies changed). Containers run with
`--runtime runc` and explicit ulimits (cgroup v1 here). A missing podman/buildah/debootstrap
fails the tests with the tool's name: nothing here is skipped.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddiloco.learner.sync_client import SyncClient
from ddiloco.local.processes import free_port

if "image" not in sys.modules:  # --import-mode=importlib: load the harness by path, once
    _spec = importlib.util.spec_from_file_location("image", Path(__file__).with_name("image.py"))
    assert _spec is not None and _spec.loader is not None
    sys.modules["image"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["image"])
import image  # registered by path just above

BUILD_TIMEOUT_S = 3600  # a cold build downloads torch from PyPI (~3 GB); a safety net only
RUN_TIMEOUT_S = 180
UID = 10001

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT_S)]


@pytest.fixture(scope="session")
def built_image() -> str:
    """The tag of the image for the current tree (built now if missing)."""
    try:
        return image.ensure_image()
    except (image.ToolMissing, image.BuildFailed) as e:
        pytest.fail(f"image: {e}", pytrace=False)


def run(
    tag: str,
    *args: str,
    entrypoint: str | None = None,
    opts: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`podman run --rm` of the image, waited for; stdout and stderr captured."""
    argv = ["podman", "run", "--rm", "--runtime", "runc", *image.ulimit_args(), *opts]
    if entrypoint is not None:
        argv += ["--entrypoint", entrypoint]
    return subprocess.run(
        [*argv, tag, *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=env,
        check=False,
    )


def test_ddiloco_help_exits_zero(built_image: str) -> None:
    proc = run(built_image, "--help")
    assert proc.returncode == 0, proc.stderr
    for name in ("synchronizer", "learner", "operator"):
        assert name in proc.stdout, proc.stdout
    default = run(built_image)  # CMD ["--help"]
    assert default.returncode == 0 and default.stdout == proc.stdout, default.stderr
    sub = run(built_image, "operator", "--help")
    assert sub.returncode == 0, sub.stderr


def test_runs_as_10001_and_writes_home_and_an_fsgroup_volume(
    built_image: str, tmp_path: Path
) -> None:
    # Like a volume under `fsGroup: 10001`: root-owned, group 10001, setgid, nothing for others.
    vol = tmp_path / "vol"
    vol.mkdir()
    os.chown(vol, 0, UID)
    vol.chmod(0o2770)
    script = (
        'set -e; id -u; id -g; echo "$HOME"; '
        'echo home > "$HOME/probe"; cat "$HOME/probe"; '
        "echo data > /data/probe; ls -ln /data/probe; "
        "if touch /etc/probe 2>/dev/null; then echo root-writable; fi"
    )
    proc = run(built_image, "-c", script, entrypoint="sh", opts=("-v", f"{vol}:/data"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:4] == [str(UID), str(UID), "/home/ddiloco", "home"], lines
    assert "root-writable" not in lines, "uid 10001 could write /etc"
    written = vol / "probe"
    assert written.read_text() == "data\n"
    st = written.stat()
    assert (st.st_uid, st.st_gid) == (UID, UID), (st.st_uid, st.st_gid)


TRAIN = """
import torch, ddiloco.learner.train
torch.manual_seed(0)
x = torch.randn(64, 8)
y = x @ torch.randn(8, 1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
losses = []
for _ in range(20):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    losses.append(loss.item())
print(torch.__version__, torch.cuda.is_available(), losses[0], losses[-1])
"""


def test_torch_trains_on_cpu_without_network(built_image: str) -> None:
    proc = run(built_image, "-c", TRAIN, entrypoint="python", opts=("--network", "none"))
    assert proc.returncode == 0, proc.stderr
    version, cuda, first, last = proc.stdout.split()
    assert version.startswith("2."), version
    assert cuda == "False"
    assert float(last) < float(first) * 0.5, (first, last)


def test_installed_package_is_the_working_tree(built_image: str) -> None:
    """The tag's key and the layer cache never serve stale sources: every installed module of
    ddiloco has the bytes of its file in this tree."""
    package_dir = tomllib.loads((image.REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    script = (
        "import hashlib, importlib, json, pathlib\n"
        f"out = {{}}\nfor pkg in {sorted(package_dir)!r}:\n"
        "    root = pathlib.Path(importlib.import_module(pkg).__file__).parent\n"
        "    for f in sorted(root.rglob('*.py')):\n"
        "        out[pkg + '/' + f.relative_to(root).as_posix()] = "
        "hashlib.sha256(f.read_bytes()).hexdigest()\n"
        "print(json.dumps(out))\n"
    )
    proc = run(built_image, "-c", script, entrypoint="python", opts=("--network", "none"))
    assert proc.returncode == 0, proc.stderr
    installed = json.loads(proc.stdout)
    expected = {}
    for pkg, folder in package_dir.items():
        for f in sorted((image.REPO / folder).rglob("*.py")):
            key = f"{pkg}/{f.relative_to(image.REPO / folder).as_posix()}"
            expected[key] = hashlib.sha256(f.read_bytes()).hexdigest()
    assert installed == expected, sorted(set(installed.items()) ^ set(expected.items()))[:5]


@pytest.fixture
def sync_container(built_image: str) -> Iterator[tuple[str, str, str]]:
    """`ddiloco synchronizer` in a container on the host's network: (name, url, token)."""
    name = f"ddiloco-test-sync-{uuid.uuid4().hex[:8]}"
    port = free_port()
    token = secrets.token_hex(16)
    argv = ["podman", "run", "--detach", "--rm", "--name", name, "--runtime", "runc"]
    argv += [*image.ulimit_args(), "--network", "host"]
    # The token's value reaches podman through its environment, never its argv.
    argv += ["--env", "DDILOCO_TOKEN", "--env", "DDILOCO_HOST=127.0.0.1"]
    argv += ["--env", f"DDILOCO_PORT={port}", "--env", "DDILOCO_STATE_DIR=/home/ddiloco/state"]
    argv += [built_image, "synchronizer", "--quorum", "1"]
    env = {**os.environ, "DDILOCO_TOKEN": token}
    started = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)
    assert started.returncode == 0, started.stderr
    try:
        yield name, f"http://127.0.0.1:{port}", token
    finally:
        subprocess.run(["podman", "stop", "--time", "10", name], capture_output=True, timeout=60)
        subprocess.run(["podman", "rm", "--force", name], capture_output=True, timeout=60)


def _logs(name: str) -> str:
    proc = subprocess.run(["podman", "logs", name], capture_output=True, text=True, timeout=30)
    return (proc.stdout + proc.stderr)[-3000:]


def _running(name: str) -> bool:
    proc = subprocess.run(
        ["podman", "container", "inspect", "--format", "{{.State.Running}}", name],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return proc.stdout.strip() == "true"


def test_synchronizer_serves_in_a_container(sync_container: tuple[str, str, str]) -> None:
    name, url, token = sync_container
    client = SyncClient(url, token, timeout=5)
    deadline = time.monotonic() + 120  # safety net: startup imports numpy and fastapi
    while not client.healthy():
        assert _running(name), f"the synchronizer container exited:\n{_logs(name)}"
        assert time.monotonic() < deadline, f"no /healthz answer from {url}:\n{_logs(name)}"
        time.sleep(0.5)
    status = client.status()  # h2c (pycurl, prior knowledge), with the bearer token
    assert status.initialized is False and status.global_version == 0, status
    with urllib.request.urlopen(f"{url}/healthz", timeout=10) as resp:  # HTTP/1.1
        assert resp.status == 200 and json.load(resp) == {"status": "ok"}
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{url}/v1/status", timeout=10)
    assert refused.value.code == 401
    uid = subprocess.run(
        ["podman", "exec", name, "id", "-u"], capture_output=True, text=True, timeout=30
    )
    assert uid.stdout.strip() == str(UID), uid.stderr


def test_image_metadata(built_image: str) -> None:
    info = image.inspect(built_image)
    labels = info["Labels"] or info["Config"]["Labels"]
    assert labels["org.opencontainers.image.title"] == "ddiloco"
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.source"].startswith("https://")
    assert labels["dev.ddiloco.torch-flavor"] == "cpu"
    assert labels[image.BASE_LABEL] == image.base_key()
    config = info["Config"]
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"] == ["ddiloco"]
    assert {"8470/tcp", "8080/tcp"} <= set(config["ExposedPorts"])
    assert f"HOME=/home/{'ddiloco'}" in config["Env"]
    assert built_image == image.image_tag(image.image_key(image.base_tag()))
