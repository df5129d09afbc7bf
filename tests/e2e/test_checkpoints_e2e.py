"""Checkpoints outside the job, and a new job that resumes from one (synchronizer/checkpoints.py).

    pytest tests/e2e/test_checkpoints_e2e.py -m e2e

A real synchronizer writing a checkpoint every 2 global versions (keeping 2) and a real
learner training hf:llama-tiny: the checkpoints are there, `latest` names the newest, and
it loads with `AutoModelForCausalLM.from_pretrained` holding exactly the outer state's
Theta. A second synchronizer on a fresh state dir with `--init-from` that checkpoint starts
at its Theta, outer momentum and versions before any learner joins; a learner of another
model (the GPT preset tiny) is refused at join in one line naming the checkpoint; a learner
started `--init-from` the checkpoint (a model directory to it too) joins, downloads the
global model and trains, and its init does not replace the checkpoint's state.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ddiloco.learner.data import stdlib_files
from ddiloco.local.processes import terminate_all
from ddiloco.synchronizer import checkpoints
from ddiloco.synchronizer.storage.state import StateStore

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(500)]
MODEL = ("--model", "hf:llama-tiny", "-H", "8", "-P", "2", "--batch-size", "4")


def corpus(path: Path) -> Path:
    with open(path, "w") as f:
        for source in stdlib_files()[:10]:
            for doc in source.read_text(errors="replace").split("\n\n\n"):
                f.write(json.dumps({"text": doc}) + "\n")
    return path


def wait_exit(child: Any, timeout_s: float = 300.0) -> int | None:
    deadline = time.time() + timeout_s
    while child.alive() and time.time() < deadline:
        time.sleep(0.2)
    return child.exit_code()


def outer_state(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted((root / "outer").glob("fragment-*.safetensors")):
        out |= load_file(str(f))
    return out


def test_checkpoints_are_written_load_and_a_new_job_resumes_from_one(
    tmp_path: Path,
    synchronizer_process: Callable[..., Any],
    learner_process: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = corpus(tmp_path / "docs.jsonl")
    dest = tmp_path / "ckpt"
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}

    # ---- the first job: a checkpoint every 2 global versions, the newest 2 kept -------------
    first = tmp_path / "first"
    first.mkdir()
    sync = synchronizer_process(
        first,
        "tok",
        "--no-grace",
        "--quorum",
        "1",
        "--checkpoint-dest",
        str(dest),
        "--checkpoint-every-versions",
        "2",
        "--checkpoint-keep",
        "2",
    )
    learner = learner_process(
        first, sync, 0, 1, *MODEL, "--data", str(data), "--max-steps", "24", **cache
    )
    try:
        sync.start()
        learner.start()
        assert wait_exit(learner) == 0, learner.log_path.read_text()[-3000:]
        client = sync.client()
        status = client.status()
        version = status.global_version
        client.close()
        assert version >= 4, version
        deadline = time.time() + 60  # the last merges' checkpoint, off the merge path
        while True:
            latest = (dest / "latest").read_text().strip() if (dest / "latest").exists() else ""
            if latest and int(checkpoints.NAME.match(latest).group(2)) >= version - 1:
                break
            assert time.time() < deadline, (latest, version, sync.log.read_text()[-3000:])
            time.sleep(0.2)
    finally:
        terminate_all([learner, sync.child])
    log = sync.log.read_text()
    assert "Checkpoint to" not in log, log[-3000:]  # none failed
    names = checkpoints.listed(str(dest))
    written = log.count("Checkpoint 2")  # as many as the merges' pace allowed
    assert len(names) == min(written, 2) and names[-1] == latest, (names, written)
    ckpt = dest / latest
    manifest = json.loads((ckpt / checkpoints.MANIFEST).read_text())
    assert manifest["format_version"] == 1 and manifest["model"]["name"] == "hf:llama-tiny"
    outer = outer_state(ckpt)
    momentum = {k: v for k, v in outer.items() if k.startswith("momentum/")}
    assert any(v.abs().sum() > 0 for v in momentum.values())  # merged: the momentum moved

    # (a) a model directory `from_pretrained` loads, holding the outer state's Theta
    model, info = AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert not any(info.values()), info
    loaded = dict(model.named_parameters())
    thetas = {k[len("param/") :]: v for k, v in outer.items() if k.startswith("param/")}
    assert loaded.keys() == thetas.keys()
    assert all(torch.equal(loaded[k].detach(), v) for k, v in thetas.items())

    # ---- the second job: a fresh state dir, --init-from the checkpoint ---------------------
    second = tmp_path / "second"
    second.mkdir()
    sync2 = synchronizer_process(
        second, "tok2", "--no-grace", "--quorum", "1", "--init-from", str(ckpt)
    )
    wrong = learner_process(second, sync2, 0, 2, "--model", "tiny", "--max-steps", "4", **cache)
    good = learner_process(
        second, sync2, 1, 2, *MODEL, "--data", str(data), "--init-from", str(ckpt), "--max-steps",
        "4", **cache,
    )  # fmt: skip
    try:
        sync2.start()
        client = sync2.client()
        status = client.status()
        assert status.initialized  # before any learner: from the checkpoint
        assert [f.version for f in status.fragments] == [
            f["version"] for f in manifest["fragments"]
        ]
        # Theta and momentum in the new state dir are the checkpoint's, bit for bit
        store = StateStore(second / "state")
        try:
            for f in manifest["fragments"]:
                fs = store.load_fragment(f["index"])
                for name, t in fs.params.items():
                    assert torch.equal(t, outer[f"param/{name}"]), name
                for name, t in fs.momentum.items():
                    assert torch.equal(t, outer[f"momentum/{name}"]), name
                assert fs.high_water == {}
        finally:
            store.close()
        served = {}
        for f in status.fragments:
            served |= client.fragment(f.index)[1]
        # the checkpoint's Theta, in the broadcast's dtype
        assert all(torch.equal(served[k], v.to(served[k].dtype)) for k, v in thetas.items())

        # a learner of another model: refused at join, one line naming the checkpoint
        wrong.start()
        assert wait_exit(wrong, 120) == 2, wrong.log_path.read_text()[-3000:]
        text = wrong.log_path.read_text()
        errors = [x for x in text.splitlines() if "error:" in x]
        assert len(errors) == 1 and errors[0].startswith("ddiloco learner: error: "), errors
        assert str(ckpt) in errors[0] and "layout digest" in errors[0], errors[0]
        assert "Traceback" not in text

        # a learner of the model joins, downloads the global model and trains on it
        good.start()
        assert wait_exit(good) == 0, good.log_path.read_text()[-3000:]
        assert "Initialized the global model" not in good.log_path.read_text()
        after = client.status()
        assert after.global_version >= status.global_version
        client.close()
    finally:
        terminate_all([wrong, good, sync2.child])
    assert "Started from checkpoint " + latest in sync2.log.read_text()
