"""Object storage for real: s3fs against a real S3-compatible server, then the product's paths.

    python tests/s3server.py build                       # once per machine
    pytest tests/e2e/test_object_storage.py -m e2e

The server is VersityGW built from its Go module (tests/s3server.py, session fixture
`s3_server`): buckets are directories, objects files, requests signed with SigV4 and logged in
S3's access-log format, so a test can see which objects a process read. First what the product
relies on from any S3 store: writes read back byte for byte, ListObjectsV2 pages, multipart
upload, ranged GETs that send only the range, and refused signatures. Then `ddiloco prepare
SOURCE --out s3://...` (the same files as a local prepare), a prepared dataset read lazily from
the store (only the slot's chunks, only the blocks its windows touch), a real learner training
from `--data s3://...`, and the refusals, each one line: wrong credentials (no secret shown), a
prefix with no manifest, and a store that is gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import s3fs
import s3server

from ddiloco.learner import prepared
from ddiloco.learner.data import stdlib_files
from ddiloco.local.processes import terminate_all
from tests.e2e.conftest import ddiloco_run as run
from tests.e2e.conftest import one_line_error

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix of this test's own in the session's bucket."""
    return f"{request.node.name[5:40]}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fs(s3_server: s3server.S3Server) -> s3fs.S3FileSystem:
    return s3_server.filesystem()


def ops(server: s3server.S3Server, key_prefix: str) -> list[tuple[str, str]]:
    """(operation, key) of every request on keys under key_prefix, oldest first."""
    return [
        (r.operation.removeprefix("s3_"), r.key)
        for r in server.requests()
        if r.key.startswith(key_prefix)
    ]


# --------------------------------------------------------------------------- the store itself


def test_objects_read_back_list_in_pages_and_are_files_on_disk(
    s3_server: s3server.S3Server, fs: s3fs.S3FileSystem, prefix: str
) -> None:
    blobs = {f"{prefix}/d{i % 2}/obj-{i}.bin": os.urandom(1000 + i) for i in range(5)}
    for key, data in blobs.items():
        fs.pipe_file(s3_server.url(key), data)
    fresh = s3_server.filesystem()  # no listing cache: every answer below is the server's
    for key, data in blobs.items():
        assert fresh.cat_file(s3_server.url(key)) == data
        # the posix backend: the object is a plain file of the same bytes
        assert (s3_server.data_dir / s3_server.bucket / key).read_bytes() == data
    assert sorted(fresh.ls(s3_server.url(prefix))) == [
        f"{s3_server.bucket}/{prefix}/d0",
        f"{s3_server.bucket}/{prefix}/d1",
    ]
    assert sorted(fresh.find(s3_server.url(prefix))) == sorted(
        f"{s3_server.bucket}/{k}" for k in blobs
    )
    # ListObjectsV2 pages of 2, followed by continuation token
    keys: list[str] = []
    token: dict[str, str] = {}
    pages = 0
    while True:
        page = fresh.call_s3(
            "list_objects_v2", Bucket=s3_server.bucket, Prefix=prefix, MaxKeys=2, **token
        )
        keys += [o["Key"] for o in page.get("Contents", [])]
        pages += 1
        if not page["IsTruncated"]:
            break
        token = {"ContinuationToken": page["NextContinuationToken"]}
    assert pages == 3 and sorted(keys) == sorted(blobs)
    listed = [op for op, _ in ops(s3_server, "") if op == "ListObjectsV2"]
    assert listed, "the access log has no ListObjectsV2"
    fresh.rm(s3_server.url(prefix), recursive=True)
    assert not fresh.exists(s3_server.url(next(iter(blobs))))


def test_multipart_upload_assembles_the_parts(
    s3_server: s3server.S3Server, fs: s3fs.S3FileSystem, prefix: str
) -> None:
    part = 5 * 2**20  # S3's smallest part but the last
    data = os.urandom(2 * part + 123_457)
    key = f"{prefix}/big.bin"
    with fs.open(s3_server.url(key), "wb", block_size=part) as f:
        for i in range(0, len(data), 2**20):
            f.write(data[i : i + 2**20])
    info = s3_server.filesystem().info(s3_server.url(key))
    assert info["size"] == len(data)
    assert info["ETag"].strip('"').endswith("-3"), info["ETag"]  # an object of three parts
    got = s3_server.filesystem().cat_file(s3_server.url(key))
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    seen = [op for op, k in ops(s3_server, key) if k == key]
    assert seen.count("UploadPart") == 3, seen
    assert "CreateMultipartUpload" in seen and "CompleteMultipartUpload" in seen, seen


