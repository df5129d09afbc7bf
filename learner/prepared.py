"""Prepared token datasets: a corpus tokenized once (``ddiloco prepare``), read lazily by learners.

    ds = open_dataset("s3://bucket/corpus")          # or a local directory, file://, memory://
    ds.check_model(vocab_size=258, tokenizer_digest="hf-...")
    train = ds.train(learner_index=1, num_learners=4)   # only this slot's chunks, not read yet
    train.windows(np.array([0, 4096]), 1025)           # [2, 1025] int64 tokens, read on demand
    held_out = ds.eval()                               # the eval set, the same on every learner

Files (a local directory, or any fsspec URL prefix such as ``s3://bucket/prefix``):

    manifest.json         written last: a dataset exists once its manifest does
    eval.tokens           the held-out documents' tokens
    chunk-000000.tokens   training documents' tokens, documents in order, each ending with EOS
    chunk-000001.tokens
    ...

A ``.tokens`` file is raw little-endian tokens, no header: ``uint16``, or ``uint32`` when the
tokenizer has more than 65,536 ids. ``manifest.json``, format version 1 (``VERSION``)::

    {"format": "ddiloco-prepared-tokens", "version": 1, "dtype": "uint16",
     "tokenizer": "hf-<digest of its files>" | "bytes-v1", "eos": 257, "vocab_size": 258,
     "data_field": "text", "source": "<what was read>",
     "documents": {"train": 9500, "eval": 500},
     "eval": {"file": "eval.tokens", "tokens": 1048576},
     "chunks": [{"file": "chunk-000000.tokens", "tokens": 8388608}, ...]}

``tokenizer`` is the digest corpus.py's ``TextTokens`` carry (``HFTokens``: ``hf-`` and
``hf.tokenizer_digest``; ``ByteTokens``: ``bytes-v1``); ``vocab_size`` is the tokenizer's, so
every id in the files is below it. A reader refuses another format name or version.

Held out at prepare time with corpus.py's rule, so the eval set is one file every learner
reads whole: document ``k`` (non-empty documents, from 0) is an eval document when
``k % EVAL_EVERY == 0``, until the eval set holds ``EVAL_MAX_TOKENS`` tokens. Every other
document goes, in order, to the current chunk, which is closed at a document boundary once it
holds ``chunk_tokens`` tokens. Learner ``i`` of ``M`` trains chunks ``j`` with ``j % M == i``,
in order, as one token array (``ChunkedTokens``); fewer chunks than learners is refused.

Reading is lazy: a local chunk is memory-mapped, a remote one read by byte ranges, a batch's
windows at once (``fs.cat_ranges``: concurrent on object stores), through a small LRU cache
of fixed-size blocks. Opening reads the manifest only, so a learner's time to its first step
does not grow with the corpus; its windows per epoch come from the manifest's token counts.
S3 credentials and endpoint come from the standard AWS environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_REGION``), read by botocore; connect
timeouts and retries are short (``S3_OPTIONS``) so that an unreachable store is named in
seconds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from ddiloco.learner.corpus import BATCH_DOCUMENTS, EVAL_EVERY, EVAL_MAX_TOKENS, TextTokens

logger = logging.getLogger(__name__)

FORMAT: Final = "ddiloco-prepared-tokens"
VERSION: Final = 1
"""The format version this module writes and reads."""
MANIFEST: Final = "manifest.json"
EVAL_FILE: Final = "eval.tokens"
DEFAULT_CHUNK_TOKENS: Final = 1 << 23
"""Tokens per chunk file (16 MiB of uint16): 2 GiB of uint16 tokens make 128 chunks."""
BLOCK_BYTES: Final = 1 << 16
"""Unit of a remote read and of the remote block cache."""
CACHE_BLOCKS: Final = 256
"""Blocks the remote cache keeps (16 MiB)."""
S3_OPTIONS: Final[dict[str, Any]] = {
    "config_kwargs": {
        "connect_timeout": 3,
        "read_timeout": 30,
        "retries": {"max_attempts": 2, "mode": "standard"},
    },
}
"""s3fs options: an unreachable endpoint fails in seconds, not after minutes of retries."""
S3_RETRIES: Final = 2
"""s3fs's own retries around each call: its default, 5, times botocore's attempts, each
waiting out a connect timeout, makes minutes against an endpoint that does not answer."""


class PreparedError(ValueError):
    """A prepared dataset that cannot be read: its manifest is missing, of another format or
    version, or disagrees with its files or with the job's model."""


