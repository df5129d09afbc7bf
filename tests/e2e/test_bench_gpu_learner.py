"""bench/gpu_learner.sh without a GPU: it refuses at once, and its CPU dry run does every step.

    .venv/bin/pytest tests/e2e/test_bench_gpu_learner.py

The GPU figures themselves need a CUDA machine (`bash bench/gpu_learner.sh` there); here the
script's two paths that run anywhere are checked on real processes: the one-line refusal
where no CUDA device exists, and `--dry-run` (a tiny hf config on CPU: the config written at
run time, a real `ddiloco learner --model hf:DIR` against a real synchronizer, the
interleaved overhead measurement), whose JSON must carry every figure the GPU run reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e]
ROOT = Path(__file__).resolve().parents[2]


def test_without_cuda_it_stops_at_once_with_one_line() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    env = {**os.environ, "OUT": "/nonexistent-not-used"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_learner.py")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dry_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_learner.sh"), "--dry-run", "--peak-tflops", "1"],
        capture_output=True,
        text=True,
        timeout=220,
        env={**os.environ, "OUT": str(out)},
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "gpu_learner.json").read_text())
    assert res["device"] == "cpu"
    assert res["params"]["total"] > res["params"]["non_embedding"] > 0
    assert res["learner"]["tokens_per_s"] > 0
    assert res["learner"]["mfu"] > 0  # with --peak-tflops, MFU is computed on CPU too
    over = res["overhead"]
    assert over["plain_tokens_per_s"] > 0 and over["wrapped_tokens_per_s"] > 0
    assert over["wrapper_stats"]["handovers"] > 0
    assert "overhead" in over and "wrapped_mfu" in over
    # the config was written from the shipped one, with the dry run's dimensions
    config = json.loads((out / "run" / "model" / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2