def test_ranged_gets_send_only_the_range(
    s3_server: s3server.S3Server, fs: s3fs.S3FileSystem, prefix: str
) -> None:
    data = os.urandom(1 << 20)
    key = f"{prefix}/ranged.bin"
    fs.pipe_file(s3_server.url(key), data)
    got = fs.call_s3("get_object", Bucket=s3_server.bucket, Key=key, Range="bytes=1000-1999")
    assert got["ContentLength"] == 1000
    assert got["ContentRange"] == f"bytes 1000-1999/{len(data)}"
    assert fs.cat_file(s3_server.url(key), start=123_456, end=123_556) == data[123_456:123_556]
    assert fs.cat_file(s3_server.url(key), start=len(data) - 10) == data[-10:]
    starts = [0, 70_000, 500_001, len(data) - 5]
    ends = [10, 70_100, 600_000, len(data)]
    assert fs.cat_ranges([s3_server.url(key)] * 4, starts, ends) == [
        data[s:e] for s, e in zip(starts, ends, strict=True)
    ]
    with fs.open(s3_server.url(key), "rb", block_size=4096, cache_type="none") as f:
        f.seek(777_777)
        assert f.read(33) == data[777_777:777_810]


def test_wrong_keys_are_refused(s3_server: s3server.S3Server, prefix: str) -> None:
    key = f"{prefix}/secret.bin"
    s3_server.filesystem().pipe_file(s3_server.url(key), b"payload")
    options = s3_server.storage_options()
    for wrong in ({"secret": "not-the-secret"}, {"key": "DDKNOSUCHKEY0000"}):
        other = s3fs.S3FileSystem(skip_instance_cache=True, **{**options, **wrong})
        with pytest.raises(PermissionError):
            other.cat_file(s3_server.url(key))
    errors = {r.error for r in s3_server.requests() if r.key == key and r.status == 403}
    assert errors == {"SignatureDoesNotMatch", "InvalidAccessKeyId"}, errors


# --------------------------------------------------------------------------- the product


