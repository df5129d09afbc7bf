"""Real corpora: text, JSONL and Parquet documents, tokenized, sharded per learner, cached.

    tokens = HFTokens(hf.load_tokenizer(path), hf.tokenizer_digest(path))   # or ByteTokens()
    corpus = load_corpus("data/", tokens, data_field="text", learner_index=1, num_learners=4)
    corpus.train    # learner 1's shard: its documents' tokens, each document followed by EOS
    corpus.eval     # the held-out documents' tokens: the same on every learner

``data`` is a file or a directory of text, JSONL or Parquet documents (documents.py says
which files and what a document is); the documents are tokenized with the model's tokenizer
(no special tokens added) and joined with its EOS token.

Held out, identical on every learner: document ``k`` (counting non-empty documents from 0)
is an eval document when ``k % EVAL_EVERY == 0``, until the eval documents hold
``EVAL_MAX_TOKENS`` tokens; every other document goes, numbered ``j`` in order, to learner
``j % num_learners``. Shards are disjoint from each other and from the eval set. (Token
arrays, a ``.bin`` or byte-level text, are data.py's: the tail is held out and the rest cut
into contiguous shards; prepared datasets, tokenized once by ``ddiloco prepare``, are
prepared.py's: this eval rule, applied at prepare time, and chunks dealt round-robin. The
contract below holds for all three.)

Cache: a learner tokenizes only the eval documents and its own, once; the result is a
``uint16`` (``uint32`` beyond 65,536 tokens) file plus a JSON sidecar in ``cache_root()``
(``$XDG_CACHE_HOME/ddiloco/tokens``, else ``~/.cache/ddiloco/tokens``; never the repository),
named by a digest of the data files (path, size, mtime), ``data_field``, the tokenizer's
files and the shard, and memory-mapped. A replacement on the same node re-reads, it does not
re-tokenize. Files are written to a temporary name and renamed, so learners sharing a node
may race on one safely.

The data contract (a slot's stream, its position, and what a replacement trains)
-------------------------------------------------------------------------------
1. A slot's stream is a deterministic sequence of windows of its shard: ``block_size + 1``
   tokens at stride ``block_size``, each epoch in a permutation drawn from
   ``(seed, learner_index, epoch)`` (``data.BatchIterator``). Every process that plays the
   slot (a restart, a replacement, a hot spare, every rank of its group) computes the same
   sequence from the same data, tokenizer, ``data_field``, model, ``num_learners`` and seed.
2. Its position counts the windows the slot has consumed; a group step of ``n`` ranks of
   batch ``B`` consumes positions ``[p, p + n*B)``, rank ``r`` the ``r``-th ``B``.
3. The learner reports ahead of what it trains: each heartbeat carries the end of the slot's
   reservation (``BatchIterator.reservation()``), at least ``MIN_RESERVE_STEPS`` group steps
   and ``RESERVE_SECONDS`` of training past the position, renewed once half is used; at join
   it reserves ``MIN_RESERVE_STEPS`` group steps (``JoinRequest.data_reserve``) to cover the
   draws before its first heartbeat lands.
4. The synchronizer keeps, per learner id, the highest position reported or reserved, in
   its ledger (synchronizer/storage/ledgerdb.py), written before it answers; a join is answered that position
   (``JoinResponse.data_position``), and a replacement seeks its stream there.
5. So a replacement's first window lies beyond every window its predecessors drew: it
   never retrains the slot's data. The windows between where a dead process stopped and its
   reservation are skipped: never trained in that epoch (they come back, permuted, in the
   next), at most one reservation per replacement (``RESERVE_SECONDS`` of training, or
   ``MIN_RESERVE_STEPS`` steps if those take longer).
6. Limit: the guarantee holds while each renewed reservation reaches the synchronizer before
   half of it is used (``RESERVE_SECONDS / 2``; heartbeats go every ``poll_s``). A learner
   that trains through a longer synchronizer outage draws past its recorded reservation;
   should it die before it is heard again, its replacement may retrain up to the windows
   drawn during the outage.
7. Changing the data, tokenizer, ``data_field``, ``num_learners`` or seed changes every
   stream: a position recorded by another configuration means nothing then.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import numpy as np

from ddiloco.learner.data import DEFAULT_MAX_BYTES
from ddiloco.learner.documents import data_files, iter_documents, stdlib_documents

logger = logging.getLogger(__name__)

FORMAT: Final = 1
"""Version of the cache files' content; part of their key."""
EVAL_EVERY: Final = 20
"""Every this many documents one is held out for eval (5 %, as ``data.split_eval``)."""
EVAL_MAX_TOKENS: Final = 1 << 20
"""The eval set stops growing at this many tokens (eval uses a few batches of windows)."""
BATCH_DOCUMENTS: Final = 256
"""Documents handed to the tokenizer at once."""


