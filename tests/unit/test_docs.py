"""The docs a newcomer reads hold: every relative link resolves, every runnable command runs.

    pytest tests/unit/test_docs.py

A fenced ```bash block is runnable when the line before its fence is `<!-- runnable -->`:
mark only cheap, self-contained commands (no network, no long training, no cluster). Each runs
with `bash -euo pipefail` in a fresh temporary directory, the venv's bin first on PATH, and a
timeout. The two big commands (the `ddiloco local` run and `bash tests/run.sh`) are not marked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = "<!-- runnable -->"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)


def relative_links(doc: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)  # not inside code
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


def runnable_blocks(doc: Path) -> list[str]:
    text = doc.read_text()
    return [
        m[1]
        for m in FENCE.finditer(text)
        if text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip() == MARK
    ]


def test_the_docs_exist_and_are_short_enough_to_read() -> None:
    names = {d.name for d in DOCS}
    assert {"README.md", "design.md", "operations.md", "protocol.md"} <= names
    assert len((ROOT / "README.md").read_text().splitlines()) < 300


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_relative_link_resolves(doc: Path) -> None:
    missing = [
        target
        for target in relative_links(doc)
        if not (doc.parent / target.split("#", 1)[0]).exists()
    ]
    assert not missing, f"{doc.relative_to(ROOT)} links to nothing: {missing}"


def test_some_blocks_are_marked_runnable() -> None:
    assert sum(len(runnable_blocks(d)) for d in DOCS) >= 2


@pytest.mark.parametrize(
    ("doc", "block"),
    [(d, b) for d in DOCS for b in runnable_blocks(d)],
    ids=lambda x: x.name if isinstance(x, Path) else x.strip().splitlines()[0][:40],
)
def test_every_runnable_block_runs(doc: Path, block: str, tmp_path: Path) -> None:
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("DDILOCO_TOKEN", None)
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, f"{doc.name}:\n{block}\n{run.stdout}\n{run.stderr}"
