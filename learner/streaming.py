"""The learner's network side: heartbeats, fragment downloads and uploads, in threads.

    streamer = Streamer(cfg, layout, initial_params)
    streamer.start()                   # joins (and initializes the job) with backoff
    streamer.report(snapshot)          # never blocks
    streamer.send(meta, delta)         # into the outbox, uploaded in the background
    for p, version, tensors in streamer.arrivals(): ...
    streamer.ledger()                  # per fragment: tokens put, accepted, refused, queued

The training loop never waits on the network (the method's whole point): everything here runs in
two daemon threads with their own HTTP/2 connections. When the synchronizer is away they
retry with capped exponential backoff; when it comes back (or forgets this learner) they
re-join. Every update carries work no other update carries (deltas are incremental), so
none is dropped: the `Outbox` keeps them in order, sums updates of a fragment that wait
behind an outage into one, and re-sends one whose answer was lost (timeout, reset, 5xx)
as is, same metadata and same bytes, until the synchronizer says accepted or duplicate.
A refused update (4xx: stale base, bad payload) is not retried; its work is lost, and
counted as refused in the ledger.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from ddiloco.learner.config import LearnerConfig
from ddiloco.synchronizer import codec
from ddiloco.synchronizer.client import SyncClient, SyncRefused, SyncUnavailable
from ddiloco.synchronizer.protocol import (
    API_PREFIX,
    CONTENT_TYPE,
    LAYOUT_KEY,
    Heartbeat,
    JoinRequest,
    Layout,
    UpdateMeta,
    UpdateResponse,
)

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]


@dataclass
class Backoff:
    base: float = 0.05
    cap: float = 2.0
    current: float = 0.0

    def fail(self) -> float:
        self.current = min(self.cap, max(self.base, self.current * 2))
        return self.current

    def ok(self) -> None:
        self.current = 0.0


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
    payload: bytes | None = field(default=None, repr=False)

    def encoded(self) -> bytes:
        if self.payload is None:
            self.payload = codec.encode(self.delta, metadata=self.meta.to_metadata())
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

    def put(self, meta: UpdateMeta, delta: Tensors) -> bool:
        """Queue an update; True if it was summed into a queued one of its fragment."""
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
            self.entries.append(Entry(meta, dict(delta)))
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

    def take(self, timeout: float | None = None) -> Entry | None:
        """The oldest entry, now attempted (never summed into again); None if none came."""
        with self.cond:
            if not self.cond.wait_for(lambda: bool(self.entries), timeout):
                return None
            head = self.entries[0]
            head.attempts += 1
            self._count(head.meta.fragment)["attempts"] += 1
            return head

    def settle(self, entry: Entry, outcome: Outcome) -> None:
        """The synchronizer answered `entry` definitively: remove it and count the outcome."""
        if outcome not in OUTCOMES:
            raise ValueError(f"not a definitive outcome: {outcome!r}")
        with self.cond:
            if not self.entries or self.entries[0] is not entry:
                raise ValueError("only the entry taken last (the head) can be settled")
            self.entries.popleft()
            c = self._count(entry.meta.fragment)
            c[f"{outcome}_uploads"] += 1
            c[f"{outcome}_steps"] += entry.meta.steps
            c[f"{outcome}_tokens"] += entry.meta.tokens
            self.cond.notify_all()

    def queued(self) -> list[UpdateMeta]:
        """Metadata of the entries waiting (the head first, possibly in flight)."""
        with self.cond:
            return [e.meta for e in self.entries]

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


class Streamer:
    """Owns the learner's connections. State: latest heartbeat snapshot, known global
    versions, fragments being fetched, the outbox of uploads, arrived fragments, byte
    counts, and what was left unsent at close (`left`)."""

    def __init__(self, cfg: LearnerConfig, layout: Layout, initial: Callable[[], Tensors]) -> None:
        self.cfg = cfg
        self.layout = layout
        self.initial = initial
        self.stop_event = threading.Event()
        self.snapshot: Heartbeat | None = None
        self.requested: set[int] = set()
        self.versions: list[int] = [0] * len(layout.fragments)
        self.outbox = Outbox(len(layout.fragments))
        self.left: dict[int, dict[str, int]] = {}
        self.arrived: queue.Queue[tuple[int, int, Tensors]] = queue.Queue()
        self.upload_results: queue.Queue[tuple[int, int, str]] = queue.Queue()
        self.lock = threading.Lock()
        self.bytes_up = 0
        self.bytes_down = 0
        self.incarnation = 0
        self.threads: list[threading.Thread] = []

    def _client(self) -> SyncClient:
        return SyncClient(self.cfg.sync_url, self.cfg.token)

    # ---- startup -----------------------------------------------------------------
    def join(self, client: SyncClient) -> list[int]:
        """Join the job, initializing it with our parameters if nobody has; returns versions."""
        req = JoinRequest(
            learner_id=self.cfg.learner_id,
            layout_digest=self.layout.digest(),
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        resp = client.join(req)
        self.incarnation = resp.incarnation
        if not resp.initialized:
            payload = codec.encode(self.initial(), {LAYOUT_KEY: self.layout.model_dump_json()})
            init = client.init(payload)
            log.info(
                "Initialized the global model (created=%s digest=%s)",
                init.created,
                init.layout_digest,
            )
            return init.versions
        return resp.versions

    def fetch_all(self) -> list[tuple[int, int, Tensors]]:
        """Block until the synchronizer answers; return every global fragment. Startup only."""
        client, backoff = self._client(), Backoff(cap=1.0)
        while not self.stop_event.is_set():
            try:
                self.join(client)
                out = []
                for spec in self.layout.fragments:
                    version, tensors = client.fragment(spec.index)
                    out.append((spec.index, version, tensors))
                self.versions = [v for _, v, _ in out]
                self._count(client)
                return out
            except SyncUnavailable as e:
                wait = backoff.fail()
                log.info("Synchronizer not reachable yet (%s); retrying in %.2fs", e, wait)
                self.stop_event.wait(wait)
        raise RuntimeError("stopped before the synchronizer answered")

    def start(self) -> None:
        for target in (self._control_loop, self._upload_loop):
            t = threading.Thread(target=target, name=f"ddiloco-{target.__name__}", daemon=True)
            t.start()
            self.threads.append(t)

    def close(self, drain_s: float = 2.0) -> dict[int, dict[str, int]]:
        """Let queued uploads go out for up to `drain_s`, then stop the threads. Returns (and
        keeps in `left`) what had no definitive answer by then, per fragment: uploads,
        steps and tokens; that work never reached the synchronizer, as far as we know."""
        if self.threads:
            self.outbox.wait_empty(drain_s)
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=2.0)
        self.left = {
            p: {k: row[f"queued_{k}"] for k in ("uploads", "steps", "tokens")}
            for p, row in self.outbox.ledger().items()
            if row["queued_uploads"]
        }
        if self.left:
            log.warning(
                "Closing with uploads unanswered (their work is undelivered): %s", self.left
            )
        return self.left

    # ---- loop side API (never blocks) --------------------------------------------
    def report(self, hb: Heartbeat) -> None:
        self.snapshot = hb

    def send(self, meta: UpdateMeta, delta: Tensors) -> None:
        self.outbox.put(meta, delta)

    def ledger(self) -> dict[int, dict[str, int]]:
        """The outbox's counters per fragment (see `Outbox`)."""
        return self.outbox.ledger()

    def arrivals(self) -> list[tuple[int, int, Tensors]]:
        out = []
        while True:
            try:
                out.append(self.arrived.get_nowait())
            except queue.Empty:
                return out

    def results(self) -> list[tuple[int, int, str]]:
        out = []
        while True:
            try:
                out.append(self.upload_results.get_nowait())
            except queue.Empty:
                return out

    def _count(self, client: SyncClient) -> None:
        with self.lock:
            self.bytes_up += client.bytes_up
            self.bytes_down += client.bytes_down
        client.bytes_up = client.bytes_down = 0

    # ---- threads -----------------------------------------------------------------
    def _control_loop(self) -> None:
        client, backoff = self._client(), Backoff()
        have = list(self.versions)
        while not self.stop_event.is_set():
            hb = self.snapshot
            try:
                if hb is not None:
                    hb = hb.model_copy(
                        update={
                            "known_versions": list(have),
                            "wait_s": self.cfg.poll_s,
                            "known_requested": sorted(self.requested),
                        }
                    )
                    resp = client.heartbeat(hb)
                    self.requested = set(resp.requested)
                    for p, v in enumerate(resp.versions):
                        if v > have[p]:
                            version, tensors = client.fragment(p)
                            have[p] = version
                            self.arrived.put((p, version, tensors))
                    self.versions = resp.versions
                self._count(client)
                backoff.ok()
                if hb is None:
                    self.stop_event.wait(0.05)
            except SyncRefused as e:
                if e.kind == "unknown_learner":
                    log.warning("Synchronizer does not know this learner; joining again")
                    self._rejoin(client, backoff)
                else:
                    log.warning("Heartbeat refused: %s", e)
                    self.stop_event.wait(backoff.fail())
            except SyncUnavailable as e:
                wait = backoff.fail()
                if wait >= backoff.cap:
                    log.warning(
                        "Synchronizer unreachable (%s); training on, retrying every %.1fs", e, wait
                    )
                self.stop_event.wait(wait)

    def _rejoin(self, client: SyncClient, backoff: Backoff) -> None:
        try:
            self.join(client)
        except (SyncRefused, SyncUnavailable) as e:
            log.warning("Re-join failed: %s", e)
            self.stop_event.wait(backoff.fail())

    def _upload_loop(self) -> None:
        client, backoff = (
            SyncClient(self.cfg.sync_url, self.cfg.token, http2=self.cfg.upload_http2),
            Backoff(),
        )
        while not self.stop_event.is_set():
            entry = self.outbox.take(timeout=0.1)
            if entry is None:
                continue
            meta = entry.meta
            try:
                resp = self._upload(client, entry)
            except SyncRefused as e:
                log.warning("Update %s refused, its work is lost: %s", meta.update_id(), e)
                self.outbox.settle(entry, "refused")
                self.upload_results.put((meta.fragment, meta.base_version, e.kind))
                backoff.ok()
            except (SyncUnavailable, ValueError) as e:  # ValueError: a 2xx we could not read
                # the outcome is unknown: the same update goes again (a duplicate is harmless)
                wait = backoff.fail()
                if entry.attempts == 1 or entry.attempts % 20 == 0:
                    log.warning("Update %s unanswered (%s); re-sending", meta.update_id(), e)
                self.stop_event.wait(wait)
            else:
                self.outbox.settle(entry, resp.status)
                self.upload_results.put((meta.fragment, meta.base_version, resp.status))
                backoff.ok()
            self._count(client)

    @staticmethod
    def _upload(client: SyncClient, entry: Entry) -> UpdateResponse:
        """POST the entry's payload, encoded once, so a re-send carries the same bytes."""
        path = f"{API_PREFIX}/fragments/{entry.meta.fragment}/updates"
        _, _, body = client.request("POST", path, entry.encoded(), CONTENT_TYPE)
        return UpdateResponse.model_validate_json(body)
