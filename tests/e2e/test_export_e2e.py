"""The HF config trains under `ddiloco local`, and `ddiloco export` hands the model back.

    pytest tests/e2e/test_export_e2e.py -m e2e

`ddiloco local --model hf:llama-tiny --data docs.jsonl` (two learners, real processes) on a
JSONL corpus cut from the standard library's sources: the global model's eval loss falls.
`ddiloco export --state-dir` of that run loads with `AutoModelForCausalLM.from_pretrained`
and gives the eval loss the launcher's evaluator measured on the synchronizer's own copy at
the end; `ddiloco export --sync-url` against a synchronizer serving the same state writes the
same float32 tensors bit for bit (though it broadcasts bfloat16 to learners), and refuses a
wrong token, or a learner's credential, in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ddiloco.cli import export
from ddiloco.cli.export import from_state_dir
from ddiloco.learner.data import stdlib_files
from ddiloco.learner.sync_client import SyncClient
from ddiloco.learner.task import build_task
from ddiloco.local.processes import Child, ddiloco_command, env_with, free_port, terminate_all
from ddiloco.synchronizer.storage.state import StateStore
from ddiloco.wire.auth import learner_token

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]
TOKEN = "export-token"


def ddiloco(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "ddiloco.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env_with(OMP_NUM_THREADS="1", **env),
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One `ddiloco local` run of hf:llama-tiny on a JSONL corpus; its report and paths."""
    tmp = tmp_path_factory.mktemp("hf-local")
    data = tmp / "docs.jsonl"
    with open(data, "w") as f:
        for source in stdlib_files()[:30]:
            for doc in source.read_text(errors="replace").split("\n\n\n"):
                f.write(json.dumps({"text": doc}) + "\n")
    cache = {"XDG_CACHE_HOME": str(tmp / "cache")}
    out = ddiloco(
        "local",
        "--model",
        "hf:llama-tiny",
        "--data",
        str(data),
        "--learners",
        "2",
        "--max-steps",
        "50",
        "--batch-size",
        "4",
        "-H",
        "8",
        "-P",
        "2",
        "--hot-spares",
        "0",
        "--out",
        str(tmp / "run"),
        "--quiet",
        **cache,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp / "run" / "report.json").read_text())
    return {"tmp": tmp, "data": data, "state": tmp / "run" / "state", "report": report, **cache}


def test_hf_config_trains_under_ddiloco_local(run: dict) -> None:
    r = run["report"]
    assert r["merges"] > 0
    assert r["eval_loss_final"] < r["eval_loss_initial"] - 0.5, (
        r["eval_loss_initial"],
        r["eval_loss_final"],
    )
    model = StateStore(run["state"]).load("model.json")
    assert model["kind"] == "hf" and model["name"] == "hf:llama-tiny"


def test_export_reloads_with_from_pretrained_and_the_same_eval_loss(
    run: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", run["XDG_CACHE_HOME"])
    out = run["tmp"] / "export"
    done = ddiloco("export", "--state-dir", str(run["state"]), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    AutoTokenizer.from_pretrained(out)
    # the eval set and windows every learner and the launcher's evaluator use (batch 4)
    task = build_task(preset="hf:llama-tiny", data=str(run["data"]), batch_size=4, eval_only=True)
    exported = task.eval_loss(model)
    # the synchronizer's own copy, as its state dir holds it
    held = from_state_dir(run["state"])
    params = dict(task.model.named_parameters())
    with torch.no_grad():
        for name, t in held.params.items():
            params[name].copy_(t)
    assert exported == task.eval_loss(task.model)
    final_loss, final_version = run["report"]["eval_history"][-1][1:]
    export_info = json.loads((out / "ddiloco_export.json").read_text())
    assert export_info["global_version"] >= final_version
    if export_info["global_version"] == final_version:  # no merge after the last evaluation
        assert abs(exported - final_loss) < 1e-4, (exported, final_loss)  # the report rounds


def test_export_from_a_live_synchronizer(
    run: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    argv = ddiloco_command("synchronizer", "--port", str(port), "--state-dir", str(run["state"]))
    sync = Child("synchronizer", argv, env_with(DDILOCO_TOKEN=TOKEN), tmp_path / "sync.log")
    url = f"http://127.0.0.1:{port}"
    client = SyncClient(url, TOKEN, timeout=5)
    try:
        sync.start()
        deadline = time.time() + 60
        while not client.healthy():
            assert sync.alive() and time.time() < deadline, sync.log_path.read_text()[-3000:]
            time.sleep(0.1)
        spec = client.model_spec()  # GET /v1/model
        _, broadcast = client.fragment(0)  # what learners download: bfloat16 by default
        assert spec.kind == "hf" and "tokenizer.json" in spec.files
        # in-process `ddiloco export` (the CLI's own main; the state-dir test ran the command)
        monkeypatch.setenv("DDILOCO_TOKEN", TOKEN)
        assert export.main(["--sync-url", url, "--out", str(tmp_path / "live")]) == 0
        capsys.readouterr()
        monkeypatch.setenv("DDILOCO_TOKEN", "not-the-token")
        assert export.main(["--sync-url", url, "--out", str(tmp_path / "w")]) == 2
        wrong = capsys.readouterr().err
        monkeypatch.setenv("DDILOCO_TOKEN", learner_token(TOKEN, "l0"))
        assert export.main(["--sync-url", url, "--out", str(tmp_path / "l")]) == 2
        learner = capsys.readouterr().err
    finally:
        client.close()
        terminate_all([sync])
    assert wrong.startswith("ddiloco export: error: ") and "refused the token" in wrong
    assert wrong.count("\n") == 1 and "Traceback" not in wrong
    assert "HTTP 403" in learner and "needs the job key" in learner and learner.count("\n") == 1
    held = from_state_dir(run["state"])
    served = load_file(str(tmp_path / "live" / "model.safetensors"))
    assert served.keys() == held.params.keys()  # llama-tiny's head is tied: stored once
    # exact: the float32 Theta (GET /v1/fragments/{p}/float32), not the bfloat16 broadcast
    assert all(served[k].dtype == torch.float32 for k in served)
    assert all(torch.equal(served[k], v) for k, v in held.params.items())
    assert all(t.dtype == torch.bfloat16 for t in broadcast.values())
    assert any(not torch.equal(t.float(), served[k]) for k, t in broadcast.items())
