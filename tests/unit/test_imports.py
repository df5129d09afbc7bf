"""`ddiloco.<component>` always; the standard library keeps its own `operator`; the wire
library and the learner side stand without the synchronizer.

    pytest tests/unit/test_imports.py

Checked in fresh interpreters, from the repository root (where a folder named `operator`
sits on sys.path) and from elsewhere, for the editable install of this checkout and for a
wheel built from it. Also: torch's fresh re-import of `operator` (torch._dynamo does one
when an optimizer is built) still gets the standard library's. And every module of
`ddiloco.wire` and `ddiloco.learner` imports without loading any of `ddiloco.synchronizer`
(both sides speak the wire library; the learner's clients are the learner's), and the
job-status readers (the operator's, the CLI's) load no torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STDLIB_OPERATOR = str(Path(sysconfig.get_path("stdlib")) / "operator.py")

PROBE = f"""
import sys, operator
assert operator.__file__ == {STDLIB_OPERATOR!r}, operator.__file__
assert operator.add(2, 3) == 5 and operator.itemgetter(1)([0, 9]) == 9
import ddiloco.operator, ddiloco.learner, ddiloco.synchronizer
assert ddiloco.operator.__name__ == "ddiloco.operator"
from test.support.import_helper import import_fresh_module
fresh = import_fresh_module("operator", blocked=["_operator"])
assert fresh.__file__ == {STDLIB_OPERATOR!r}, fresh.__file__
assert fresh.add(1, 2) == 3
for bare in ("learner", "synchronizer"):
    try:
        __import__(bare)
    except ImportError:
        pass
    else:
        raise AssertionError(bare + " is importable under its bare name")
print("ok", ddiloco.synchronizer.__file__)
"""


def run_probe(cwd: Path, env_path: str | None = None) -> str:
    env = {"PATH": "/usr/bin:/bin"}
    if env_path:
        env["PYTHONPATH"] = env_path
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_editable_install(where: str, tmp_path: Path) -> None:
    out = run_probe(ROOT if where == "root" else tmp_path)
    assert out.startswith("ok") and str(ROOT / "synchronizer") in out


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    wheels = list(dist.glob("decoupled_diloco-*.whl"))
    assert len(wheels) == 1
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(site),
            str(wheels[0]),
        ],
        check=True,
        timeout=300,
    )
    assert not (site / "operator").exists() and not (site / "learner").exists()
    assert (site / "ddiloco" / "operator" / "__init__.py").is_file()
    return site


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_wheel_install(where: str, wheel_site: Path, tmp_path: Path) -> None:
    # The wheel's ddiloco must win over the editable one: put it first on sys.path.
    deps = [p for p in sys.path if p.endswith("site-packages")]
    out = run_probe(ROOT if where == "root" else tmp_path, ":".join([str(wheel_site), *deps]))
    assert out.startswith("ok") and str(wheel_site) in out


SIDES = """
import importlib, pkgutil, sys
import ddiloco.learner, ddiloco.wire
for pkg in (ddiloco.wire, ddiloco.learner):
    for m in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(pkg.__name__ + "." + m.name)
assert "ddiloco.learner.sync_client" in sys.modules and "ddiloco.wire.broadcast" in sys.modules
print(sorted(n for n in sys.modules if n.split(".")[:2] == ["ddiloco", "synchronizer"]))
"""

STATUS_ONLY = """
import sys
from ddiloco.wire.job_status import merge_statuses
from ddiloco.wire.protocol import Status
print(sorted(n for n in sys.modules if n.split(".")[0] == "torch"))
"""


def fresh(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_wire_and_learner_import_no_synchronizer() -> None:
    assert fresh(SIDES) == "[]"


def test_job_status_imports_no_torch() -> None:
    assert fresh(STATUS_ONLY) == "[]"
