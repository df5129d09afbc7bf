"""Training data for the learners: token arrays, shards, the batch stream and the eval loss.

Tokens are held in an unsigned numpy array: bytes (values 0..255) for the byte-level presets,
``uint16`` for pre-tokenized ``.bin`` files; corpora tokenized with a model's tokenizer
(JSONL, Parquet, text documents) come from ``corpus.py``, which uses the same stream. By
default the corpus is the Python standard library's own ``.py`` sources, which every machine
has and nothing needs downloading:

    tokens = load_tokens(None)                     # or a .bin file, a text file, a directory
    train, held_out = split_eval(tokens)           # the tail is the eval split, same everywhere
    mine = shard(train, index=2, count=4)          # contiguous shard of learner 2 of 4
    batches = BatchIterator(mine, batch_size=8, block_size=64, seed=(0, 2))
    x, y = next(batches)                           # batches.position == 8 windows consumed
    batches.seek(800)                              # a replacement resumes the slot's stream
    loss = eval_loss(model, held_out, batch_size=8, block_size=64)

Every function is deterministic given its arguments, so learners agree on the eval split and on
their disjoint shards without talking to each other, and a slot's stream of windows is the
same sequence in every process that plays the slot (the data contract: corpus.py). Caveat:
the default corpus is whatever standard library this interpreter has; learners of one job
must run the same Python build (one container image does that).
"""

from __future__ import annotations

import logging
import math
import os
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Protocol

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


