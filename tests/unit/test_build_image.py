"""deploy/build-image.sh: the one command a user builds (and pushes) the image with.

The build itself is the Dockerfile's (tests/integration/test_image.py builds it for real); here,
with --dry-run, the commands the script would run: the tag the user names, the CUDA variant
by one flag, the push only when asked, and a clear refusal of a flavour that is not one.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "build-image.sh"


def dry(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "DDILOCO_IMAGE_TOOL": "docker"}
    return subprocess.run(
        ["bash", str(SCRIPT), *args, "--dry-run"], capture_output=True, text=True, env=env
    )


def test_cpu_by_default_and_no_push_unless_asked() -> None:
    out = dry("registry.example.com/ml/ddiloco:0.1.0")
    assert out.returncode == 0, out.stderr
    (build,) = out.stdout.splitlines()
    assert build.startswith("+ docker build -t registry.example.com/ml/ddiloco:0.1.0 ")
    assert "--build-arg TORCH_FLAVOR=cpu" in build and build.endswith(str(SCRIPT.parents[1]))


def test_the_cuda_variant_is_one_flag_and_push_pushes_that_tag() -> None:
    out = dry("r.example.com/ddiloco:0.1.0-cuda", "--cuda", "cu128", "--push")
    assert out.returncode == 0, out.stderr
    build, push = out.stdout.splitlines()
    assert "--build-arg TORCH_FLAVOR=cu128" in build
    assert push == "+ docker push r.example.com/ddiloco:0.1.0-cuda"


def test_bad_arguments_are_refused_with_exit_2() -> None:
    bad = dry("ddiloco:1", "--cuda", "fp8")
    assert bad.returncode == 2 and "--cuda fp8: give a CUDA wheel flavour" in bad.stderr
    assert dry("--push").returncode == 2
    assert dry("ddiloco:1", "--colour").returncode == 2
