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
counted as refused in the ledger. A 401 is not the update's fault (a token being rotated:
the client re-reads its token file first), so that update is kept and re-sent like one
that met an outage.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddiloco.learner import hf
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.data import join_reserve
from ddiloco.learner.metrics import LearnerMetrics
from ddiloco.learner.outbox import Outbox
from ddiloco.synchronizer import codec
from ddiloco.synchronizer.client import SyncClient, SyncRefused, SyncUnavailable
from ddiloco.synchronizer.protocol import (
    LAYOUT_KEY,
    MODEL_KEY,
    Heartbeat,
    JoinRequest,
    Layout,
    UpdateMeta,
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


class Streamer:
    """Owns the learner's connections. State: latest heartbeat snapshot, known global
    versions, fragments being fetched, the outbox of uploads, arrived fragments, byte
    counts, and what was left unsent at close (`left`)."""

    def __init__(
        self,
        cfg: LearnerConfig,
        layout: Layout,
        initial: Callable[[], Tensors],
        metrics: LearnerMetrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics or LearnerMetrics(cfg.learner_id, enabled=False)
        self.layout = layout
        self.initial = initial
        self.stop_event = threading.Event()
        self.snapshot: Heartbeat | None = None
        self.requested: set[int] = set()
        self.versions: list[int] = [0] * len(layout.fragments)
        self.outbox = Outbox(len(layout.fragments))
        self.left: dict[int, dict[str, int]] = {}
        self.arrived: queue.Queue[tuple[int, int, Tensors]] = queue.Queue()
        self.arrival_steps: dict[tuple[int, int], int] = {}
        """(fragment, version) -> the learner's step last reported when it arrived (the
        adoption lag metric; the loop pops it)."""
        self.upload_results: queue.Queue[tuple[int, int, str]] = queue.Queue()
        self.lock = threading.Lock()
        self.bytes_up = 0
        self.bytes_down = 0
        self.incarnation = 0
        self.resume_position = 0
        """The synchronizer's data position for this learner id at the last join (windows of
        its slot's stream counted so far; 0 from a synchronizer that keeps none)."""
        self.threads: list[threading.Thread] = []
        # one token source for both threads: a rotated token file is re-read once for both
        self.tokens = cfg.token_source()
        self.tls = cfg.client_tls()

    def _client(self, http2: bool = True) -> SyncClient:
        return SyncClient(self.cfg.sync_url, self.tokens, http2=http2, tls=self.tls)

    # ---- startup -----------------------------------------------------------------
    def join(self, client: SyncClient) -> list[int]:
        """Join the job, initializing it with our parameters if nobody has; returns versions."""
        req = JoinRequest(
            learner_id=self.cfg.learner_id,
            layout_digest=self.layout.digest(),
            host=socket.gethostname(),
            pid=os.getpid(),
            # the draws before our first heartbeat lands (learner/corpus.py, the data contract)
            data_reserve=join_reserve(
                self.cfg.batch_size,
                int(os.environ.get("WORLD_SIZE") or getattr(self.cfg, "nproc_per_node", 1)),
            ),
        )
        resp = client.join(req)
        self.incarnation = resp.incarnation
        self.resume_position = int(getattr(resp, "data_position", 0) or 0)
        if not resp.initialized:
            meta = {LAYOUT_KEY: self.layout.model_dump_json()}
            try:  # what the job trains, for `ddiloco export` (learner/hf.py model_spec)
                meta[MODEL_KEY] = hf.spec_metadata(
                    self.cfg.model, self.cfg.model_entry, getattr(self.cfg, "tokenizer", None)
                )
            except (OSError, ValueError) as e:
                log.warning("Initializing without a model spec (an export will lack it): %s", e)
            payload = codec.encode(self.initial(), meta)
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
                            latest = self.snapshot
                            self.arrival_steps[(p, version)] = latest.step if latest else 0
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
        client, backoff = self._client(http2=self.cfg.upload_http2), Backoff()
        while not self.stop_event.is_set():
            entry = self.outbox.take(timeout=0.1)
            if entry is None:
                continue
            meta = entry.meta
            try:
                # encoded once: a re-send carries the same bytes
                resp = client.post_update(meta.fragment, entry.encoded())
            except SyncRefused as e:
                if e.status == 401:
                    # not the update's fault: a token being rotated (the client already
                    # re-read the file). Keep the update and send it again, like an outage.
                    wait = backoff.fail()
                    if entry.attempts == 1 or entry.attempts % 20 == 0:
                        log.warning("Update %s unauthorized; re-sending: %s", meta.update_id(), e)
                    self.metrics.upload("error")
                    self.stop_event.wait(wait)
                    self._count(client)
                    continue
                log.warning("Update %s refused, its work is lost: %s", meta.update_id(), e)
                self.metrics.upload("refused")
                self.outbox.settle(entry, "refused")
                self.upload_results.put((meta.fragment, meta.base_version, e.kind))
                backoff.ok()
            except (SyncUnavailable, ValueError) as e:  # ValueError: a 2xx we could not read
                # the outcome is unknown: the same update goes again (a duplicate is harmless)
                wait = backoff.fail()
                if entry.attempts == 1 or entry.attempts % 20 == 0:
                    log.warning("Update %s unanswered (%s); re-sending", meta.update_id(), e)
                self.metrics.upload("error")
                self.stop_event.wait(wait)
            else:
                self.metrics.upload(resp.status)
                self.outbox.settle(entry, resp.status)
                self.upload_results.put((meta.fragment, meta.base_version, resp.status))
                backoff.ok()
            self._count(client)
