"""Prepared token datasets (learner/prepared.py): the format on disk, its refusals, the chunks
each learner reads, and the lazy readers (memmap, fsspec ranged reads) agreeing window for
window.

    OMP_NUM_THREADS=1 .venv/bin/pytest tests/unit/test_prepared.py

Datasets are written with byte-level tokens (documents end with byte 0, easy to read back)
to tmp_path, and copied to fsspec's in-memory filesystem (``memory://``) for the remote
reader, which goes through the same ``cat_ranges`` calls as an object store.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddiloco.learner import corpus, hf, prepared
from ddiloco.learner.cli import check_model_and_data
from ddiloco.learner.corpus import ByteTokens, HFTokens
from ddiloco.learner.data import EAGER_WINDOWS, BatchIterator, FeistelOrder
from ddiloco.learner.prepared import (
    ChunkedTokens,
    PreparedError,
    RemoteChunks,
    open_dataset,
    write_prepared,
)
from ddiloco.learner.task import build_task

torch.set_num_threads(1)
DOCS = [f"document {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(200)]


def texts(tokens: np.ndarray) -> list[str]:
    """Byte-level tokens back to their documents (each one ends with byte 0)."""
    raw = np.asarray(tokens, dtype=np.uint8).tobytes()
    assert raw.endswith(b"\0")
    return [d.decode() for d in raw[:-1].split(b"\0")]


def prepare(dest: Path | str, docs: list[str] = DOCS, chunk_tokens: int = 500) -> prepared.Manifest:
    return write_prepared(
        str(dest), docs, ByteTokens(), data_field="text", source="DOCS", chunk_tokens=chunk_tokens
    )


def to_memory(local: Path) -> str:
    """A copy of the dataset directory on fsspec's in-memory filesystem; its URL."""
    url = f"memory://prepared-{uuid.uuid4().hex}"
    mem = fsspec.filesystem("memory")
    for f in sorted(local.iterdir()):
        mem.pipe_file(f"{url}/{f.name}", f.read_bytes())
    return url


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, prepared.Manifest]:
    out = tmp_path / "prep"
    return out, prepare(out)


# --- the format ----------------------------------------------------------------------------


def test_round_trip_holds_out_eval_as_the_corpus_does(tmp_path: Path) -> None:
    out = tmp_path / "prep"
    m = prepare(out)
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(
        ["manifest.json", "eval.tokens", *(prepared.chunk_file(j) for j in range(len(m.chunks)))]
    )
    raw = json.loads((out / "manifest.json").read_text())
    assert (raw["format"], raw["version"], raw["dtype"]) == (prepared.FORMAT, 1, "uint16")
    assert (raw["tokenizer"], raw["eos"], raw["vocab_size"]) == ("bytes-v1", 0, 256)
    for j, c in enumerate(raw["chunks"]):
        assert (out / c["file"]).stat().st_size == 2 * c["tokens"]  # raw little-endian uint16
        assert j == len(raw["chunks"]) - 1 or c["tokens"] >= 500  # closed once full
    ds = open_dataset(out)
    held_out = texts(ds.eval())
    assert held_out == DOCS[:: corpus.EVAL_EVERY]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    same = corpus.load_corpus(jsonl, ByteTokens(), cache_dir=tmp_path / "cache")
    assert np.array_equal(ds.eval(), same.eval)  # the eval set a raw-corpus learner holds out
    whole = ds.train(0, 1)
    train = whole.windows(np.array([0]), len(whole))[0]
    assert texts(train) == [d for k, d in enumerate(DOCS) if k % corpus.EVAL_EVERY]
    assert m.train_documents + m.eval_documents == len(DOCS)
    assert m.eval_documents == len(held_out)


