"""Training data for the learners: byte-level token arrays, shards, batches and the eval loss.

Tokens are bytes (values 0..255) held in a ``uint16`` numpy array, so pre-tokenized ``.bin``
files with a larger vocabulary use the same type. By default the corpus is the Python standard
library's own ``.py`` sources, which every machine has and nothing needs downloading:

    tokens = load_tokens(None)                     # or a .bin file, a text file, a directory
    train, held_out = split_eval(tokens)           # the tail is the eval split, same everywhere
    mine = shard(train, index=2, count=4)          # contiguous shard of learner 2 of 4
    x, y = next(BatchIterator(mine, batch_size=8, block_size=64, seed=2))
    loss = eval_loss(model, held_out, batch_size=8, block_size=64)

Every function is deterministic given its arguments, so learners agree on the eval split and on
their disjoint shards without talking to each other. Caveat: the default corpus is whatever
standard library this interpreter has; learners of one job must run the same Python build (one
container image does that).
"""

from __future__ import annotations

import logging
import os
import sysconfig
from pathlib import Path
from typing import Final

import numpy as np
import torch
from torch import nn

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES: Final = 8 * 1024 * 1024
"""Cap on the default (stdlib) corpus: 8 MiB loads in well under a second and is plenty."""

_SKIP_DIRS: Final = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files in sorted order, without tests and installed
    packages (the order is part of the corpus, so it must not depend on the filesystem)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        files.extend(Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return files


def _read_files(files: list[Path], max_bytes: int | None) -> np.ndarray:
    chunks: list[bytes] = []
    total = 0
    for path in files:
        chunk = path.read_bytes()
        if max_bytes is not None and total + len(chunk) > max_bytes:
            chunks.append(chunk[: max_bytes - total])
            break
        chunks.append(chunk)
        total += len(chunk)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.uint16)


def load_tokens(
    data: str | os.PathLike[str] | None,
    *,
    vocab_size: int = 256,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
) -> np.ndarray:
    """The token array (``uint16``) for ``data``.

    - ``None``: the standard library's ``.py`` sources as bytes, capped at ``max_bytes``;
    - a ``.bin`` file: pre-tokenized little-endian uint16 tokens, memory-mapped, not read;
    - another file, or a directory (all its non-hidden files, recursively, sorted by path):
      the raw bytes, one token per byte, uncapped.

    Raises FileNotFoundError when the path does not exist, ValueError when it holds no tokens,
    a ``.bin`` has an odd size, or a token is outside ``[0, vocab_size)``.
    """
    if data is None:
        tokens = _read_files(stdlib_files(), max_bytes)
        source = f"standard library at {sysconfig.get_paths()['stdlib']}"
    else:
        path = Path(data)
        source = str(path)
        if not path.exists():
            raise FileNotFoundError(
                f"data path {source!r} does not exist; give a .bin file of uint16 tokens, "
                "a text file, a directory of text files, or nothing for the stdlib corpus"
            )
        if path.is_dir():
            files = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            tokens = _read_files(files, None)
        elif path.suffix == ".bin":
            size = path.stat().st_size
            if size % 2:
                raise ValueError(
                    f"{source}: a .bin file holds uint16 tokens, but has odd size {size}"
                )
            tokens = np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, np.uint16)
        else:
            tokens = _read_files([path], None)
    if len(tokens) == 0:
        raise ValueError(f"no tokens in {source}")
    top = int(tokens.max())
    if top >= vocab_size:
        raise ValueError(
            f"{source}: token id {top} does not fit the model's vocab_size {vocab_size}; "
            "byte-level presets take ids 0..255 (use --model-entry for another vocabulary)"
        )
    logger.info("loaded %d tokens from %s", len(tokens), source)
    return tokens


def split_eval(tokens: np.ndarray, eval_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """``(train, eval)``: the last ``eval_fraction`` of the tokens is held out (views, no copy)."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
    cut = len(tokens) - max(1, int(len(tokens) * eval_fraction))
    if cut < 1:
        raise ValueError(f"{len(tokens)} tokens are too few to hold out an eval split")
    return tokens[:cut], tokens[cut:]


def shard(tokens: np.ndarray, index: int, count: int) -> np.ndarray:
    """Shard ``index`` of ``count``: contiguous, disjoint, together covering ``tokens``."""
    if count < 1:
        raise ValueError(f"shard count must be >= 1, got {count}")
    if not 0 <= index < count:
        raise ValueError(f"shard index must be in [0, {count}), got {index}")
    n = len(tokens)
    return tokens[n * index // count : n * (index + 1) // count]


def _windows(tokens: np.ndarray, starts: np.ndarray, block_size: int) -> np.ndarray:
    # One fancy-indexing gather of [len(starts), block_size + 1] tokens: inputs and targets.
    return tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int64)


def _to_device(batch: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(batch)
    # Pinned host memory lets the copy to the GPU overlap with compute.
    t = t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _check_length(tokens: np.ndarray, block_size: int, what: str) -> None:
    if len(tokens) < block_size + 1:
        raise ValueError(
            f"{what} holds {len(tokens)} tokens, fewer than block_size + 1 = {block_size + 1}"
        )


class BatchIterator:
    """Endless random training batches ``(x, y)``, both ``LongTensor[batch_size, block_size]``
    with ``y`` shifted one token ahead of ``x``.

    Window starts are drawn uniformly from a numpy Generator seeded with ``seed``, so the same
    seed gives the same sequence of batches. State: that generator (``batches_drawn`` counts).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        block_size: int,
        seed: int,
        device: str | torch.device = "cpu",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        _check_length(tokens, block_size, "the training shard")
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.device = torch.device(device)
        self.rng = np.random.default_rng(seed)
        self.batches_drawn = 0

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.block_size

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)
        self.batches_drawn += 1
        return _to_device(_windows(self.tokens, starts, self.block_size), self.device)


@torch.no_grad()
def eval_loss(
    model: nn.Module,
    tokens: np.ndarray,
    batch_size: int,
    block_size: int,
    batches: int = 8,
    device: str | torch.device = "cpu",
) -> float:
    """Mean loss of ``model`` (``model(x, y) -> (logits, loss)``) on ``batches`` batches of
    fixed, evenly spaced windows of ``tokens``: the same windows on every call and learner.

    The model runs in eval mode (no dropout) and is put back in its previous mode afterwards.
    """
    _check_length(tokens, block_size, "the eval split")
    n = batches * batch_size
    starts = np.linspace(0, len(tokens) - block_size - 1, n).round().astype(np.int64)
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for i in range(batches):
            x, y = _to_device(
                _windows(tokens, starts[i * batch_size : (i + 1) * batch_size], block_size),
                torch.device(device),
            )
            _, loss = model(x, y)
            total += float(loss)
    finally:
        model.train(was_training)
    return total / batches
