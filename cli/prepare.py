"""`ddiloco prepare`: tokenize a corpus once into a prepared dataset that learners read lazily.

    ddiloco prepare data/ --out /data/prepared --tokenizer tok/      # a HF tokenizer
    ddiloco prepare docs.jsonl --out s3://bucket/corpus              # byte-level tokens
    ddiloco learner --data s3://bucket/corpus ...                    # reads only its chunks

SOURCE is what `--data` reads (learner/documents.py: a text file, a directory of text, JSONL
or Parquet files) or a directory written by the `datasets` library's `save_to_disk` (its
`train` split when it holds several). Documents are streamed, a batch at a time; the eval set
is held out as the learner holds it out, and the rest is written in chunks of about
`--chunk-tokens` tokens (learner/prepared.py describes the files). DEST is a local directory
or any fsspec URL (`s3://` with the standard AWS environment variables); its manifest is
written last. Errors are one line (`ddiloco prepare: error: ...`): exit 2 for bad input, 1
for a store that cannot be reached.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddiloco.cli.errors import RuntimeFailure, usage_errors

PROG = "ddiloco prepare"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=PROG, description="Tokenize a corpus once into a prepared dataset (chunks)."
    )
    ap.add_argument("source", help="text file, folder of text/JSONL/Parquet, or a saved dataset")
    ap.add_argument("--out", required=True, help="directory or fsspec URL (s3://bucket/prefix)")
    ap.add_argument(
        "--tokenizer", help="local tokenizer directory or tokenizer.json (default: bytes)"
    )
    ap.add_argument("--data-field", default="text", help="text column of JSONL/Parquet rows")
    ap.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="tokens per chunk file (default 8388608); learners share chunks round-robin, so "
        "a job needs at least as many chunks as learners",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return ap.parse_args(argv)


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory that `datasets`' ``save_to_disk`` wrote."""
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
    )


def saved_dataset_documents(path: Path, field: str) -> Iterator[str]:
    """The ``field`` texts of a saved dataset (memory-mapped Arrow, read in batches)."""
    from ddiloco.learner.documents import _datasets

    ds: Any = _datasets().load_from_disk(str(path))
    if hasattr(ds, "keys"):  # a DatasetDict
        if "train" not in ds:
            raise ValueError(f"{path}: a saved DatasetDict without a 'train' split ({list(ds)})")
        ds = ds["train"]
    if field not in ds.column_names:
        raise ValueError(
            f"{path}: no column {field!r} (it has {ds.column_names[:10]}); name the text column "
            "with --data-field"
        )
    for batch in ds.select_columns([field]).iter(batch_size=1024):
        for n, text in enumerate(batch[field]):
            if text is None:
                continue
            if not isinstance(text, str):
                raise ValueError(f"{path}: row {n} field {field!r} is not text")
            yield text


def source_documents(source: str, field: str) -> tuple[Iterator[str], int, str]:
    """``(documents, bytes of the source files, description)`` of SOURCE."""
    from ddiloco.learner.documents import data_files, iter_documents

    path = Path(source).expanduser()
    if is_saved_dataset(path):
        files = [p for p in path.rglob("*") if p.is_file()]
        described = str(path.resolve())
        return saved_dataset_documents(path, field), sum(f.stat().st_size for f in files), described
    files = data_files(path)  # a missing path or an empty directory is refused by name
    return iter_documents(files, field), sum(f.stat().st_size for f in files), str(path.resolve())


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    with usage_errors(PROG):
        from ddiloco.learner import corpus, hf, prepared

        chunk_tokens = args.chunk_tokens or prepared.DEFAULT_CHUNK_TOKENS
        if chunk_tokens < 1:
            raise ValueError(f"--chunk-tokens must be >= 1, got {chunk_tokens}")
        tokens: corpus.TextTokens = corpus.ByteTokens()
        if args.tokenizer is not None:
            tok = Path(args.tokenizer).expanduser()
            tokens = corpus.HFTokens(hf.load_tokenizer(tok), hf.tokenizer_digest(tok))
        docs, size, described = source_documents(args.source, args.data_field)
        start = time.monotonic()
        last = [start]

        def progress(stats: prepared.PrepareStats) -> None:
            now = time.monotonic()
            if not args.quiet and now - last[0] >= 5:
                last[0] = now
                sys.stderr.write(f"  {stats.documents} documents, {stats.tokens} tokens\n")

        try:
            m = prepared.write_prepared(
                args.out,
                docs,
                tokens,
                data_field=args.data_field,
                source=described,
                chunk_tokens=chunk_tokens,
                progress=progress,
            )
        except (ValueError, OSError):
            raise
        except Exception as e:  # an object store's client errors: it cannot be reached
            if not prepared.is_url(args.out):
                raise
            raise RuntimeFailure(f"writing {args.out}: {type(e).__name__}: {e}") from e
    took = max(time.monotonic() - start, 1e-9)
    sys.stdout.write(
        f"prepared {m.train_documents + m.eval_documents} documents of {described} into "
        f"{args.out}: {m.train_tokens} training tokens in {len(m.chunks)} chunks, "
        f"{m.eval_tokens} eval tokens ({m.dtype}, tokenizer {m.tokenizer}); "
        f"{took:.1f} s, {size / took / 1e6:.1f} MB/s\n"
    )
    return 0
