"""The opt-in kind end-to-end run (tests/kind/e2e.sh), and its skip path.

    DDILOCO_KIND_E2E=1 .venv/bin/pytest tests/kind -s     # needs Docker, kind, helm, kubectl

Without DDILOCO_KIND_E2E=1 the end-to-end test skips with that instruction (CI has no Docker
engine); the skip-path test always runs and needs nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "e2e.sh"


def test_kind_config_is_one_schedulable_node() -> None:
    cfg = yaml.safe_load((HERE / "kind-config.yaml").read_text())
    assert cfg["kind"] == "Cluster" and cfg["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    assert [n["role"] for n in cfg["nodes"]] == ["control-plane"]
    assert "--config tests/kind/kind-config.yaml" in SCRIPT.read_text()


@pytest.mark.parametrize(("required", "rc"), [("0", 0), ("1", 1)])
def test_without_docker_it_says_so_and_skips(tmp_path: Path, required: str, rc: int) -> None:
    # A PATH with only what the script needs before its checks: no docker, kind or helm.
    for tool in ("dirname",):
        found = shutil.which(tool)
        assert found is not None
        (tmp_path / tool).symlink_to(found)
    bash = shutil.which("bash")
    assert bash is not None
    proc = subprocess.run(
        [bash, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": str(tmp_path), "DDILOCO_KIND_REQUIRED": required},
    )
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert proc.stdout.startswith("SKIP tests/kind/e2e.sh: docker is not installed"), proc.stdout


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_kind_end_to_end() -> None:
    if os.environ.get("DDILOCO_KIND_E2E") != "1":
        pytest.skip(
            "opt-in: DDILOCO_KIND_E2E=1 runs tests/kind/e2e.sh (Docker engine, kind, helm, kubectl)"
        )
    proc = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=1800, check=False
    )
    if proc.returncode == 0 and proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "kind e2e: PASSED" in proc.stdout