class TextTokens(Protocol):
    """What the corpus needs of a tokenizer."""

    digest: str
    """Identifies the tokenization (part of the cache key)."""
    eos: int
    """The id that ends every document."""
    vocab_size: int

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]: ...


class ByteTokens:
    """Byte-level tokens: the UTF-8 bytes of the text, 0..255; documents end with byte 0
    (NUL, which text does not hold), since 256 ids leave no room for a special token."""

    digest = "bytes-v1"
    eos = 0
    vocab_size = 256

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


class HFTokens:
    """A Hugging Face tokenizer (``hf.load_tokenizer``); no special tokens are added."""

    def __init__(self, tokenizer: Any, digest: str) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "the tokenizer has no eos_token, which ends every document: give a tokenizer "
                "directory whose tokenizer_config.json names one"
            )
        self.tokenizer = tokenizer
        self.digest = f"hf-{digest}"
        self.eos = int(tokenizer.eos_token_id)
        self.vocab_size = len(tokenizer)

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow (Python) tokenizer
            ids = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
            return [np.asarray(x, dtype=np.int64) for x in ids]
        # the Rust tokenizer itself, without offsets: the same ids, twice as fast as __call__
        batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [
            np.asarray(e.ids, dtype=np.int64) for e in batch(list(texts), add_special_tokens=False)
        ]


@dataclass
class Corpus:
    """A learner's share of a document corpus."""

    train: np.ndarray
    """This learner's shard (empty for ``eval_only``)."""
    eval: np.ndarray
    """The held-out documents' tokens, identical on every learner."""
    train_documents: int
    eval_documents: int
    source: str