class StoreUnreachable(OSError):
    """The store holding a prepared dataset did not answer (or refused the credentials)."""


def chunk_file(j: int) -> str:
    return f"chunk-{j:06d}.tokens"


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian ``uint16`` for up to 65,536 ids, else ``uint32``."""
    return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


def is_url(data: str | os.PathLike[str]) -> bool:
    """Whether ``data`` is a URL (``s3://``, ``file://``, ``memory://`` ...) and not a path."""
    return "://" in str(data)


def is_prepared(data: str | os.PathLike[str] | None) -> bool:
    """Whether ``data`` names a prepared dataset: any URL (only prepared datasets are read
    remotely), or a local directory holding a manifest or an eval file (a half-written one,
    which ``open_dataset`` refuses, rather than reading its token files as text)."""
    if data is None:
        return False
    if is_url(data):
        return True
    path = Path(data).expanduser()
    return (path / MANIFEST).is_file() or (path / EVAL_FILE).is_file()


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec filesystem, path in it)`` for a URL or local path; s3 with ``S3_OPTIONS``."""
    import fsspec.core

    options = S3_OPTIONS if url.startswith(("s3://", "s3a://")) else {}
    fs, path = fsspec.core.url_to_fs(url, **options)
    if hasattr(fs, "retries") and options:
        fs.retries = S3_RETRIES
    return fs, path.rstrip("/") or path


def _local_path(fs: Any, path: str) -> Path | None:
    """The local path of ``path`` when ``fs`` is the local filesystem (memory-mappable)."""
    from fsspec.implementations.local import LocalFileSystem

    return Path(path) if isinstance(fs, LocalFileSystem) else None


# --- the manifest ------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` holds (the module docstring)."""

    dtype: str
    tokenizer: str
    eos: int
    vocab_size: int
    data_field: str
    source: str
    chunks: list[int]
    """Tokens of chunk ``j`` (file ``chunk_file(j)``)."""
    eval_tokens: int
    train_documents: int = 0
    eval_documents: int = 0
    format: str = FORMAT
    version: int = VERSION

    def to_json(self) -> str:
        d = {
            "format": self.format,
            "version": self.version,
            "dtype": self.dtype,
            "tokenizer": self.tokenizer,
            "eos": self.eos,
            "vocab_size": self.vocab_size,
            "data_field": self.data_field,
            "source": self.source,
            "documents": {"train": self.train_documents, "eval": self.eval_documents},
            "eval": {"file": EVAL_FILE, "tokens": self.eval_tokens},
            "chunks": [{"file": chunk_file(j), "tokens": n} for j, n in enumerate(self.chunks)],
        }
        return json.dumps(d, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Manifest:
        """Parse and check a manifest; ``PreparedError`` naming ``where`` if it is not one."""
        try:
            d = json.loads(text)
        except ValueError as e:
            raise PreparedError(f"{where}: {MANIFEST} is not JSON ({e})") from e
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else None
            raise PreparedError(f"{where}: {MANIFEST} is of format {got!r}, not {FORMAT!r}")
        if d.get("version") != VERSION:
            raise PreparedError(
                f"{where}: prepared dataset format version {d.get('version')!r}; this ddiloco "
                f"reads version {VERSION}: prepare it again with this version"
            )
        try:
            chunks = d["chunks"]
            m = cls(
                dtype=str(d["dtype"]),
                tokenizer=str(d["tokenizer"]),
                eos=int(d["eos"]),
                vocab_size=int(d["vocab_size"]),
                data_field=str(d["data_field"]),
                source=str(d["source"]),
                chunks=[int(c["tokens"]) for c in chunks],
                eval_tokens=int(d["eval"]["tokens"]),
                train_documents=int(d.get("documents", {}).get("train", 0)),
                eval_documents=int(d.get("documents", {}).get("eval", 0)),
            )
            names = [str(c["file"]) for c in chunks] + [str(d["eval"]["file"])]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PreparedError(f"{where}: {MANIFEST} lacks or mangles {e}") from e
        if names != [chunk_file(j) for j in range(len(m.chunks))] + [EVAL_FILE]:
            raise PreparedError(f"{where}: {MANIFEST} names files other than this format's")
        if m.dtype not in ("uint16", "uint32") or token_dtype(m.vocab_size).name != m.dtype:
            raise PreparedError(
                f"{where}: dtype {m.dtype!r} does not hold a vocabulary of {m.vocab_size}"
            )
        if min([m.eval_tokens, *m.chunks]) < 0 or not 0 <= m.eos < m.vocab_size:
            raise PreparedError(f"{where}: {MANIFEST} has negative counts or an eos out of range")
        return m

    @property
    def np_dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)

    @property
    def train_tokens(self) -> int:
        return sum(self.chunks)