def test_chunks_end_at_document_boundaries_and_big_vocabularies_take_uint32(
    tmp_path: Path,
) -> None:
    out = tmp_path / "prep"
    m = prepare(out, chunk_tokens=1)  # every training document closes its own chunk
    assert len(m.chunks) == m.train_documents
    ds = open_dataset(out)
    assert texts(ds.train(3, len(m.chunks))) == [[d for k, d in enumerate(DOCS) if k % 20][3]]
    w = prepared.DatasetWriter(
        str(tmp_path / "wide"),
        tokenizer="t",
        eos=70000,
        vocab_size=70001,
        data_field="x",
        source="s",
    )
    w.add_eval(np.array([69999, 70000]))
    w.add_train(np.array([1, 65536, 70000]))
    w.end_document()
    assert w.commit().dtype == "uint32"
    wide = open_dataset(tmp_path / "wide")
    assert wide.eval().tolist() == [69999, 70000]
    assert np.asarray(wide.train(0, 1)).tolist() == [1, 65536, 70000]


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30), chunk=st.integers(1, 100))
def test_documents_written_at_once_make_the_same_chunks(lengths: list[int], chunk: int) -> None:
    tokens = np.arange(sum(lengths)) % 256
    made = []
    for at_once in (False, True):
        url = f"memory://docs-{uuid.uuid4().hex}"
        w = prepared.DatasetWriter(
            url,
            tokenizer="t",
            eos=0,
            vocab_size=256,
            data_field="x",
            source="s",
            chunk_tokens=chunk,
        )
        if at_once:
            w.add_documents(tokens, lengths)
        else:
            for lo, hi in zip(np.cumsum([0, *lengths[:-1]]), np.cumsum(lengths), strict=True):
                w.add_train(tokens[lo:hi])
                w.end_document()
        m = w.commit()
        made.append((m.chunks, m.train_documents))
        read = open_dataset(url).train(0, 1)
        assert np.array_equal(read.windows(np.array([0]), len(read))[0], tokens)
    assert made[0] == made[1] and made[0][1] == len(lengths)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"version": 2}, "format version 2; this ddiloco reads version 1"),
        ({"format": "something-else"}, "of format 'something-else'"),
        ({"dtype": "uint8"}, "dtype 'uint8'"),
        ({"chunks": [{"file": "../x", "tokens": 3}]}, "files other than"),
        ({"eval": None}, "lacks or mangles"),
    ],
)
def test_other_manifests_are_refused_by_name(
    dataset: tuple[Path, prepared.Manifest], change: dict, refusal: str
) -> None:
    out, _ = dataset
    raw = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(raw | change))
    with pytest.raises(PreparedError, match=refusal):
        open_dataset(out)


def test_a_half_written_dataset_is_never_read(tmp_path: Path) -> None:
    out = tmp_path / "prep"

    def documents():
        yield from DOCS[:100]
        raise ValueError("the source broke mid-way")

    with pytest.raises(ValueError, match="mid-way"):
        write_prepared(str(out), documents(), ByteTokens(), data_field="text", source="s")
    assert not (out / "manifest.json").exists()
    assert not list(out.glob("*.tokens"))  # abandoned: removed
    # written up to the manifest (a writer killed before its commit): refused, not read as text
    w = prepared.DatasetWriter(
        str(out), tokenizer="bytes-v1", eos=0, vocab_size=256, data_field="text", source="s"
    )
    w.add_eval(np.arange(10))
    w.add_train(np.arange(50))
    w._eval.close()
    w._chunk.close()
    assert prepared.is_prepared(out)
    with pytest.raises(PreparedError, match=r"no manifest.json: .*still being written"):
        open_dataset(out)
    with pytest.raises(PreparedError, match=r"no manifest\.json"):
        build_task(preset="tiny", data=str(out))
    with pytest.raises(PreparedError, match=r"no manifest\.json"):
        open_dataset(to_memory(out))