def write_corpus(path: Path) -> Path:
    """A JSONL corpus of standard-library source paragraphs (about 0.8 MB)."""
    with open(path, "w") as f:
        for source in stdlib_files()[:30]:
            for doc in source.read_text(errors="replace").split("\n\n\n"):
                f.write(json.dumps({"text": doc}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs.jsonl")


@pytest.fixture(scope="module")
def local_prepared(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus prepared into a local directory: what the store must hold after a prepare."""
    out = tmp_path_factory.mktemp("local") / "prepared"
    done = run("prepare", str(corpus), "--out", str(out), "--chunk-tokens", "100000", env={})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def s3_prepared(s3_server: s3server.S3Server, corpus: Path) -> str:
    """The corpus prepared into the store by `ddiloco prepare --out s3://...`."""
    url = s3_server.url(f"prepared-{uuid.uuid4().hex[:8]}")
    done = run(
        "prepare", str(corpus), "--out", url, "--chunk-tokens", "100000", env=s3_server.env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"into {url}:" in done.stdout, done.stdout
    return url


def test_prepare_to_s3_writes_what_a_local_prepare_writes_manifest_last(
    s3_server: s3server.S3Server, s3_prepared: str, local_prepared: Path
) -> None:
    fs = s3_server.filesystem()
    key = s3_prepared.removeprefix(f"s3://{s3_server.bucket}/")
    remote = {p.rsplit("/", 1)[1] for p in fs.ls(s3_prepared)}
    local = {p.name for p in local_prepared.iterdir()}
    assert remote == local and len(remote) >= 4, (remote, local)  # manifest, eval, >= 2 chunks
    for name in sorted(local):
        assert fs.cat_file(f"{s3_prepared}/{name}") == (local_prepared / name).read_bytes(), name
    writes = [k for op, k in ops(s3_server, key + "/") if op in ("PutObject", "UploadPart")]
    assert writes[-1] == f"{key}/manifest.json", writes  # a dataset exists once it is complete
    assert writes.count(f"{key}/manifest.json") == 1


def test_a_learner_slot_reads_only_its_chunks_and_only_the_blocks_it_needs(
    s3_env: s3server.S3Server, s3_prepared: str, local_prepared: Path
) -> None:
    s3_server = s3_env
    key = s3_prepared.removeprefix(f"s3://{s3_server.bucket}/")
    before = len(s3_server.requests())
    ds = prepared.open_dataset(s3_prepared)
    m = ds.manifest
    assert len(m.chunks) >= 4
    dtype = m.np_dtype
    mine = prepared.chunks_of(len(m.chunks), 1, 2)
    local = np.concatenate(
        [np.fromfile(local_prepared / prepared.chunk_file(j), dtype=dtype) for j in mine]
    )
    train = ds.train(learner_index=1, num_learners=2)
    assert len(train) == len(local)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(local) - 65, size=16)
    starts[0] = m.chunks[mine[0]] - 10  # a window across the boundary of its first two chunks
    assert isinstance(train, prepared.ChunkedTokens)
    windows = train.windows(starts, 65)
    assert np.array_equal(windows, local[starts[:, None] + np.arange(65)].astype(np.int64))
    assert np.array_equal(ds.eval(), np.fromfile(local_prepared / "eval.tokens", dtype=dtype))

    served = s3_server.requests()[before:]
    got = {r.key.removeprefix(key + "/") for r in served if r.operation == "s3_GetObject"}
    allowed = {"manifest.json", "eval.tokens"} | {prepared.chunk_file(j) for j in mine}
    assert got <= allowed, f"read another slot's chunks: {sorted(got - allowed)}"
    assert {prepared.chunk_file(j) for j in mine} & got

    # By blocks: 4 KiB blocks fetch a small part of the slot's bytes for 4 windows, in one
    # coalesced round of ranged GETs (one per run of adjacent blocks).
    remote = prepared.RemoteChunks(
        ds.fs,
        [ds.path(prepared.chunk_file(j)) for j in mine],
        [m.chunks[j] for j in mine],
        dtype,
        s3_prepared,
        block_bytes=4096,
    )
    lazy = prepared.ChunkedTokens([m.chunks[j] for j in mine], remote.read)
    before = len(s3_server.requests())
    assert np.array_equal(lazy.windows(starts[:4], 65), windows[:4])
    assert remote.fetched_bytes <= 4 * 2 * 4096 < local.nbytes // 10
    chunk_gets = [r for r in s3_server.requests()[before:] if r.operation == "s3_GetObject"]
    assert len(chunk_gets) == remote.requests <= 8


def test_a_learner_trains_from_s3(
    s3_server: s3server.S3Server,
    s3_prepared: str,
    tmp_path: Path,
    synchronizer_process: Callable[..., Any],
    learner_process: Callable[..., Any],
) -> None:
    key = s3_prepared.removeprefix(f"s3://{s3_server.bucket}/")
    n_chunks = len(
        json.loads(s3_server.filesystem().cat_file(f"{s3_prepared}/manifest.json"))["chunks"]
    )
    before = len(s3_server.requests())
    sync = synchronizer_process(tmp_path, "s3-token", "--no-grace", DDILOCO_QUORUM="1")
    flags = ["--model", "tiny", "--data", s3_prepared, "--batch-size", "4", "-H", "4", "-P", "2"]
    learner = learner_process(tmp_path, sync, 1, 2, *flags, "--max-steps", "6", **s3_server.env())
    try:
        sync.start()
        learner.start()
        assert learner.proc.wait(timeout=180) == 0, learner.log_path.read_text()[-3000:]
    finally:
        terminate_all([learner, sync.child])
    assert f"prepared dataset {s3_prepared}" in learner.log_path.read_text()
    steps = [json.loads(x) for x in (tmp_path / "l1.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if "event" not in r and "loss" in r]
    assert len(losses) == 6 and all(0 < x < 20 for x in losses), losses
    assert steps[-1]["event"] == "stop" and steps[-1]["stop_reason"] == "max_steps", steps[-1]
    served = s3_server.requests()[before:]
    got = {r.key.removeprefix(key + "/") for r in served if r.operation == "s3_GetObject"}
    theirs = {prepared.chunk_file(j) for j in range(0, n_chunks, 2)}
    assert got and not got & theirs, sorted(got)  # slot 1 of 2 reads chunks 1, 3, ... only
    assert not [r for r in served if r.operation in ("s3_PutObject", "s3_DeleteObject")]


def test_refusals_are_one_line_naming_the_store(
    s3_server: s3server.S3Server, s3_prepared: str, corpus: Path, tmp_path: Path
) -> None:
    learner = ["learner", "--sync-url", "http://127.0.0.1:9", "--learner-id", "l0"]
    env = {**s3_server.env(), "DDILOCO_TOKEN": "t"}
    wrong = {**env, "AWS_SECRET_ACCESS_KEY": "wrong-secret-" + uuid.uuid4().hex}

    done = run(*learner, "--data", s3_prepared, env=wrong)
    line = one_line_error(done, "learner")
    assert s3_prepared in line and "denied" in line, line
    assert wrong["AWS_SECRET_ACCESS_KEY"] not in done.stderr + done.stdout
    assert s3_server.secret_key not in done.stderr + done.stdout

    nowhere = s3_server.url(f"no-such-prefix-{uuid.uuid4().hex[:8]}")
    line = one_line_error(run(*learner, "--data", nowhere, env=env), "learner")
    assert nowhere in line and "no manifest.json" in line, line

    out = s3_server.url(f"refused-{uuid.uuid4().hex[:8]}")
    done = run("prepare", str(corpus), "--out", out, "--quiet", env=wrong)
    line = one_line_error(done, "prepare")
    assert out in line, line  # which store refused, not a bare "Forbidden"
    assert wrong["AWS_SECRET_ACCESS_KEY"] not in done.stderr + done.stdout
    assert not s3_server.filesystem().exists(out + "/manifest.json")

    # A store that was there and is gone: its own server, stopped after a prepare.
    gone = s3server.start(tmp_path / "gone")
    url = gone.url("corpus")
    assert run("prepare", str(corpus), "--out", url, "--quiet", env=gone.env()).returncode == 0
    gone.stop()
    start = time.monotonic()
    done = run(*learner, "--data", url, env={**gone.env(), "DDILOCO_TOKEN": "t"})
    line = one_line_error(done, "learner")
    assert url in line and gone.endpoint_url in line, line
    assert time.monotonic() - start < 40  # seconds (torch's import included), not minutes
    start = time.monotonic()
    done = run("prepare", str(corpus), "--out", gone.url("again"), "--quiet", env=gone.env())
    line = one_line_error(done, "prepare")
    assert gone.url("again") in line, line
    assert time.monotonic() - start < 40
