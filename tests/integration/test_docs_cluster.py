"""The docs' Kubernetes commands run, against the test control plane.

    .venv/bin/pytest tests/integration/test_docs_cluster.py

A fenced ```bash block whose line before the fence is `<!-- runnable: cluster -->` (README.md,
docs/*.md) runs here with `bash -euo pipefail`, from the repository root, with kubectl and
helm of the test control plane first on PATH and a kubeconfig for its home cluster whose
current namespace is a fresh one; `REG` names a registry, as the docs tell the reader to set
it. The block's install namespace (`ddiloco-system`) becomes a fresh name, so that a run never
meets another's; the release is uninstalled and both namespaces deleted afterwards. kwok plays
the nodes: the operator's pod turns Ready, a job validates and is stored; pods that need a
kubelet (`helm test`) are left to the real-node tests. tests/unit/test_docs.py runs the blocks
that need no cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from operator_helpers import crd_fixture  # noqa: F401  (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = "<!-- runnable: cluster -->"
FENCE = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
INSTALL_NS = "ddiloco-system"


def cluster_blocks(doc: Path) -> list[str]:
    text = doc.read_text()
    return [
        m[1]
        for m in FENCE.finditer(text)
        if text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip() == MARK
    ]


BLOCKS = [(d, b) for d in DOCS for b in cluster_blocks(d)]


def test_the_docs_mark_their_cluster_commands() -> None:
    assert {d.name for d, _ in BLOCKS} >= {"README.md", "operations.md"}


@pytest.mark.parametrize(
    ("doc", "block"),
    BLOCKS,
    ids=[f"{d.name}:{b.strip().splitlines()[0][:30]}" for d, b in BLOCKS],
)
def test_every_cluster_block_runs(
    k8s: Any, k8s_namespace: str, crd_installed: None, tmp_path: Path, doc: Path, block: str
) -> None:
    """`crd_installed`: the CRD as the other tests apply it (server-side), so that helm meets
    it installed and leaves it alone, as on a cluster where it already is."""
    home = k8s.clusters["home"]
    kubeconfig = tmp_path / "kubeconfig"
    shutil.copyfile(home.kubeconfig, kubeconfig)
    bindir = Path(shutil.which("kubectl") or "kubectl").parent
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
        "REG": "registry.example.com/ml",
    }
    kubectl = ["kubectl", "--kubeconfig", str(kubeconfig)]
    subprocess.run([*kubectl, "config", "set-context", "--current", f"--namespace={k8s_namespace}"],
                   check=True, capture_output=True, env=env)  # fmt: skip
    install_ns = f"ddiloco-docs-{uuid.uuid4().hex[:6]}"
    script = block.replace(INSTALL_NS, install_ns)
    try:
        run = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, f"{doc.name}:\n{script}\n{run.stdout}\n{run.stderr}"
        if "kubectl apply" in script and "--dry-run" not in script:
            got = subprocess.run([*kubectl, "get", "ddj", "-o", "name"], env=env,
                                 capture_output=True, text=True, check=True)  # fmt: skip
            assert got.stdout.strip(), "the block applied no job"
    finally:
        subprocess.run(["helm", "uninstall", "ddiloco", "-n", install_ns, "--wait",
                        "--timeout", "60s", "--kubeconfig", str(kubeconfig)],
                       env=env, capture_output=True, timeout=120, check=False)  # fmt: skip
        subprocess.run([*kubectl, "delete", "ddj", "--all", "--wait=false"], env=env,
                       capture_output=True, timeout=60, check=False)  # fmt: skip
        subprocess.run([*kubectl, "delete", "namespace", install_ns, "--wait=false"], env=env,
                       capture_output=True, timeout=60, check=False)  # fmt: skip