def test_a_chunk_shorter_than_its_manifest_is_refused(
    dataset: tuple[Path, prepared.Manifest],
) -> None:
    out, m = dataset
    chunk = out / prepared.chunk_file(1)
    chunk.write_bytes(chunk.read_bytes()[:-2])
    url = to_memory(out)
    with pytest.raises(PreparedError, match=r"chunk-000001.tokens holds \d+ bytes"):
        open_dataset(out).train(1, 2)
    remote = open_dataset(url).train(0, 1)
    end = m.chunks[0] + m.chunks[1]
    with pytest.raises(OSError, match="shorter than its manifest says"):
        remote.windows(np.array([end - 10]), 10)


def test_an_existing_dataset_is_not_overwritten(dataset: tuple[Path, prepared.Manifest]) -> None:
    out, _ = dataset
    before = (out / "manifest.json").read_bytes()
    with pytest.raises(FileExistsError, match="already holds a prepared dataset"):
        prepare(out)
    assert (out / "manifest.json").read_bytes() == before


# --- chunks per learner --------------------------------------------------------------------


@given(chunks=st.integers(1, 60), learners=st.integers(1, 60))
def test_chunk_assignment_partitions_the_chunks(chunks: int, learners: int) -> None:
    if chunks < learners:
        with pytest.raises(PreparedError, match=f"{chunks} chunks, fewer than the {learners}"):
            prepared.chunks_of(chunks, 0, learners)
        return
    parts = [prepared.chunks_of(chunks, i, learners) for i in range(learners)]
    assert sorted(j for p in parts for j in p) == list(range(chunks))
    assert all(p and all(j % learners == i for j in p) for i, p in enumerate(parts))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_each_learner_reads_only_its_chunks(dataset: tuple[Path, prepared.Manifest]) -> None:
    out, m = dataset
    ds = open_dataset(out)
    train_docs = [d for k, d in enumerate(DOCS) if k % 20]
    got = []
    for i in range(3):
        mine = ds.train(i, 3)
        assert len(mine) == sum(m.chunks[i::3])  # from the manifest, before any read
        got.append(texts(mine.windows(np.array([0]), len(mine))[0]))
    assert sorted(d for g in got for d in g) == sorted(train_docs)
    assert not set(got[0]) & set(got[1])
    with pytest.raises(PreparedError, match="fewer than the"):
        ds.train(0, len(m.chunks) + 1)


# --- lazy readers agree ----------------------------------------------------------------------


def test_local_file_and_memory_readers_give_the_same_batches(
    dataset: tuple[Path, prepared.Manifest],
) -> None:
    out, _ = dataset
    sources = {
        "path": open_dataset(out),
        "file": open_dataset(f"file://{out}"),
        "memory": open_dataset(to_memory(out)),
    }
    assert isinstance(sources["memory"].train(0, 2), ChunkedTokens)
    whole = sources["path"].train(0, 2)
    flat = whole.windows(np.array([0]), len(whole))[0]
    streams = {
        name: BatchIterator(ds.train(0, 2), batch_size=4, block_size=64, seed=(7, 0))
        for name, ds in sources.items()
    }
    plain = BatchIterator(flat, batch_size=4, block_size=64, seed=(7, 0))
    for it in streams.values():
        assert it.windows == plain.windows
        it.seek(37)
    plain.seek(37)
    for _ in range(30):  # beyond an epoch: windows that cross chunk boundaries included
        x, y = next(plain)
        for it in streams.values():
            xi, yi = next(it)
            assert torch.equal(xi, x) and torch.equal(yi, y)
    for ds in sources.values():
        assert np.array_equal(np.asarray(ds.eval()), np.asarray(sources["path"].eval()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=6).filter(lambda x: sum(x) > 0),
    block=st.sampled_from([2, 6, 64, 1024]),
    cache=st.integers(1, 8),
    data=st.data(),
)
def test_remote_windows_match_the_array_for_any_blocks_and_cache(
    lengths: list[int], block: int, cache: int, data: st.DataObject
) -> None:
    rng = np.random.default_rng(sum(lengths))
    arrays = [rng.integers(0, 65536, n, dtype=np.uint64).astype("<u2") for n in lengths]
    url = f"memory://chunks-{uuid.uuid4().hex}"
    mem = fsspec.filesystem("memory")
    paths = [f"{url}/c{j}" for j in range(len(arrays))]
    for p, a in zip(paths, arrays, strict=True):
        mem.pipe_file(p, a.tobytes())
    remote = RemoteChunks(
        mem, paths, lengths, np.dtype("<u2"), url, block_bytes=block, cache_blocks=cache
    )
    tokens = ChunkedTokens(lengths, remote.read)
    flat = np.concatenate(arrays).astype(np.int64)
    for _ in range(3):  # repeated batches: served partly from the cache
        length = data.draw(st.integers(1, len(flat)))
        starts = np.array(data.draw(st.lists(st.integers(0, len(flat) - length), max_size=8)))
        got = tokens.windows(starts.astype(np.int64), length)
        want = flat[starts.astype(np.int64)[:, None] + np.arange(length)] if len(starts) else got
        assert np.array_equal(got, want)
    assert len(remote.cache) <= cache
    with pytest.raises(IndexError):
        tokens.windows(np.array([len(flat)]), 1)


