"""The learner's outbox: every hand-over, kept in order until the synchronizer answers it.

    outbox = Outbox(num_fragments)
    outbox.put(meta, delta)          # the training loop: never blocks
    entry = outbox.take(timeout)     # the upload thread: the head, now attempted
    entry = outbox.take(timeout, fragments={0, 3})  # a shard's thread: the oldest of its own
    outbox.settle(entry, "accepted") # once the answer is definitive (else take it again)

Deltas are incremental, so every update carries work no other carries and none may be
dropped. Updates of a fragment that queue up behind an outage are summed into one (in
float32, so no rounding is lost); one that was attempted is frozen and re-sent byte for
byte, so the synchronizer's (incarnation, learner_step) high-water mark recognises it.
A quantized update (int8 / int4, wire/encodings.py) comes encoded (`put(..., payload=)`):
the learner's error feedback is built on exactly those bytes, so it is never summed; the
learner defers a fragment's quantized hand-over while one of its updates is `waiting` (queued,
never attempted), so behind an outage the work stays in its parameters and the outbox holds
at most two of a fragment's updates (learner/diloco.py).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import torch

from ddiloco.learner.sync_client import Body
from ddiloco.wire import codec
from ddiloco.wire.protocol import UpdateMeta

Tensors = dict[str, torch.Tensor]

Outcome = Literal["accepted", "duplicate", "refused"]
OUTCOMES: tuple[Outcome, ...] = ("accepted", "duplicate", "refused")


@dataclass
class Entry:
    """One upload: a hand-over, or several of one fragment summed while none was attempted.
    Once attempted it is frozen: its payload is encoded once and re-sent byte for byte."""

    meta: UpdateMeta
    delta: Tensors
    handovers: int = 1
    attempts: int = 0
    payload: Body | None = field(default=None, repr=False)

    def encoded(self) -> Body:
        """The body to post, made on the first call: the safetensors header and each
        tensor's own bytes (`codec.pieces`), posted in order without a joined copy (a 32 MB
        join cost the sender 0.97 CPU s per GB against 0.30 for parts, and held a second
        copy of the update in memory while it waited). Safe because the outbox owns its
        tensors: a hand-over's delta is a fresh tensor (learner/diloco.py) and a summed one
        is made by `put`; after this nothing writes them, and `delta` is dropped."""
        if self.payload is None:
            meta = self.meta.to_metadata()
            parts = codec.pieces(self.delta, metadata=meta)
            self.payload = parts if parts is not None else codec.encode(self.delta, meta)
            self.delta = {}  # frozen from here on: the bytes are all a re-send needs
        return self.payload


_KINDS = [f"{k}_{n}" for k in (*OUTCOMES, "queued") for n in ("uploads", "steps", "tokens")]
LEDGER_KEYS = ("put_handovers", "put_steps", "put_tokens", "summed", "attempts", *_KINDS)


class Outbox:
    """The uploads not yet answered, oldest first, and a ledger of what went through.

    `put` sums an update into the queued entry of its fragment if that one was never
    attempted (float32 sum; steps and tokens add; the older base_version and the newer
    learner_step and incarnation), else appends it. The upload thread `take`s the head,
    which marks it attempted, and `settle`s it once the synchronizer answers definitively;
    until then it stays the head and is taken again, as is. Strict FIFO keeps each
    fragment's updates in increasing (incarnation, learner_step) order. Thread-safe.

    Ledger, per fragment: put_* (handed over) = accepted_* + duplicate_* + refused_* +
    queued_* for steps and tokens, and put_handovers = summed + the *_uploads."""

    def __init__(self, num_fragments: int = 0) -> None:
        self.cond = threading.Condition()
        self.entries: deque[Entry] = deque()
        self.counts: dict[int, dict[str, int]] = {
            p: dict.fromkeys(LEDGER_KEYS, 0) for p in range(num_fragments)
        }
        self.last_order: dict[int, tuple[int, int]] = {}

    def _count(self, p: int) -> dict[str, int]:
        return self.counts.setdefault(p, dict.fromkeys(LEDGER_KEYS, 0))

    def put(self, meta: UpdateMeta, delta: Tensors, payload: bytes | None = None) -> bool:
        """Queue an update; True if it was summed into a queued one of its fragment. One
        given as its `payload` (encoded already) is frozen: never summed, sent as is."""
        p = meta.fragment
        with self.cond:
            last = self.last_order.get(p)
            if last is not None and meta.order() <= last:
                raise ValueError(
                    f"update of fragment {p} at {meta.order()} does not follow {last}: one "
                    "learner's updates of a fragment must go out in increasing order"
                )
            same = [e for e in self.entries if e.meta.fragment == p]
            into = same[-1] if same and same[-1].attempts == 0 and not same[-1].payload else None
            if payload is not None:
                into = None
            if into is not None and set(delta) != set(into.delta):
                raise ValueError(f"update of fragment {p} has other tensors than the queued one")
            self.last_order[p] = meta.order()
            c = self._count(p)
            c["put_handovers"] += 1
            c["put_steps"] += meta.steps
            c["put_tokens"] += meta.tokens
            if into is not None:
                self._sum_into(into, meta, delta)
                c["summed"] += 1
                return True
            self.entries.append(Entry(meta, dict(delta), payload=payload))
            self.cond.notify_all()
            return False

    @staticmethod
    def _sum_into(e: Entry, meta: UpdateMeta, delta: Tensors) -> None:
        e.delta = {k: e.delta[k].to(torch.float32) + delta[k].to(torch.float32) for k in delta}
        e.meta = e.meta.model_copy(
            update={
                "steps": e.meta.steps + meta.steps,
                "tokens": e.meta.tokens + meta.tokens,
                "base_version": min(e.meta.base_version, meta.base_version),
                "learner_step": meta.learner_step,
                "incarnation": meta.incarnation,
            }
        )
        e.handovers += 1

    def _head(self, fragments: frozenset[int] | set[int] | None) -> Entry | None:
        if fragments is None:
            return self.entries[0] if self.entries else None
        return next((e for e in self.entries if e.meta.fragment in fragments), None)

    def take(
        self, timeout: float | None = None, fragments: frozenset[int] | set[int] | None = None
    ) -> Entry | None:
        """The oldest entry (of `fragments`, if given: one synchronizer shard's upload thread
        takes its own), now attempted (never summed into again); None if none came. Each
        fragment's updates still go out in order: one thread takes all of a fragment's."""
        with self.cond:
            if not self.cond.wait_for(lambda: self._head(fragments) is not None, timeout):
                return None
            head = self._head(fragments)
            assert head is not None
            head.attempts += 1
            self._count(head.meta.fragment)["attempts"] += 1
            return head

    def settle(self, entry: Entry, outcome: Outcome) -> None:
        """The synchronizer answered `entry` definitively: remove it and count the outcome."""
        if outcome not in OUTCOMES:
            raise ValueError(f"not a definitive outcome: {outcome!r}")
        with self.cond:
            first = self._head({entry.meta.fragment})
            if first is not entry or not entry.attempts:
                raise ValueError("only the entry taken last (the head) can be settled")
            del self.entries[next(i for i, e in enumerate(self.entries) if e is entry)]
            c = self._count(entry.meta.fragment)
            c[f"{outcome}_uploads"] += 1
            c[f"{outcome}_steps"] += entry.meta.steps
            c[f"{outcome}_tokens"] += entry.meta.tokens
            self.cond.notify_all()

    def waiting(self, p: int) -> bool:
        """Whether an update of fragment p is queued and was never attempted."""
        with self.cond:
            return any(e.meta.fragment == p and e.attempts == 0 for e in self.entries)

    def queued(self) -> list[UpdateMeta]:
        """Metadata of the entries waiting (the head first, possibly in flight)."""
        with self.cond:
            return [e.meta for e in self.entries]

    def depth(self) -> int:
        """Entries waiting (the head included, possibly in flight): the metrics' queue depth."""
        with self.cond:
            return len(self.entries)

    def wait_empty(self, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: not self.entries, timeout)

    def ledger(self) -> dict[int, dict[str, int]]:
        """Per fragment: the counters above, queued_* being what waits now (in flight too)."""
        with self.cond:
            out = {p: dict(c) for p, c in sorted(self.counts.items())}
            for e in self.entries:
                row = out[e.meta.fragment]
                row["queued_uploads"] += 1
                row["queued_steps"] += e.meta.steps
                row["queued_tokens"] += e.meta.tokens
            return out