def cache_root() -> Path:
    """Where tokenized corpora are kept: ``$XDG_CACHE_HOME/ddiloco/tokens`` or
    ``~/.cache/ddiloco/tokens``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ddiloco" / "tokens"


def _key(
    files: Sequence[Path] | None, tokens: TextTokens, field: str, max_bytes: int | None
) -> str:
    ident: dict[str, Any] = {
        "format": FORMAT,
        "tokenizer": tokens.digest,
        "field": field,
        "eval": [EVAL_EVERY, EVAL_MAX_TOKENS],
    }
    if files is None:
        ident["stdlib"] = [sysconfig.get_paths()["stdlib"], max_bytes]
    else:
        ident["files"] = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    raw = json.dumps(ident, sort_keys=True).encode()
    return hashlib.sha256(raw).hexdigest()[:24]


class _Cached:
    """One tokenized part (``eval`` or ``shard-i-of-m``) in the cache: ``<key>.<part>.tokens``
    and its ``.json`` sidecar, written to temporary names and renamed (sidecar last)."""

    def __init__(self, root: Path, key: str, part: str, dtype: np.dtype) -> None:
        self.data = root / f"{key}.{part}.tokens"
        self.meta = root / f"{key}.{part}.json"
        self.dtype = dtype

    def load(self) -> tuple[np.ndarray, dict[str, Any]] | None:
        try:
            meta = json.loads(self.meta.read_text())
            n = int(meta["tokens"])
            if (
                meta.get("dtype") != self.dtype.name
                or self.data.stat().st_size != n * self.dtype.itemsize
            ):
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        tokens = np.memmap(self.data, dtype=self.dtype, mode="r") if n else np.zeros(0, self.dtype)
        return tokens, meta

    def writer(self) -> _Writer:
        return _Writer(self)


class _Writer:
    """Appends token arrays to a part's temporary file; ``commit`` renames it into place."""

    def __init__(self, part: _Cached) -> None:
        self.part = part
        self.tmp = part.data.with_name(f".{part.data.name}.{os.getpid()}.tmp")
        self.file = open(self.tmp, "wb")  # noqa: SIM115 - closed in commit()
        self.count = 0

    def add(self, ids: np.ndarray) -> None:
        self.file.write(np.asarray(ids, dtype=self.part.dtype).tobytes())
        self.count += len(ids)

    def abandon(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)

    def commit(self, meta: dict[str, Any]) -> np.ndarray:
        self.file.close()
        os.replace(self.tmp, self.part.data)
        tmp = self.part.meta.with_name(f".{self.part.meta.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**meta, "tokens": self.count, "dtype": self.part.dtype.name}))
        os.replace(tmp, self.part.meta)
        loaded = self.part.load()
        assert loaded is not None, self.part.meta
        return loaded[0]


def _writable(root: Path) -> Path:
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return root
    except OSError as e:
        fallback = Path(tempfile.gettempdir()) / "ddiloco-tokens"
        logger.warning("token cache %s is not writable (%s); using %s", root, e, fallback)
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def load_corpus(
    data: str | os.PathLike[str] | None,
    tokens: TextTokens,
    *,
    data_field: str = "text",
    learner_index: int = 0,
    num_learners: int = 1,
    vocab_size: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    eval_only: bool = False,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
) -> Corpus:
    """Learner ``learner_index``'s shard and the eval set of ``data`` (None: the standard
    library's sources, up to ``max_bytes``, one document per file), from the cache when it
    holds them (see the module docstring). ``vocab_size`` (the model's) refuses token ids
    it cannot embed. ``eval_only`` reads only as far as the eval set needs."""
    if not 0 <= learner_index < num_learners:
        raise ValueError(f"learner_index must be in [0, {num_learners}), got {learner_index}")
    files = None if data is None else data_files(data)
    source = "the standard library's sources" if data is None else str(Path(data).expanduser())
    root = _writable(Path(cache_dir) if cache_dir else cache_root())
    key = _key(files, tokens, data_field, max_bytes)
    dtype = np.dtype(np.uint16 if tokens.vocab_size <= 1 << 16 else np.uint32)
    eval_part = _Cached(root, key, "eval", dtype)
    shard_part = _Cached(root, key, f"shard-{learner_index}-of-{num_learners}", dtype)
    have_eval, have_shard = eval_part.load(), None if eval_only else shard_part.load()
    if have_eval is not None and (eval_only or have_shard is not None):
        eval_tokens, eval_meta = have_eval
        train, train_meta = have_shard if have_shard is not None else (np.zeros(0, dtype), {})
        logger.info("tokenized %s from the cache %s (key %s)", source, root, key)
        return Corpus(
            train,
            eval_tokens,
            int(train_meta.get("documents", 0)),
            int(eval_meta["documents"]),
            source,
        )

    docs = stdlib_documents(max_bytes) if files is None else iter_documents(files, data_field)
    known_eval = set(have_eval[1]["eval_docs"]) if have_eval is not None else None
    limit = vocab_size if vocab_size is not None else tokens.vocab_size
    if tokens.eos >= limit:  # it ends every document: an embedding lookup would fail on it
        raise ValueError(
            f"{source}: the tokenizer's end-of-document id {tokens.eos} does not fit the "
            f"model's vocab_size {limit}; use the model's own tokenizer"
        )
    eos = np.array([tokens.eos], dtype=np.int64)

    def encoded(texts: list[str]) -> Iterator[np.ndarray]:
        for ids in tokens.encode(texts):
            if len(ids) and int(ids.max()) >= limit:
                raise ValueError(
                    f"{source}: token id {int(ids.max())} does not fit the model's vocab_size "
                    f"{limit}; use the model's own tokenizer"
                )
            yield ids

    eval_out = eval_part.writer() if have_eval is None else None
    train_out = None if eval_only else shard_part.writer()
    eval_docs: list[int] = []
    train_docs = 0
    pending: list[str] = []

    def flush() -> None:
        assert train_out is not None
        for ids in encoded(pending):
            train_out.add(ids)
            train_out.add(eos)
        pending.clear()

    try:
        k, j = 0, 0
        for text in docs:
            if not text:
                continue
            if known_eval is not None:
                is_eval = k in known_eval
            else:
                assert eval_out is not None
                is_eval = k % EVAL_EVERY == 0 and eval_out.count < EVAL_MAX_TOKENS
            k += 1
            if is_eval:
                eval_docs.append(k - 1)
                if eval_out is not None:
                    (ids,) = encoded([text])
                    eval_out.add(ids)
                    eval_out.add(eos)
                continue
            if train_out is None:
                if eval_out is not None and eval_out.count >= EVAL_MAX_TOKENS:
                    break  # eval only, and no further document can be an eval one
                continue
            if j % num_learners == learner_index:
                pending.append(text)
                train_docs += 1
                if len(pending) >= BATCH_DOCUMENTS:
                    flush()
            j += 1
        if pending:
            flush()
    except BaseException:
        for out in (eval_out, train_out):
            if out is not None:
                out.abandon()
        raise
    meta = {"source": source}
    if eval_out is not None:
        eval_tokens = eval_out.commit({**meta, "documents": len(eval_docs), "eval_docs": eval_docs})
    else:
        assert have_eval is not None
        eval_tokens = have_eval[0]
    train = np.zeros(0, dtype)
    if train_out is not None:
        train = train_out.commit({**meta, "documents": train_docs})
    logger.info(
        "tokenized %s: %d eval documents (%d tokens), %d documents (%d tokens) for learner %d "
        "of %d; cached in %s",
        source,
        len(eval_docs),
        len(eval_tokens),
        train_docs,
        len(train),
        learner_index,
        num_learners,
        root,
    )
    return Corpus(train, eval_tokens, train_docs, len(eval_docs), source)