@given(n=st.integers(1, 3000), key=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=3))
def test_the_lazy_order_is_a_bijection(n: int, key: list[int]) -> None:
    order = FeistelOrder(n, key)
    assert sorted(order[np.arange(n)].tolist()) == list(range(n))
    assert np.array_equal(order[np.arange(n)], FeistelOrder(n, key)[np.arange(n)])


def test_a_huge_shard_is_drawn_in_a_lazy_order_without_reading_it() -> None:
    windows = EAGER_WINDOWS + 10
    reads: list[tuple[int, int, int]] = []

    def read(pieces: list[tuple[int, int, int]]) -> list[np.ndarray]:
        reads.extend(pieces)
        return [np.arange(lo, hi) % 251 for _, lo, hi in pieces]  # token t is t mod 251

    source = ChunkedTokens([windows * 64 + 1], read)
    a = BatchIterator(source, batch_size=4, block_size=64, seed=(3, 1))
    b = BatchIterator(source, batch_size=4, block_size=64, seed=(3, 1))
    assert a.windows == windows and not reads  # sized from the length alone
    assert isinstance(a.permutation(0), FeistelOrder)
    b.seek(windows - 2)  # the last two windows of epoch 0, the first two of epoch 1
    x, y = next(b)
    w = b.window_indices(np.arange(windows - 2, windows + 2))
    assert np.array_equal(x[:, 0].numpy(), (w * 64) % 251) and torch.equal(x[:, 1:], y[:, :-1])
    assert len(set(w[:2].tolist())) == 2 and all(0 <= v < windows for v in w)
    assert not np.array_equal(a.permutation(0)[np.arange(50)], a.permutation(1)[np.arange(50)])
    assert len(reads) == 4  # one piece per window of the batch


def test_a_batch_is_one_coalesced_fetch(dataset: tuple[Path, prepared.Manifest]) -> None:
    out, m = dataset
    ds = open_dataset(to_memory(out))
    paths = [ds.path(prepared.chunk_file(j)) for j in range(len(m.chunks))]
    remote = RemoteChunks(ds.fs, paths, m.chunks, m.np_dtype, ds.url, block_bytes=64)
    tokens = ChunkedTokens(m.chunks, remote.read)
    tokens.windows(np.array([0, 10, 100, 1000]), 65)  # blocks 0..4 and 31..34 of chunk 0 etc.
    first = remote.requests
    assert first <= 4  # adjacent blocks go as one range
    tokens.windows(np.array([0, 10]), 65)  # cached
    assert remote.requests == first


# --- the job's model, the learner's checks ------------------------------------------------------