class TokenSource(Protocol):
    """A token array read lazily (learner/prepared.py: chunks memory-mapped or fetched by
    byte ranges): its length, and a batch of windows gathered at once."""

    def __len__(self) -> int: ...

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``[len(starts), length]`` int64 tokens: window ``i`` from ``starts[i]``."""
        ...


Tokens = np.ndarray | TokenSource
"""What the batch iterator and eval read: an ndarray (a memmap too) or a ``TokenSource``."""


def _windows(tokens: Tokens, starts: np.ndarray, block_size: int) -> np.ndarray:
    if not isinstance(tokens, np.ndarray):
        return tokens.windows(starts, block_size + 1)
    # One fancy-indexing gather of [len(starts), block_size + 1] tokens: inputs and targets.
    return tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int64)


def _to_device(batch: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(batch)
    # Pinned host memory lets the copy to the GPU overlap with compute.
    t = t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _check_length(tokens: Tokens, block_size: int, what: str) -> None:
    if len(tokens) < block_size + 1:
        raise ValueError(
            f"{what} holds {len(tokens)} tokens, fewer than block_size + 1 = {block_size + 1}"
        )


EAGER_WINDOWS: Final = 1 << 22
"""Up to this many windows per epoch, an epoch's order is a numpy permutation held in memory
(32 MiB at most); beyond, a ``FeistelOrder``, so a huge shard costs neither the memory nor
the seconds of a permutation before its first step."""


class FeistelOrder:
    """A pseudo-random bijection of ``[0, n)`` keyed by ``key``, computed per index (nothing
    held but the key): a 4-round Feistel network on the smallest even number of bits that
    covers ``n``, cycle-walked back into ``[0, n)`` (a value outside is permuted again until
    it falls inside, which keeps it a bijection; under 4 rounds on average).
    ``order[slots]`` gives the windows at those slots, like a permutation array."""

    ROUNDS: Final = 4

    def __init__(self, n: int, key: Sequence[int]) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.n = n
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        rng = np.random.default_rng([int(k) % (1 << 64) for k in key])
        self.keys = [np.uint64(k) for k in rng.integers(0, 1 << 63, self.ROUNDS)]

    def _round(self, r: np.ndarray, k: np.uint64) -> np.ndarray:
        x = (r ^ k) * np.uint64(0x9E3779B97F4A7C15)  # splitmix64's mixing, wrapping uint64
        x ^= x >> np.uint64(31)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
        return x & self.mask

    def _once(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ self._round(right, k)
        return (left << self.half) | right

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, slots: np.ndarray) -> np.ndarray:
        y = self._once(np.asarray(slots, dtype=np.uint64))
        out = y >= self.n
        while out.any():
            y[out] = self._once(y[out])
            out = y >= self.n
        return y.astype(np.int64)


RESERVE_SECONDS: Final = 10.0
"""How much training the reservation a learner reports covers ahead of what it consumed:
a new one is reported when less than half of it is left, so a heartbeat has at least half
this long to reach the synchronizer before a window outside its reservation is drawn."""
MIN_RESERVE_STEPS: Final = 8
"""The reservation covers at least this many group steps (the join reserves this many)."""


def join_reserve(batch_size: int, world: int = 1) -> int:
    """Windows a learner reserves at join (``JoinRequest.data_reserve``): ``MIN_RESERVE_STEPS``
    group steps of ``world`` ranks of ``batch_size``, drawn before its first heartbeat."""
    return MIN_RESERVE_STEPS * batch_size * world


class BatchIterator:
    """A slot's data stream, as the training batches ``(x, y)`` of one rank of its group:
    both ``LongTensor[batch_size, block_size]``, ``y`` one token ahead of ``x``.

    The stream is the shard's windows (``block_size + 1`` tokens at stride ``block_size``:
    neighbours share one token, every next-token pair is a target once per epoch), epoch
    ``e`` in the order of a permutation drawn from ``numpy.random.default_rng([*seed, e])``
    (beyond ``EAGER_WINDOWS`` windows: a ``FeistelOrder`` keyed by ``[*seed, e]``). Stream
    position ``p`` is window ``perm_e[p % n]`` of epoch ``e = p // n``. A group step takes
    positions ``[position, position + world * batch_size)``, rank ``r`` the ``r``-th
    ``batch_size`` of them, and every rank advances ``position`` by the whole step, so the
    position counts windows consumed by the slot whatever the group size. State: ``position``
    and the reservation (``reservation()``); ``seek(p)`` moves to position ``p``.
    ``last = (lo, hi)`` are the positions of the group step just drawn. With the logger at
    DEBUG each draw is logged (positions, rank, window indices) before it is trained.
    The shard is an ndarray (a memmap) or a lazy ``TokenSource``; only its length is read
    before the first draw.
    """

    def __init__(
        self,
        tokens: Tokens,
        batch_size: int,
        block_size: int,
        seed: int | Sequence[int],
        device: str | torch.device = "cpu",
        *,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world), got rank {rank} of world {world}")
        _check_length(tokens, block_size, "the training shard")
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.device = torch.device(device)
        self.rank, self.world = rank, world
        self.seed = tuple(
            int(s) % (1 << 64) for s in (seed if isinstance(seed, Sequence) else [seed])
        )
        self.windows = (len(tokens) - 1) // block_size
        """Windows per epoch (the shard's tokens minus one, over block_size)."""
        self.position = 0
        self.last = (0, 0)
        self._perms: dict[int, np.ndarray | FeistelOrder] = {}
        self._reserved = 0
        self._interval: float | None = None
        self._drawn_at: float | None = None

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.block_size

    @property
    def group_batch(self) -> int:
        """Windows one group step consumes: ``world * batch_size``."""
        return self.world * self.batch_size

    def permutation(self, epoch: int) -> np.ndarray | FeistelOrder:
        """The order of the windows in ``epoch`` (the same on every rank and replacement),
        indexable by slot: a numpy permutation up to ``EAGER_WINDOWS`` windows, beyond that a
        ``FeistelOrder`` computed per slot."""
        perm = self._perms.get(epoch)
        if perm is None:
            if self.windows <= EAGER_WINDOWS:
                perm = np.random.default_rng([*self.seed, epoch]).permutation(self.windows)
            else:
                perm = FeistelOrder(self.windows, [*self.seed, epoch])
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = perm
        return perm

    def window_indices(self, positions: np.ndarray) -> np.ndarray:
        """The windows (index ``i``: tokens ``[i*block_size, (i+1)*block_size]`` of the shard)
        at these stream positions."""
        epochs, slots = np.divmod(np.asarray(positions, dtype=np.int64), self.windows)
        out = np.empty_like(slots)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self.permutation(int(e))[slots[mask]]
        return out

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        lo = self.position + self.rank * self.batch_size
        windows = self.window_indices(np.arange(lo, lo + self.batch_size, dtype=np.int64))
        self.last = (self.position, self.position + self.group_batch)
        self.position += self.group_batch
        now = time.monotonic()
        if self._drawn_at is not None:
            dt = now - self._drawn_at
            self._interval = dt if self._interval is None else 0.8 * self._interval + 0.2 * dt
        self._drawn_at = now
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "data positions=%d:%d rank=%d windows=%s",
                lo,
                lo + self.batch_size,
                self.rank,
                ",".join(map(str, windows.tolist())),
            )
        return _to_device(
            _windows(self.tokens, windows * self.block_size, self.block_size), self.device
        )

    def seek(self, position: int) -> None:
        """Continue the stream at ``position`` (a replacement: where the synchronizer
        counted the slot); what lies between is skipped, never trained this epoch."""
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"data position must be an int >= 0, got {position!r}")
        self.position = position

    def reserve_windows(self) -> int:
        """Windows a reservation covers now: ``RESERVE_SECONDS`` of group steps at the
        measured pace, at least ``MIN_RESERVE_STEPS`` of them."""
        steps = MIN_RESERVE_STEPS
        if self._interval:
            steps = max(steps, math.ceil(RESERVE_SECONDS / self._interval))
        return steps * self.group_batch

    def reservation(self) -> int:
        """The data position to report (``Heartbeat.data_position``): the end of the slot's
        current reservation, renewed to ``position + reserve_windows()`` once less than half
        of it is left. Never below ``position``; never decreases."""
        ahead = self.reserve_windows()
        if self._reserved - self.position < ahead // 2:
            self._reserved = max(self._reserved, self.position + ahead)
        return self._reserved


def model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Loss of a model following ``GPT.forward``'s contract: ``model(x, y) -> (logits, loss)``."""
    _, loss = model(x, y)
    return loss


@torch.no_grad()
def eval_loss(
    model: nn.Module,
    tokens: Tokens,
    batch_size: int,
    block_size: int,
    batches: int = 8,
    device: str | torch.device = "cpu",
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = model_loss,
) -> float:
    """Mean ``loss_fn(model, x, y)`` (default: ``model(x, y) -> (logits, loss)``) on
    ``batches`` batches of fixed, evenly spaced windows of ``tokens``: the same windows on
    every call and learner.

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
            total += float(loss_fn(model, x, y))
    finally:
        model.train(was_training)
    return total / batches