def chunks_of(num_chunks: int, learner_index: int, num_learners: int) -> list[int]:
    """The chunks learner ``learner_index`` of ``num_learners`` trains: ``j % M == i``."""
    if num_learners < 1 or not 0 <= learner_index < num_learners:
        raise ValueError(f"learner_index must be in [0, {num_learners}), got {learner_index}")
    if num_chunks < num_learners:
        raise PreparedError(
            f"the prepared dataset has {num_chunks} chunks, fewer than the {num_learners} "
            "learners that each need one: prepare it again with a smaller --chunk-tokens"
        )
    return list(range(learner_index, num_chunks, num_learners))


# --- writing -----------------------------------------------------------------------------


class DatasetWriter:
    """Writes a prepared dataset to ``dest``: ``add_eval`` and ``add_train`` tokens (a
    document's, EOS included), ``end_document`` after each training document (a chunk closes
    only there), then ``commit``, which writes the manifest last. Refuses a ``dest`` that
    already holds a manifest. ``abandon`` removes what was written."""

    def __init__(
        self,
        dest: str,
        *,
        tokenizer: str,
        eos: int,
        vocab_size: int,
        data_field: str,
        source: str,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.dest = dest
        self.fs, self.root = filesystem(dest)
        try:
            exists = self.fs.exists(self._path(MANIFEST))
        except PermissionError as e:  # s3: a 403 on the HEAD, wrong or missing credentials
            raise PermissionError(
                f"{dest}: access denied ({e}); check the store's credentials "
                "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)"
            ) from e
        if exists:
            raise FileExistsError(
                f"{dest} already holds a prepared dataset ({MANIFEST}); give another --out "
                "or remove it"
            )
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            self._eval = self.fs.open(self._path(EVAL_FILE), "wb")
        except OSError as e:
            raise OSError(f"cannot write a prepared dataset at {dest}: {e.strerror or e}") from e
        self.meta = {
            "tokenizer": tokenizer,
            "eos": eos,
            "vocab_size": vocab_size,
            "data_field": data_field,
            "source": source,
        }
        self.dtype = token_dtype(vocab_size)
        self.chunk_tokens = chunk_tokens
        self.chunks: list[int] = []
        self.eval_tokens = 0
        self.train_documents = 0
        self.eval_documents = 0
        self._chunk: Any = None
        self._count = 0

    def _path(self, name: str) -> str:
        return posixpath.join(self.root, name) if self.root else name

    def _tokens(self, ids: np.ndarray) -> bytes:
        return np.asarray(ids).astype(self.dtype, copy=False).tobytes()

    def add_eval(self, ids: np.ndarray, documents: int = 1) -> None:
        self._eval.write(self._tokens(ids))
        self.eval_tokens += len(ids)
        self.eval_documents += documents

    def add_train(self, ids: np.ndarray) -> None:
        if self._chunk is None:
            self._chunk = self.fs.open(self._path(chunk_file(len(self.chunks))), "wb")
            self._count = 0
        self._chunk.write(self._tokens(ids))
        self._count += len(ids)

    def end_document(self, documents: int = 1) -> None:
        self.train_documents += documents
        if self._chunk is not None and self._count >= self.chunk_tokens:
            self._close_chunk()

    def add_documents(self, tokens: np.ndarray, lengths: Sequence[int]) -> None:
        """Training documents laid end to end (``lengths`` tokens each, EOS included), written
        in as few writes as the chunk boundaries allow (the same files as ``add_train`` and
        ``end_document`` per document)."""
        ends = np.cumsum(lengths, dtype=np.int64)
        done, first = 0, 0
        while first < len(ends):
            room = self.chunk_tokens - self._count  # the document reaching it closes the chunk
            last = min(int(np.searchsorted(ends, done + room)), len(ends) - 1)
            self.add_train(tokens[done : ends[last]])
            self.end_document(last + 1 - first)
            done, first = int(ends[last]), last + 1

    def _close_chunk(self) -> None:
        self._chunk.close()
        self.chunks.append(self._count)
        self._chunk, self._count = None, 0

    def commit(self) -> Manifest:
        if self._chunk is not None:
            self._close_chunk()
        self._eval.close()
        m = Manifest(
            dtype=self.dtype.name,
            chunks=list(self.chunks),
            eval_tokens=self.eval_tokens,
            train_documents=self.train_documents,
            eval_documents=self.eval_documents,
            **self.meta,
        )
        self.fs.pipe_file(self._path(MANIFEST), m.to_json().encode())
        return m

    def abandon(self) -> None:
        for f in (self._chunk, self._eval):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        for name in [EVAL_FILE, *(chunk_file(j) for j in range(len(self.chunks) + 1))]:
            with contextlib.suppress(OSError):
                self.fs.rm_file(self._path(name))


@dataclass
class PrepareStats:
    """Progress of ``write_prepared``: documents and tokens (EOS included) written so far."""

    documents: int = 0
    tokens: int = 0


def write_prepared(
    dest: str,
    documents: Iterable[str],
    tokens: TextTokens,
    *,
    data_field: str,
    source: str,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    progress: Callable[[PrepareStats], None] | None = None,
) -> Manifest:
    """Tokenize ``documents`` (streamed: a batch of ``BATCH_DOCUMENTS`` in memory at once)
    with ``tokens`` and write them as a prepared dataset at ``dest`` (the module docstring).
    ``progress`` is called after each batch."""
    out = DatasetWriter(
        dest,
        tokenizer=tokens.digest,
        eos=tokens.eos,
        vocab_size=tokens.vocab_size,
        data_field=data_field,
        source=source,
        chunk_tokens=chunk_tokens,
    )
    eos = np.array([tokens.eos], dtype=np.int64)
    stats = PrepareStats()
    batch: list[str] = []

    def encoded(texts: list[str]) -> list[np.ndarray]:
        out = tokens.encode(texts)
        for ids in out:
            if len(ids) and int(ids.max()) >= tokens.vocab_size:
                raise ValueError(
                    f"{source}: token id {int(ids.max())} is outside the tokenizer's "
                    f"{tokens.vocab_size} ids"
                )
            stats.tokens += len(ids) + 1
        stats.documents += len(texts)
        return out

    def flush() -> None:
        docs = encoded(batch)
        flat = np.concatenate([part for ids in docs for part in (ids, eos)])
        out.add_documents(flat, [len(ids) + 1 for ids in docs])
        batch.clear()
        if progress is not None:
            progress(stats)

    try:
        k = 0
        for text in documents:
            if not text:
                continue
            # corpus.py's rule, on exact counts: an eval document is encoded as it comes
            if k % EVAL_EVERY == 0 and out.eval_tokens < EVAL_MAX_TOKENS:
                (ids,) = encoded([text])
                out.add_eval(np.concatenate([ids, eos]))
            else:
                batch.append(text)
                if len(batch) >= BATCH_DOCUMENTS:
                    flush()
            k += 1
        if batch:
            flush()
        return out.commit()
    except BaseException:
        out.abandon()
        raise


# --- reading -----------------------------------------------------------------------------


class ChunkedTokens:
    """Chunks read as one token array, lazily: ``len`` is known from the manifest, and
    ``windows(starts, length)`` gathers ``[len(starts), length]`` tokens (int64), a window
    crossing a chunk boundary included. ``read(pieces)`` fetches ``(chunk, lo, hi)`` token
    ranges for a whole batch at once (the ``data.TokenSource`` interface)."""

    def __init__(
        self, lengths: Sequence[int], read: Callable[[list[tuple[int, int, int]]], list[np.ndarray]]
    ) -> None:
        self.lengths = list(lengths)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        self._read = read

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        starts = np.asarray(starts, dtype=np.int64)
        if len(starts) and (starts.min() < 0 or starts.max() + length > len(self)):
            raise IndexError(f"windows of {length} beyond {len(self)} tokens")
        pieces: list[tuple[int, int, int]] = []
        owners: list[int] = []
        for w, s in enumerate(starts.tolist()):
            end = s + length
            c = int(np.searchsorted(self.offsets, s, side="right")) - 1
            while s < end:
                lo = s - int(self.offsets[c])
                hi = min(end, int(self.offsets[c + 1])) - int(self.offsets[c])
                if hi > lo:
                    pieces.append((c, lo, hi))
                    owners.append(w)
                s = int(self.offsets[c]) + hi
                c += 1
        out = np.empty((len(starts), length), dtype=np.int64)
        fill = [0] * len(starts)
        for w, arr in zip(owners, self._read(pieces), strict=True):
            out[w, fill[w] : fill[w] + len(arr)] = arr
            fill[w] += len(arr)
        return out


class RemoteChunks:
    """Byte-range reads of chunk files through fsspec, in blocks of ``block_bytes``: the
    blocks a batch lacks are fetched in one ``cat_ranges`` call (adjacent ones coalesced),
    and the last ``cache_blocks`` are kept (LRU)."""

    def __init__(
        self,
        fs: Any,
        paths: Sequence[str],
        lengths: Sequence[int],
        dtype: np.dtype,
        url: str,
        *,
        block_bytes: int = BLOCK_BYTES,
        cache_blocks: int = CACHE_BLOCKS,
    ) -> None:
        self.fs, self.paths, self.dtype, self.url = fs, list(paths), dtype, url
        self.sizes = [n * dtype.itemsize for n in lengths]
        self.block = block_bytes
        self.capacity = cache_blocks
        self.cache: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self.fetched_bytes = 0
        self.requests = 0

    def read(self, pieces: list[tuple[int, int, int]]) -> list[np.ndarray]:
        item, b = self.dtype.itemsize, self.block
        need: set[tuple[int, int]] = set()
        for c, lo, hi in pieces:
            need.update((c, k) for k in range(lo * item // b, ((hi * item) - 1) // b + 1))
        have = {key: self.cache[key] for key in need if key in self.cache}
        missing = sorted(need - have.keys())
        if missing:
            have.update(self._fetch(missing))
        for key in sorted(need):
            self.cache[key] = have[key]
            self.cache.move_to_end(key)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        out = []
        for c, lo, hi in pieces:
            first, last = lo * item // b, ((hi * item) - 1) // b
            raw = b"".join(have[(c, k)] for k in range(first, last + 1))
            skip = lo * item - first * b
            out.append(np.frombuffer(raw, dtype=self.dtype, count=hi - lo, offset=skip))
        return out

    def _fetch(self, blocks: list[tuple[int, int]]) -> dict[tuple[int, int], bytes]:
        runs: list[tuple[int, int, int]] = []  # (chunk, first block, last block)
        for c, k in blocks:
            if runs and runs[-1][0] == c and runs[-1][2] == k - 1:
                runs[-1] = (c, runs[-1][1], k)
            else:
                runs.append((c, k, k))
        starts = [k0 * self.block for _, k0, _ in runs]
        ends = [min((k1 + 1) * self.block, self.sizes[c]) for c, _, k1 in runs]
        try:
            datas = self.fs.cat_ranges(
                [self.paths[c] for c, _, _ in runs], starts, ends, on_error="raise"
            )
        except Exception as e:
            raise StoreUnreachable(f"reading the prepared dataset {self.url}: {e}") from e
        self.requests += len(runs)
        got: dict[tuple[int, int], bytes] = {}
        for (c, k0, k1), s, e, data in zip(runs, starts, ends, datas, strict=True):
            if len(data) != e - s:
                raise OSError(
                    f"{self.url}: {posixpath.basename(self.paths[c])} is shorter than its "
                    f"manifest says ({s + len(data)} bytes, expected at least {e})"
                )
            self.fetched_bytes += len(data)
            for k in range(k0, k1 + 1):
                got[(c, k)] = data[(k - k0) * self.block : (k - k0 + 1) * self.block]
        return got


class PreparedDataset:
    """An opened prepared dataset: its manifest, and readers of its files."""

    def __init__(self, url: str, fs: Any, root: str, manifest: Manifest) -> None:
        self.url, self.fs, self.root, self.manifest = url, fs, root, manifest

    def path(self, name: str) -> str:
        return posixpath.join(self.root, name) if self.root else name

    def check_model(self, vocab_size: int, tokenizer_digest: str | None = None) -> None:
        """Refuse, naming both, a model that cannot embed every id the dataset's tokenizer
        may hold, or a ``--tokenizer`` other than the one it was prepared with."""
        m = self.manifest
        if m.vocab_size > vocab_size:
            raise PreparedError(
                f"{self.url} was prepared with tokenizer {m.tokenizer} ({m.vocab_size} ids, "
                f"up to {m.vocab_size - 1}), but the model's vocab_size is {vocab_size}: use "
                "the model's own tokenizer"
            )
        if tokenizer_digest is not None and tokenizer_digest != m.tokenizer:
            raise PreparedError(
                f"{self.url} was prepared with tokenizer {m.tokenizer}, but --tokenizer is "
                f"{tokenizer_digest}: prepare it again with that tokenizer, or leave "
                "--tokenizer out"
            )

    def _local(self, name: str, tokens: int) -> np.ndarray:
        local = _local_path(self.fs, self.path(name))
        assert local is not None
        dtype = self.manifest.np_dtype
        try:
            size = local.stat().st_size
        except FileNotFoundError:
            raise PreparedError(f"{self.url}: {name} is missing") from None
        if size != tokens * dtype.itemsize:
            raise PreparedError(
                f"{self.url}: {name} holds {size} bytes, its manifest says {tokens} tokens "
                f"of {dtype.name}"
            )
        if tokens == 0:
            return np.zeros(0, dtype)
        return np.memmap(local, dtype=dtype, mode="r")

    def train(self, learner_index: int, num_learners: int) -> np.ndarray | ChunkedTokens:
        """Learner ``learner_index``'s chunks as one lazy token array (nothing read yet)."""
        mine = chunks_of(len(self.manifest.chunks), learner_index, num_learners)
        lengths = [self.manifest.chunks[j] for j in mine]
        dtype = self.manifest.np_dtype
        if _local_path(self.fs, self.root) is not None:
            maps = [self._local(chunk_file(j), n) for j, n in zip(mine, lengths, strict=True)]
            if len(maps) == 1:
                return maps[0]
            return ChunkedTokens(lengths, lambda pieces: [maps[c][lo:hi] for c, lo, hi in pieces])
        remote = RemoteChunks(
            self.fs, [self.path(chunk_file(j)) for j in mine], lengths, dtype, self.url
        )
        return ChunkedTokens(lengths, remote.read)

    def eval(self) -> np.ndarray:
        """The eval set, the same on every learner (memory-mapped locally, else read whole)."""
        n = self.manifest.eval_tokens
        if _local_path(self.fs, self.root) is not None:
            return self._local(EVAL_FILE, n)
        try:
            raw = self.fs.cat_file(self.path(EVAL_FILE))
        except Exception as e:
            raise StoreUnreachable(f"reading the prepared dataset {self.url}: {e}") from e
        dtype = self.manifest.np_dtype
        if len(raw) != n * dtype.itemsize:
            raise PreparedError(
                f"{self.url}: {EVAL_FILE} holds {len(raw)} bytes, its manifest says {n} tokens "
                f"of {dtype.name}"
            )
        return np.frombuffer(raw, dtype=dtype)


def open_dataset(url: str | os.PathLike[str]) -> PreparedDataset:
    """Open the prepared dataset at ``url`` (a local directory or an fsspec URL) by its
    manifest alone. ``PreparedError`` when there is no valid manifest (a half-written dataset
    has none yet); ``OSError`` naming ``url`` when its store cannot be reached."""
    where = str(url) if is_url(url) else str(Path(url).expanduser())
    try:
        fs, root = filesystem(where)
    except (ImportError, ValueError) as e:
        raise PreparedError(f"{where}: no filesystem for this URL ({e})") from e
    manifest = posixpath.join(root, MANIFEST) if root else MANIFEST
    try:
        text = fs.cat_file(manifest)
    except FileNotFoundError:
        raise PreparedError(
            f"{where}: no {MANIFEST}: not a prepared dataset, or one still being written "
            f"(`ddiloco prepare` writes {MANIFEST} last)"
        ) from None
    except PermissionError as e:
        raise PreparedError(f"{where}: access to {MANIFEST} denied ({e})") from e
    except Exception as e:  # botocore and aiohttp errors: an unreachable or refusing store
        raise StoreUnreachable(
            f"cannot read the prepared dataset {where}: {type(e).__name__}: {e}"
        ) from e
    m = Manifest.from_json(text, where)
    logger.info(
        "prepared dataset %s: %d chunks, %d training tokens, %d eval tokens (%s, %s)",
        where,
        len(m.chunks),
        m.train_tokens,
        m.eval_tokens,
        m.dtype,
        m.tokenizer,
    )
    return PreparedDataset(where, fs, root, m)
