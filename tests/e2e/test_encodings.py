"""Update encodings end to end: real synchronizer and learner processes on loopback.

    .venv/bin/pytest -q tests/e2e/test_encodings.py -m e2e

A learner configured for int4 against a synchronizer configured for bfloat16 stops at join
with one line and exit 2; a raw int4 POST to it is refused 415 with a detail naming both
encodings. `ddiloco local --update-encoding int4` trains: versions advance, the eval loss is
finite and falls, and the synchronizer counted int4 bytes only (its bytes per token are
printed; bench/encoding_study.py compares them with bfloat16's and data-parallel's).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ddiloco.learner.sync_client import SyncRefused
from ddiloco.local.processes import terminate_all
from ddiloco.wire import codec, encodings
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]


def test_an_int4_learner_is_refused_by_a_bfloat16_synchronizer(
    tmp_path: Path,
    synchronizer_process: Callable[..., Any],
    learner_process: Callable[..., Any],
) -> None:
    sync = synchronizer_process(tmp_path, "tok", "--update-encoding", "bfloat16")
    learner = learner_process(tmp_path, sync, 0, 1, "--update-encoding", "int4", "--max-steps", "5")
    try:
        sync.start()
        learner.start()
        deadline = time.time() + 120
        while learner.alive() and time.time() < deadline:
            time.sleep(0.2)
        assert learner.exit_code() == 2, learner.log_path.read_text()[-3000:]
        lines = [x for x in learner.log_path.read_text().splitlines() if x.strip()]
        errors = [x for x in lines if "error:" in x]
        assert len(errors) == 1, lines[-20:]
        assert errors[0].startswith("ddiloco learner: error: ")
        assert "accepts update encodings bfloat16" in errors[0] and "is int4" in errors[0]
        assert "Traceback" not in learner.log_path.read_text()

        # a raw POST of an int4 update is refused 415, before anything is written
        client = sync.client()
        client.join(JoinRequest(learner_id="raw"))
        spec = FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[256])])
        layout = Layout(fragments=[spec])
        client.init(codec.encode({"w": torch.zeros(256)}, {LAYOUT_KEY: layout.model_dump_json()}))
        meta = UpdateMeta(
            learner_id="raw", fragment=0, base_version=0, steps=1, tokens=8, learner_step=1
        )
        payload, _ = encodings.encode_update({"w": torch.randn(256) * 1e-3}, meta, "int4", 128)
        with pytest.raises(SyncRefused) as e:
            client.post_update(0, payload)
        assert (e.value.status, e.value.kind) == (415, "unsupported_encoding")
        assert "this synchronizer accepts bfloat16; the update is int4" in str(e.value)
        status = client.status()
        assert status.refusals.get("unsupported_encoding") == 1
        assert [f.contributors_pending for f in status.fragments] == [0]
        bf16, _ = encodings.encode_update({"w": torch.randn(256) * 1e-3}, meta, "bfloat16", 128)
        assert client.post_update(0, bf16).status == "accepted"  # the one it was set up for
        client.close()
    finally:
        terminate_all([learner, sync.child])


def test_local_int4_run_trains_and_sends_int4_only(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-P", "-m", "ddiloco.cli.main", "local", "--learners", "2"]
    cmd += ["--max-steps", "48", "--update-encoding", "int4", "--hot-spares", "0"]
    cmd += ["--learner-metrics", "--out", str(out), "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads((out / "report.json").read_text())
    assert r["config"]["update_encoding"] == "int4"
    assert r["global_version"] >= 4 and r["merges"] >= 4
    final, initial = r["eval_loss_final"], r["eval_loss_initial"]
    assert final == final and final < 0.8 * initial  # finite, and it learned
    scrape = (out / "metrics" / "synchronizer.prom").read_text()
    received = {
        line.split('encoding="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in scrape.splitlines()
        if line.startswith("ddiloco_bytes_received_total{")
    }
    assert received.get("int4", 0) > 0 and received.get("bf16", 0) == 0, received
    assert set(received) == {"int4"}
    print(
        f"int4: {r['bytes_up'] / r['tokens_computed']:.2f} bytes up per token computed "
        f"({r['bytes_up']} bytes, {r['tokens_computed']} tokens)"
    )
