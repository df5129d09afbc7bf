"""`ddiloco prepare`, then real learners that train from the prepared dataset and resume it.

    pytest tests/e2e/test_prepare_e2e.py -m e2e

A JSONL and a Parquet file cut from the standard library's sources are prepared with the
shipped llama-tiny tokenizer (the real CLI, a subprocess); a real synchronizer and a real
`ddiloco learner --model hf:llama-tiny --data <prepared>` train from it. The learner is
SIGKILLed mid-run and a replacement takes the slot: it must start at the position the
synchronizer recorded and draw none of the windows its predecessor drew (the same evidence
as test_resume_data.py: the DEBUG lines of every batch drawn). Then the refusals, each one
line: a model whose vocabulary is too small for the dataset's tokenizer, another
`--tokenizer`, a missing data path, an object store nobody listens on, and prepare's own.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ddiloco.learner import hf
from ddiloco.learner.data import stdlib_files
from ddiloco.local.processes import terminate_all
from tests.e2e.conftest import ddiloco_run as run
from tests.e2e.conftest import one_line_error
from tests.e2e.test_resume_data import draws, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
TOKENIZER = str(hf.SHIPPED["llama-tiny"])


def corpus(root: Path) -> Path:
    """A directory with a JSONL and a Parquet file of stdlib source paragraphs."""
    docs = [
        doc
        for source in stdlib_files()[:40]
        for doc in source.read_text(errors="replace").split("\n\n\n")
        if doc.strip()
    ]
    root.mkdir()
    half = len(docs) // 2
    with open(root / "a.jsonl", "w") as f:
        for doc in docs[:half]:
            f.write(json.dumps({"text": doc}) + "\n")
    pq.write_table(pa.table({"text": docs[half:]}), root / "b.parquet")
    return root


def test_learners_train_from_a_prepared_dataset_and_a_replacement_resumes_it(
    tmp_path: Path, synchronizer_process: Callable, learner_process: Callable
) -> None:
    source = corpus(tmp_path / "corpus")
    prep = tmp_path / "prepared"
    done = run("prepare", str(source), "--out", str(prep), "--tokenizer", TOKENIZER)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MB/s" in done.stdout
    manifest = json.loads((prep / "manifest.json").read_text())
    assert manifest["tokenizer"].startswith("hf-") and manifest["vocab_size"] == 258
    assert manifest["eval"]["tokens"] > 0 and sum(c["tokens"] for c in manifest["chunks"]) > 0
    # small chunks for the job's two slots
    prep2 = tmp_path / "prepared2"
    done = run(
        "prepare",
        str(source),
        "--out",
        str(prep2),
        "--tokenizer",
        TOKENIZER,
        "--chunk-tokens",
        "20000",
        "--quiet",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(json.loads((prep2 / "manifest.json").read_text())["chunks"]) >= 2

    sync = synchronizer_process(tmp_path, "prep-token", "--no-grace")
    flags = ["--model", "hf:llama-tiny", "--tokenizer", TOKENIZER, "--data", str(prep2)]
    flags += ["--batch-size", "4", "-H", "8", "-P", "2", "--max-steps", "1000000"]
    flags += ["--log-level", "DEBUG"]
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}  # a tokenizing learner would write here
    first = learner_process(tmp_path / "first", sync, 0, 2, *flags, **env)
    second = learner_process(tmp_path / "second", sync, 0, 2, *flags, **env)
    client = sync.client()

    def recorded() -> int:
        rows = [r for r in client.status().learners if r.learner_id == "l0"]
        return rows[0].data_position if rows else 0

    try:
        sync.start()
        first.start()
        wait_for("40 batches", lambda: len(draws(first.log_path)) >= 40, first, 120)
        wait_for("a reported reservation", lambda: recorded() > 32 + 40 * 4, first)
        first.kill()
        trained = draws(first.log_path)
        position = recorded()
        assert position >= max(hi for _, hi, _ in trained)
        second.start()
        wait_for("the replacement's batches", lambda: len(draws(second.log_path)) >= 5, second)
        second.stop()
    finally:
        client.close()
        terminate_all([first, second, sync.child])

    first_log = first.log_path.read_text()
    assert f"prepared dataset {prep2}" in first_log  # opened by its manifest
    assert "tokenized" not in first_log  # nothing was tokenized at start
    assert not (tmp_path / "cache" / "ddiloco" / "tokens").exists()
    seen = {w for _, _, windows in trained for w in windows}
    resumed = draws(second.log_path)
    assert resumed[0][0] == position  # where the synchronizer counted the slot
    assert not seen & {w for _, _, windows in resumed for w in windows}  # nothing retrained
    assert [b[0] for b in resumed[:5]] == [position + 4 * i for i in range(5)]
    steps = [json.loads(x) for x in (tmp_path / "first" / "l0.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if "dt" in r]  # the step records
    assert losses and all(0 < x < 20 for x in losses)


def test_refusals_are_one_line(tmp_path: Path) -> None:
    source = corpus(tmp_path / "corpus")
    prep = tmp_path / "prepared"
    done = run("prepare", str(source), "--out", str(prep), "--tokenizer", TOKENIZER, "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    learner = ["learner", "--sync-url", "http://127.0.0.1:9", "--learner-id", "l0"]
    token = {"DDILOCO_TOKEN": "t"}

    line = one_line_error(
        run(*learner, "--data", str(prep), "--model", "tiny", env=token), "learner", 2
    )
    assert "258 ids" in line and "vocab_size is 256" in line and "hf-" in line
    bytes_prep = tmp_path / "bytes"
    assert run("prepare", str(source), "--out", str(bytes_prep), "--quiet").returncode == 0
    line = one_line_error(
        run(
            *learner,
            "--data",
            str(bytes_prep),
            "--model",
            "hf:llama-tiny",
            "--tokenizer",
            TOKENIZER,
            env=token,
        ),
        "learner",
        2,
    )
    assert "bytes-v1" in line and "--tokenizer is hf-" in line
    line = one_line_error(run(*learner, "--data", str(tmp_path / "gone"), env=token), "learner", 2)
    assert str(tmp_path / "gone") in line

    (prep / "manifest.json").unlink()  # as if its writer had died before the end
    line = one_line_error(run(*learner, "--data", str(prep), env=token), "learner", 2)
    assert "no manifest.json" in line

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    s3 = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s3-secret-value",
        "AWS_REGION": "us-east-1",
    }
    start = time.monotonic()
    done = run(*learner, "--data", "s3://bucket/corpus", env={**token, **s3})
    line = one_line_error(done, "learner", code=1)
    assert time.monotonic() - start < 40  # seconds, not minutes of retries
    assert "s3://bucket/corpus" in line and "s3-secret-value" not in done.stderr

    line = one_line_error(run("prepare", str(tmp_path / "none"), "--out", str(prep)), "prepare", 2)
    assert str(tmp_path / "none") in line
    line = one_line_error(run("prepare", str(source), "--out", "/proc/forbidden"), "prepare", 2)
    assert "/proc/forbidden" in line
    line = one_line_error(run("prepare", str(source), "--out", str(bytes_prep)), "prepare", 2)
    assert "already holds a prepared dataset" in line
    done = run("prepare", str(source), "--out", "s3://bucket/out", "--quiet", env=s3)
    line = one_line_error(done, "prepare", code=1)
    assert "s3://bucket/out" in line
