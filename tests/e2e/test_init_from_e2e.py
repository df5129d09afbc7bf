"""`ddiloco local --init-from EXPORT`: a job starts from a previous job's exported model.

    pytest tests/e2e/test_init_from_e2e.py -m e2e

A GPT 'tiny' is trained in this process for a few dozen steps and written by `ddiloco
export`'s own writer (cli/export.py `write`: model.safetensors + config.json naming the
preset). `ddiloco local` then runs two learners (real processes) from it, stopping before
any fragment is handed over, so the synchronizer still holds the job's initial model at the
end: exported from its state dir, it is the given export tensor for tensor, and the
launcher's evaluator measured the export's eval loss as the job's initial one, well below a
seeded init's. An export of another preset is refused before anything starts, in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ddiloco.cli import export
from ddiloco.learner import hf
from ddiloco.learner.data import stdlib_files
from ddiloco.learner.task import build_task
from ddiloco.local.processes import env_with

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]


def ddiloco(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "ddiloco.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env_with(OMP_NUM_THREADS="1", **env),
    )


def test_a_local_job_starts_from_an_export(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    data = tmp_path / "text.txt"
    data.write_bytes(b"\n".join(p.read_bytes() for p in stdlib_files()[:6]))
    task = build_task(preset="tiny", data=str(data), batch_size=8, seed=0)
    seeded_loss = task.eval_loss(task.model)
    opt = torch.optim.AdamW(task.model.parameters(), lr=3e-3)
    for _ in range(60):
        task.loss_fn(task.model, *next(task.batches)).backward()
        opt.step()
        opt.zero_grad()
    params = {k: v.detach().clone() for k, v in task.model.named_parameters()}
    out = export.write(
        export.GlobalModel(params, [7, 7], hf.model_spec("tiny"), "a previous job"),
        tmp_path / "previous",
    )
    trained = load_file(str(out / "model.safetensors"))
    check = build_task(preset="tiny", data=str(data), batch_size=4, init_from=str(out))
    trained_loss = check.eval_loss(check.model)  # the learners' eval set and batch
    assert trained_loss < seeded_loss - 0.5, (trained_loss, seeded_loss)

    run = tmp_path / "run"
    # H 24, P 2: fragment 1 falls due at step 12, fragment 0 at 24; 8 steps hand none over
    done = ddiloco(
        "local", "--model", "tiny", "--init-from", str(out), "--data", str(data),
        "--learners", "2", "--max-steps", "8", "-H", "24", "-P", "2", "--batch-size", "4",
        "--hot-spares", "0", "--out", str(run), "--quiet",
        XDG_CACHE_HOME=str(tmp_path / "cache"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((run / "report.json").read_text())
    assert abs(report["eval_loss_initial"] - trained_loss) < 1e-5, report["eval_loss_initial"]
    again = ddiloco("export", "--state-dir", str(run / "state"), "--out", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr[-3000:]
    info = json.loads((tmp_path / "again" / "ddiloco_export.json").read_text())
    assert info["versions"] == [0, 0]  # nothing merged: the job's initial model
    initial = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert initial.keys() == trained.keys()
    assert all(torch.equal(initial[k], trained[k]) for k in trained)

    wrong = ddiloco(
        "local", "--model", "small", "--init-from", str(out), "--out", str(tmp_path / "no")
    )
    assert wrong.returncode == 2, wrong.stderr[-3000:]
    assert wrong.stderr.startswith("ddiloco local: error: --init-from ")
    assert wrong.stderr.count("\n") == 1 and "block_size is 64" in wrong.stderr, wrong.stderr
    assert not (tmp_path / "no" / "report.json").exists()
