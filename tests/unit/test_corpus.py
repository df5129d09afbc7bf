"""Real corpora and the data contract: documents, shards, eval, cache, the slot's stream, and
the synchronizer's record of each slot's data position.

    OMP_NUM_THREADS=1 .venv/bin/pytest tests/unit/test_corpus.py

Corpora are written to tmp_path (JSONL, Parquet, text); byte-level tokens make them easy to
read back (documents end with byte 0), the shipped llama-tiny tokenizer checks the hf path.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from pydantic import ValidationError

from ddiloco.learner import corpus, documents, hf
from ddiloco.learner.corpus import ByteTokens, HFTokens, load_corpus
from ddiloco.learner.data import MIN_RESERVE_STEPS, BatchIterator, join_reserve
from ddiloco.learner.task import build_task
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.synchronizer.storage.state import StateStore
from ddiloco.wire.protocol import MAX_DATA_POSITION, Heartbeat, JoinRequest

torch.set_num_threads(1)
DOCS = [f"document {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(100)]


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({field: d, "id": i}) + "\n")
    return path


def texts(tokens: np.ndarray) -> list[str]:
    """Byte-level tokens back to their documents (each one ends with byte 0)."""
    raw = np.asarray(tokens, dtype=np.uint8).tobytes()
    assert raw.endswith(b"\0")
    return [d.decode() for d in raw[:-1].split(b"\0")]


# --- documents, shards, eval ------------------------------------------------------------


@pytest.mark.parametrize("num_learners", [1, 3])
def test_shards_and_eval_partition_the_documents(
    tmp_path: Path, cache: Path, num_learners: int
) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    parts = [
        load_corpus(data, ByteTokens(), learner_index=i, num_learners=num_learners, cache_dir=cache)
        for i in range(num_learners)
    ]
    held_out = texts(parts[0].eval)
    assert held_out == DOCS[:: corpus.EVAL_EVERY]  # every 20th document, from the first
    assert all(np.array_equal(p.eval, parts[0].eval) for p in parts)  # same on every learner
    rest = [d for k, d in enumerate(DOCS) if k % corpus.EVAL_EVERY]
    for i, p in enumerate(parts):
        assert texts(p.train) == rest[i::num_learners]  # round-robin, in order
        assert p.train_documents == len(rest[i::num_learners])


def test_parquet_text_and_directories(tmp_path: Path, cache: Path) -> None:
    pq.write_table(
        pa.table({"body": DOCS[:50], "n": list(range(50))}),
        tmp_path / "a.parquet",
        row_group_size=7,
    )
    write_jsonl(tmp_path / "b.jsonl", DOCS[50:], field="body")
    (tmp_path / "README.md").write_text("not data: a directory with JSONL/Parquet reads only those")
    c = load_corpus(tmp_path, ByteTokens(), data_field="body", cache_dir=cache)
    assert texts(c.eval) + texts(c.train) == DOCS[::20] + [d for k, d in enumerate(DOCS) if k % 20]
    text_dir = tmp_path / "texts"
    text_dir.mkdir()
    for i, d in enumerate(DOCS[:30]):
        (text_dir / f"{i:03d}.txt").write_text(d)
    (text_dir / ".hidden.txt").write_text("skipped")
    c = load_corpus(text_dir, ByteTokens(), cache_dir=cache)  # one document per text file
    assert texts(c.eval) == [DOCS[0], DOCS[20]] and len(texts(c.train)) == 28


def test_hf_tokenizer_documents_end_with_its_eos(tmp_path: Path, cache: Path) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    shipped = hf.SHIPPED["llama-tiny"]
    tokens = HFTokens(hf.load_tokenizer(shipped), hf.tokenizer_digest(shipped))
    c = load_corpus(data, tokens, vocab_size=258, cache_dir=cache)
    assert c.train.dtype == np.uint16
    ends = np.flatnonzero(np.asarray(c.eval) == 257)
    assert len(ends) == c.eval_documents == 5
    first = np.asarray(c.eval[: ends[0]])
    assert first.tobytes() == np.frombuffer(DOCS[0].encode(), np.uint8).astype(np.uint16).tobytes()


def test_bad_fields_and_vocab_are_refused_by_name(tmp_path: Path, cache: Path) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCS, field="content")
    with pytest.raises(ValueError, match=r"docs\.jsonl: row 0 has no field 'text'.*--data-field"):
        load_corpus(data, ByteTokens(), cache_dir=cache)
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match="no column 'text'"):
        load_corpus(tmp_path / "p.parquet", ByteTokens(), cache_dir=cache)
    write_jsonl(tmp_path / "nums.jsonl", ["a"], field="text")
    (tmp_path / "nums.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match="is int, not text"):
        load_corpus(tmp_path / "nums.jsonl", ByteTokens(), cache_dir=cache)
    good = write_jsonl(tmp_path / "good.jsonl", DOCS)
    with pytest.raises(ValueError, match="does not fit the model's vocab_size 100"):
        load_corpus(good, ByteTokens(), vocab_size=100, cache_dir=cache)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(tmp_path / "missing.jsonl", ByteTokens(), cache_dir=cache)
    assert not list(cache.glob(".*.tmp"))  # a failed pass leaves no temporary file behind


def test_eval_set_stops_at_its_cap(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(corpus, "EVAL_MAX_TOKENS", 100)
    data = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    c = load_corpus(data, ByteTokens(), cache_dir=cache)
    assert 100 <= len(c.eval) < 100 + max(map(len, DOCS)) + 1
    assert texts(c.eval) == DOCS[: 20 * c.eval_documents : 20]
    assert len(texts(c.train)) == len(DOCS) - c.eval_documents  # later 20th ones train
    only = load_corpus(data, ByteTokens(), cache_dir=tmp_path / "c2", eval_only=True)
    assert np.array_equal(only.eval, c.eval) and len(only.train) == 0


def test_cache_is_reused_and_keyed_by_the_files(tmp_path: Path, cache: Path) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    a = load_corpus(data, ByteTokens(), learner_index=1, num_learners=2, cache_dir=cache)
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 4 and any(".shard-1-of-2." in f for f in files)
    b = load_corpus(data, ByteTokens(), learner_index=1, num_learners=2, cache_dir=cache)
    assert isinstance(b.train, np.memmap) and np.array_equal(a.train, b.train)
    assert np.array_equal(a.eval, b.eval) and b.train_documents == a.train_documents
    # another shard reuses the cached eval set, and adds only its own shard
    load_corpus(data, ByteTokens(), learner_index=0, num_learners=2, cache_dir=cache)
    assert len(list(cache.iterdir())) == 6
    write_jsonl(data, [*DOCS, "one more document"])  # new size and mtime: a new key
    c = load_corpus(data, ByteTokens(), learner_index=1, num_learners=2, cache_dir=cache)
    assert len(list(cache.iterdir())) == 10
    assert "one more document" in texts(c.train) + texts(c.eval)


def test_default_cache_root_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert corpus.cache_root() == tmp_path / "ddiloco" / "tokens"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert corpus.cache_root() == Path.home() / ".cache" / "ddiloco" / "tokens"


def test_what_is_read_as_documents(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("text")
    (tmp_path / "t.bin").write_bytes(b"\0\0")
    write_jsonl(tmp_path / "d.jsonl", ["x"])
    assert documents.is_documents(tmp_path / "d.jsonl", byte_level=True)
    assert not documents.is_documents(tmp_path / "t.txt", byte_level=True)  # raw bytes
    assert documents.is_documents(tmp_path / "t.txt", byte_level=False)
    assert not documents.is_documents(tmp_path / "t.bin", byte_level=False)
    assert not documents.is_documents(None, byte_level=True)  # the stdlib corpus as bytes
    assert documents.is_documents(None, byte_level=False)  # ... or one document per file


# --- the slot's stream --------------------------------------------------------------------


def stream(n_tokens: int = 1601, **kw: object) -> BatchIterator:
    tokens = np.arange(n_tokens, dtype=np.uint16)
    args: dict[str, object] = {"batch_size": 4, "block_size": 16, "seed": (7, 1)} | kw
    return BatchIterator(tokens, **args)  # type: ignore[arg-type]


def starts(x: torch.Tensor) -> list[int]:
    return x[:, 0].tolist()  # tokens are their offsets: the first input is the window start


def test_an_epoch_is_every_window_once_in_a_seeded_order() -> None:
    it = stream()
    assert it.windows == 100
    seen = [s for _ in range(25) for s in starts(next(it)[0])]
    assert sorted(seen) == [16 * i for i in range(100)]  # disjoint, every window once
    assert seen != sorted(seen)  # shuffled
    assert it.position == 100
    x, y = next(stream())
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    next_epoch = [s for _ in range(25) for s in starts(next(it)[0])]
    assert sorted(next_epoch) == sorted(seen) and next_epoch != seen
    assert starts(next(stream(seed=(7, 2)))[0]) != starts(next(stream())[0])


def test_seek_continues_exactly_where_the_stream_was() -> None:
    it = stream()
    for _ in range(30):
        next(it)
    expected = [starts(next(it)[0]) for _ in range(5)]
    other = stream()
    other.seek(120)
    assert [starts(next(other)[0]) for _ in range(5)] == expected
    assert other.last == (136, 140)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="data position"):
            other.seek(bad)  # type: ignore[arg-type]


def test_ranks_of_a_group_take_the_slots_windows_in_turn() -> None:
    one = stream(batch_size=6)
    group = [stream(batch_size=2, rank=r, world=3) for r in range(3)]
    for _ in range(4):
        whole = starts(next(one)[0])
        assert [s for g in group for s in starts(next(g)[0])] == whole
        assert {g.position for g in group} == {one.position}  # the slot's, not the rank's
    with pytest.raises(ValueError, match="rank"):
        stream(rank=3, world=3)


def test_reservation_runs_ahead_and_renews_at_half() -> None:
    it = stream(n_tokens=100_001)
    first = it.reservation()
    assert first == MIN_RESERVE_STEPS * 4 == join_reserve(4)
    reported = [first]
    for _ in range(200):
        next(it)
        reported.append(it.reservation())
        assert reported[-1] >= it.position + it.reserve_windows() // 2
    assert reported == sorted(reported)  # never decreases
    assert len(set(reported)) < 60  # renewed in chunks, not every step
    assert it.reserve_windows() > MIN_RESERVE_STEPS * 4  # fast steps: more of them per second


def test_build_task_streams_per_rank(tmp_path: Path) -> None:
    data = str(write_jsonl(tmp_path / "docs.jsonl", DOCS * 5))
    kw = {"data": data, "batch_size": 2, "cache_dir": str(tmp_path / "c")}
    ranks = [build_task(**kw, rank=r, world=2) for r in range(2)]  # type: ignore[arg-type]
    whole = build_task(**kw | {"batch_size": 4})  # type: ignore[arg-type]
    x = torch.cat([next(t.batches)[0] for t in ranks])
    assert torch.equal(x, next(whole.batches)[0])
    assert ranks[0].batches.position == ranks[1].batches.position == 4  # type: ignore[attr-defined]


# --- the synchronizer's record ------------------------------------------------------------


def beat(sync: Synchronizer, position: int) -> None:
    sync.heartbeat(
        Heartbeat(
            learner_id="l0",
            step=1,
            steps=[1],
            tokens=[8],
            base_versions=[0],
            step_seconds=0.1,
            data_position=position,
        )
    )


def test_synchronizer_keeps_the_highest_position_durably(tmp_path: Path) -> None:
    settings = SyncSettings(token="t", state_dir=tmp_path)
    sync = Synchronizer(settings)
    first = sync.join(JoinRequest(learner_id="l0", data_reserve=64))
    assert first.data_position == 0  # a new slot starts at the beginning ...
    beat(sync, 40)  # below what the join reserved: kept at 64
    beat(sync, 500)
    beat(sync, 300)  # an older report arriving late never moves it back
    saved = StateStore(tmp_path).load_ledger()
    assert saved["learners"][0]["data_position"] == 500  # on disk before the answer
    assert sync.status().learners[0].data_position == 500
    again = Synchronizer(settings)  # a restarted synchronizer
    second = again.join(JoinRequest(learner_id="l0", data_reserve=64))
    assert second.data_position == 500  # ... a replacement resumes where the slot was
    assert again.join(JoinRequest(learner_id="l0")).data_position == 564  # + its reserve


def test_data_positions_are_validated() -> None:
    base = {
        "learner_id": "l0",
        "step": 1,
        "steps": [1],
        "tokens": [8],
        "base_versions": [0],
        "step_seconds": 0.1,
    }
    for bad in (-1, MAX_DATA_POSITION + 1, 1.5, "x"):  # as the routes parse JSON bodies
        with pytest.raises(ValidationError):
            Heartbeat.model_validate_json(json.dumps(base | {"data_position": bad}))
        with pytest.raises(ValidationError):
            JoinRequest.model_validate_json(json.dumps({"learner_id": "l0", "data_reserve": bad}))
    assert Heartbeat.model_validate(base | {"data_position": MAX_DATA_POSITION})


def test_the_learners_settings_reach_its_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DDILOCO_DATA_FIELD and DDILOCO_TOKENIZER through the learner's own make_task: a field or
    # a tokenizer the loop dropped would build the task from the defaults instead
    from ddiloco.learner.config import LearnerConfig
    from ddiloco.learner.group import Group
    from ddiloco.learner.train import make_task

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    data = write_jsonl(tmp_path / "d.jsonl", DOCS * 4, field="body")
    env = {"DDILOCO_DATA": str(data), "DDILOCO_MODEL": "tiny"}
    with pytest.raises(ValueError, match="text"):  # the default column is not in this file
        make_task(LearnerConfig.from_env(env), Group.solo())
    task = make_task(LearnerConfig.from_env({**env, "DDILOCO_DATA_FIELD": "body"}), Group.solo())
    assert next(task.batches)[0].shape == (8, 64)
    tokenizer = str(hf.SHIPPED["llama-tiny"])  # ids up to 257: more than the preset's 256
    with pytest.raises(ValueError, match="vocab"):
        make_task(
            LearnerConfig.from_env(
                {**env, "DDILOCO_DATA_FIELD": "body", "DDILOCO_TOKENIZER": tokenizer}
            ),
            Group.solo(),
        )
