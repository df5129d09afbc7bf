"""Documents of a corpus: which files, in what order, and the text of each document.

    files = data_files("data/")                     # sorted; JSONL/Parquet, else text files
    for text in iter_documents(files, field="text"): ...
    is_documents("x.jsonl", byte_level=True)        # True: read here, not as a token array

A directory holding ``.jsonl``/``.json``/``.ndjson`` (optionally ``.gz``/``.zst``/``.bz2``/
``.xz``) or ``.parquet`` files is read as those files (others in it are ignored); any other
directory or file is text, one document per file (hidden files skipped, paths sorted). JSON
lines and Parquet rows are documents whose text is the ``field`` column. Everything is read
with the ``datasets`` library in streaming mode (``load_dataset("json" | "parquet" | "text",
data_files=..., streaming=True)``), from local files only. corpus.py tokenizes them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from ddiloco.learner.data import stdlib_files

JSON_SUFFIXES: Final = (".jsonl", ".json", ".ndjson")
COMPRESSED: Final = ("", ".gz", ".zst", ".bz2", ".xz")
PARQUET_SUFFIXES: Final = (".parquet",)


def suffix_kind(path: Path) -> str:
    name = path.name.lower()
    if any(name.endswith(s + c) for s in JSON_SUFFIXES for c in COMPRESSED):
        return "json"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def data_files(data: str | os.PathLike[str]) -> list[Path]:
    """The files of ``data`` in reading order (see the module docstring). Raises
    FileNotFoundError when it does not exist, ValueError when a directory holds no file."""
    path = Path(data).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"data path {str(path)!r} does not exist; give text, JSONL or Parquet files "
            "(a file or a directory), or a .bin of uint16 tokens"
        )
    if path.is_file():
        return [path.resolve()]
    files = sorted(
        p.resolve()
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    structured = [f for f in files if suffix_kind(f) != "text"]
    if structured:
        return structured
    if not files:
        raise ValueError(f"data directory {str(path)!r} holds no files")
    return files


def is_documents(data: str | os.PathLike[str] | None, byte_level: bool) -> bool:
    """Whether ``data`` is read as documents here (else as a token array by ``data.py``):
    JSONL and Parquet always; text (and the default stdlib corpus) unless byte-level, whose
    text is its raw bytes, as it always was; a ``.bin`` never."""
    if data is None:
        return not byte_level
    path = Path(data).expanduser()
    if path.is_file() and path.suffix == ".bin":
        return False
    if not path.exists():
        return not byte_level  # either reader names the missing path
    return not byte_level or any(suffix_kind(f) != "text" for f in data_files(path))


def _datasets() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _rows_text(rows: Iterable[dict[str, Any]], field: str, where: str) -> Iterator[str]:
    for n, row in enumerate(rows):
        if field not in row:
            raise ValueError(
                f"{where}: row {n} has no field {field!r} (it has {sorted(row)[:10]}); "
                "name the text column with --data-field"
            )
        text = row[field]
        if text is None:
            continue
        if not isinstance(text, str):
            raise ValueError(f"{where}: row {n} field {field!r} is {type(text).__name__}, not text")
        yield text


def iter_documents(files: Sequence[Path], field: str = "text") -> Iterator[str]:
    """Every document of ``files`` in order (empty ones included)."""
    ds = _datasets()
    i = 0
    while i < len(files):
        kind = suffix_kind(files[i])
        if kind == "text":  # consecutive text files: one streaming dataset, a row per file
            j = i
            while j < len(files) and suffix_kind(files[j]) == "text":
                j += 1
            rows = ds.load_dataset(
                "text",
                data_files=[str(f) for f in files[i:j]],
                split="train",
                streaming=True,
                sample_by="document",
                encoding_errors="replace",
            )
            yield from _rows_text(rows, "text", f"text files {files[i]}...")
            i = j
            continue
        path = files[i]
        if kind == "parquet":
            import pyarrow.parquet as pq

            names = pq.read_schema(path).names
            if field not in names:
                raise ValueError(
                    f"{path}: no column {field!r} (it has {names[:10]}); name the text column "
                    "with --data-field"
                )
            rows = ds.load_dataset(
                "parquet", data_files=[str(path)], split="train", streaming=True, columns=[field]
            )
        else:
            rows = ds.load_dataset("json", data_files=[str(path)], split="train", streaming=True)
        yield from _rows_text(rows, field, str(path))
        i += 1


def stdlib_documents(max_bytes: int | None) -> Iterator[str]:
    """The standard library's ``.py`` files as documents, whole, up to ``max_bytes``."""
    total = 0
    for path in stdlib_files():
        raw = path.read_bytes()
        if max_bytes is not None and total + len(raw) > max_bytes:
            return
        total += len(raw)
        yield raw.decode("utf-8", errors="replace")