def test_tokenizer_mismatch_is_refused_naming_both(tmp_path: Path) -> None:
    shipped = hf.SHIPPED["llama-tiny"]
    llama = HFTokens(hf.load_tokenizer(shipped), hf.tokenizer_digest(shipped))
    out = tmp_path / "llama"
    write_prepared(str(out), DOCS, llama, data_field="text", source="DOCS", chunk_tokens=500)
    with pytest.raises(PreparedError, match=r"tokenizer hf-\w+ \(258 ids.*vocab_size is 256"):
        build_task(preset="tiny", data=str(out))
    with pytest.raises(PreparedError, match=r"tokenizer hf-\w+ \(258 ids.*vocab_size is 256"):
        check_model_and_data("tiny", None, str(out))
    byte_level = tmp_path / "bytes"
    prepare(byte_level)
    with pytest.raises(PreparedError, match=r"tokenizer bytes-v1, but --tokenizer is hf-\w+"):
        check_model_and_data("hf:llama-tiny", None, str(byte_level), tokenizer=str(shipped))
    check_model_and_data("hf:llama-tiny", None, str(out), tokenizer=str(shipped))
    task = build_task(preset="hf:llama-tiny", data=str(out), tokenizer=str(shipped))
    x, y = next(task.batches)
    assert x.shape == y.shape and int(x.max()) < 258


def test_build_task_trains_from_a_prepared_dataset(dataset: tuple[Path, prepared.Manifest]) -> None:
    out, m = dataset
    task = build_task(preset="tiny", data=str(out), learner_index=1, num_learners=2, batch_size=2)
    assert task.batches.windows == (sum(m.chunks[1::2]) - 1) // 64
    x, _ = next(task.batches)
    assert x.shape == (2, 64)
    loss = task.eval_loss(task.model)
    assert np.isfinite(loss)
    evaluator = build_task(preset="tiny", data=str(out), eval_only=True)
    assert len(evaluator.batches.tokens) == m.eval_tokens


def test_missing_data_and_unreachable_store_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddiloco.cli.errors import RuntimeFailure

    with pytest.raises(FileNotFoundError, match=r"data path .*nowhere.* does not exist"):
        check_model_and_data("tiny", None, str(tmp_path / "nowhere"))
    with pytest.raises(PreparedError, match=r"memory://absent-\w+: no manifest.json"):
        check_model_and_data("tiny", None, f"memory://absent-{uuid.uuid4().hex}")
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    bucket = f"s3://b-{uuid.uuid4().hex[:8]}/corpus"  # a fresh URL: no cached filesystem
    start = time.monotonic()
    with pytest.raises(RuntimeFailure, match=f"cannot read the prepared dataset {bucket}") as e:
        check_model_and_data("tiny", None, bucket)
    assert time.monotonic() - start < 30  # short connect timeouts and retries
    assert f"127.0.0.1:{port}" in str(e.value) and "test-secret" not in str(e.value)


def test_prepare_reads_a_saved_datasets_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import datasets

    from ddiloco.cli import prepare as prepare_cli

    datasets.Dataset.from_dict({"body": DOCS, "n": list(range(len(DOCS)))}).save_to_disk(
        str(tmp_path / "saved")
    )
    out = tmp_path / "out"
    argv = [str(tmp_path / "saved"), "--out", str(out), "--data-field", "body", "--quiet"]
    assert prepare_cli.main([*argv, "--chunk-tokens", "500"]) == 0
    ds = open_dataset(out)
    assert texts(ds.eval()) == DOCS[:: corpus.EVAL_EVERY]
    assert ds.manifest.data_field == "body" and len(ds.manifest.chunks) > 1
    datasets.DatasetDict({"valid": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(
        str(tmp_path / "dict")
    )
    with pytest.raises(SystemExit) as e:
        prepare_cli.main([str(tmp_path / "dict"), "--out", str(tmp_path / "o2")])
    assert e.value.code == 2
    assert "without a 'train' split" in capsys.readouterr().err
    assert not (tmp_path / "o2" / "manifest.json").exists()
