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

A sharded synchronizer (`DDILOCO_SYNC_URL` = its S shard URLs in shard order, synchronizer/
shards.py): the learner joins every shard and initializes each (each keeps its fragments),
sends each fragment's updates and fetches to its owner (`protocol.shard_map`), and runs a
control thread and an upload thread per shard, so a shard that is away holds back only its
own fragments (its updates wait in the outbox, re-sent as for one synchronizer) and every
shard hears every learner's heartbeats. The data position resumes at the highest any shard
answers: each holds a position this slot reached or reserved (durably, before answering),
so the highest is one no window below was ever handed out past, while a shard that was away
may only lag. The incarnation is the highest any shard answered, and never goes down.

Fragments come from the shard's upload port (the upload port, synchronizer/upload_port.py) when it named
one, each body read into a buffer of its own that the adopted tensors view (upload_sender.py), by the
uploads' rules (learner/uploads.py): while the port is unreachable, from the main URL; a fetch
the port turns away (503, a reset) or fails otherwise goes to the main URL at once. With a delta
broadcast encoding (wire/broadcast.py) each fetch names the copy held of the fragment
(`held`: its last download, or at join our own initial values by their content) and gets the
quantized delta from it, or nothing when it is current, or the whole fragment.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddiloco.cli.errors import UsageError
from ddiloco.learner import hf
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.data import join_reserve
from ddiloco.learner.metrics import LearnerMetrics
from ddiloco.learner.outbox import Entry, Outbox
from ddiloco.learner.sync_client import SyncClient, SyncRefused, SyncUnavailable
from ddiloco.learner.uploads import UPLOAD_FALLBACK_S, upload_overrides, with_port
from ddiloco.wire import broadcast, codec
from ddiloco.wire.broadcast import Held
from ddiloco.wire.protocol import (
    DEFAULT_BROADCAST_ENCODING,
    LAYOUT_KEY,
    MODEL_KEY,
    Heartbeat,
    JoinRequest,
    JoinResponse,
    Layout,
    UpdateMeta,
    UpdateResponse,
    shard_map,
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
        tokens_per_step: int = 0,
    ) -> None:
        self.cfg = cfg
        self.tokens_per_step = tokens_per_step
        """The tokens one inner step trains on (the whole group's), declared at join: the
        synchronizer refuses updates claiming more per step. 0: none declared."""
        self.metrics = metrics or LearnerMetrics(cfg.learner_id, enabled=False)
        self.layout = layout
        self.initial = initial
        self.stop_event = threading.Event()
        self.snapshot: Heartbeat | None = None
        self.requested: set[int] = set()
        self.urls: list[str] = cfg.sync_urls
        """The synchronizer's shard URLs, in shard order (one: unsharded)."""
        self.owners = shard_map(layout, len(self.urls))
        """The shard that owns each fragment: where its updates and fetches go."""
        self.shard_requested: list[set[int]] = [set() for _ in self.urls]
        self.upload_urls: list[str | None] = upload_overrides(cfg.upload_url, len(self.urls))
        """Each shard's upload URL (None: its main URL), from `cfg.upload_url` or the upload
        port the shard names at join."""
        self.fixed_uploads = bool(cfg.upload_url)
        self.fallback_until = [0.0] * len(self.urls)
        """Per shard: until when uploads go to the main URL (its upload port unreachable)."""
        self.turned_away: list[SyncClient | None] = [None] * len(self.urls)
        """Per shard: the main URL's client for updates its upload port turned away."""
        self.turned_away_said = [-UPLOAD_FALLBACK_S] * len(self.urls)
        """Per shard: when a turned-away update was last logged as a warning."""
        self.versions: list[int] = [0] * len(layout.fragments)
        self.held: dict[int, Held] = {}
        """Per fragment served in a delta encoding: the copy last downloaded and its token
        (each fragment's downloads run in its shard's one thread, or at startup); before
        the first, our own initial values under their content's token (`_hold_initial`)."""
        self.broadcast_encoding: str = DEFAULT_BROADCAST_ENCODING
        """How the synchronizer serves fragments, as it said at join (wire/broadcast.py)."""
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
        self.issued: dict[int, int] = {}
        """The incarnation each shard answered at its last join."""
        self.resume_position = 0
        """The synchronizer's data position for this learner id at the last join (windows of
        its slot's stream counted so far; 0 for a new slot)."""
        self.slot_steps = 0
        """Where the slot's inner LR schedule resumes: the highest `slot_steps` any shard
        answered at join (0 for a new slot)."""
        self.finished = False
        """A shard said the job's token budget is merged (at join or in a heartbeat's
        answer): the learner hands over what it holds and stops (synchronizer/budget.py)."""
        self.total_tokens = 0
        """The job's token budget (0: none), as the shards answered at join."""
        self.tokens_merged = 0
        """The job's merged tokens, the highest any shard last answered: each counts every
        token (synchronizer/budget.py), so the highest is the freshest estimate."""
        self.threads: list[threading.Thread] = []
        # one token source for both threads: a rotated token file is re-read once for both
        self.tokens = cfg.token_source()
        self.tls = cfg.client_tls()

    def _client(self, http2: bool = True, shard: int = 0) -> SyncClient:
        return SyncClient(self.urls[shard], self.tokens, http2=http2, tls=self.tls)

    def owned(self, shard: int) -> list[int]:
        return [p for p, s in enumerate(self.owners) if s == shard]

    # ---- startup -----------------------------------------------------------------
    def _check_shard(self, resp: JoinResponse, shard: int) -> None:
        """Refuse (one line) a shard list that is not the job's shards in order."""
        got = (resp.shard, resp.shards)
        mine = self.owned(shard)
        owned = resp.owned or mine  # [] before init
        if got != (shard, len(self.urls)) or owned != mine:
            raise UsageError(
                f"the synchronizer at {self.urls[shard]} is shard {got[0]} of {got[1]} owning "
                f"fragments {owned}; this learner has it as shard {shard} of {len(self.urls)} "
                f"owning {mine}: DDILOCO_SYNC_URL must list every shard's URL, in shard order"
            )

    def join(self, client: SyncClient, shard: int = 0) -> list[int]:
        """Join the job at one shard, initializing it with our parameters if nobody has;
        returns the versions of that shard's fragments (0 for the others)."""
        req = JoinRequest(
            learner_id=self.cfg.learner_id,
            layout_digest=self.layout.digest(),
            host=socket.gethostname(),
            pid=os.getpid(),
            incarnation_floor=self.incarnation,  # one incarnation on every shard
            # the draws before our first heartbeat lands (learner/corpus.py, the data contract)
            data_reserve=join_reserve(
                self.cfg.batch_size * self.cfg.grad_accum,
                int(os.environ.get("WORLD_SIZE") or self.cfg.nproc_per_node),
            ),
            tokens_per_step=self.tokens_per_step or None,
        )
        try:
            resp = client.join(req)
        except SyncRefused as e:
            if e.status == 409 and "layout" in e.detail:  # not this job's model: one line
                msg = f"the synchronizer at {self.urls[shard]} refused: {e.detail}"
                raise UsageError(msg) from None
            raise
        accepted = resp.update_encodings
        if self.cfg.update_encoding not in accepted:
            # a job misconfigured, not an outage: stop with one line (exit 2, learner/cli.py)
            raise UsageError(
                f"the synchronizer at {self.cfg.sync_url} accepts update encodings "
                f"{', '.join(accepted)}; this learner's is {self.cfg.update_encoding}: set "
                "DDILOCO_UPDATE_ENCODING (--update-encoding) to one of those, or add it to the "
                "synchronizer's DDILOCO_UPDATE_ENCODINGS"
            )
        self._check_shard(resp, shard)
        self.broadcast_encoding = resp.broadcast_encoding
        if not self.fixed_uploads and not self.cfg.upload_http2:
            port = resp.upload_port
            self.upload_urls[shard] = with_port(self.urls[shard], port) if port else None
        self.incarnation = max(self.incarnation, resp.incarnation)
        self.issued[shard] = resp.incarnation
        self.resume_position = max(self.resume_position, resp.data_position)  # module docstring
        self.slot_steps = max(self.slot_steps, resp.slot_steps)
        if resp.finished:
            self.finished = True
        self.total_tokens = max(self.total_tokens, resp.total_tokens)
        self.tokens_merged = max(self.tokens_merged, resp.tokens_merged)
        if not resp.initialized:
            meta = {LAYOUT_KEY: self.layout.model_dump_json()}
            try:  # what the job trains, for `ddiloco export` (learner/hf.py model_spec)
                meta[MODEL_KEY] = hf.spec_metadata(
                    self.cfg.model, self.cfg.model_entry, self.cfg.tokenizer
                )
            except (OSError, ValueError) as e:
                log.warning("Initializing without a model spec (an export will lack it): %s", e)
            tensors = self.initial()
            if len(self.urls) > 1:  # a shard keeps only its fragments: send it only those
                mine = {t.name for p in self.owned(shard) for t in self.layout.fragments[p].tensors}
                tensors = {k: v for k, v in tensors.items() if k in mine}
            payload = codec.encode(tensors, meta)
            init = client.init(payload)
            log.info(
                "Initialized the global model (created=%s digest=%s)",
                init.created,
                init.layout_digest,
            )
            return init.versions
        return resp.versions

    def fetch_all(self) -> list[tuple[int, int, Tensors]]:
        """Block until the synchronizer answers (every shard); return every global fragment,
        each from its owner. Startup only."""
        clients = [self._client(shard=i) for i in range(len(self.urls))]
        ports: dict[int, SyncClient] = {}
        joined: set[int] = set()
        backoff = Backoff(cap=1.0)
        while not self.stop_event.is_set():
            try:
                for i, client in enumerate(clients):
                    if i not in joined:  # a shard joined once is not joined again on a retry
                        self.join(client, i)
                        joined.add(i)
                for i, client in enumerate(clients):  # a shard that issued less catches up
                    if self.issued.get(i, 0) < self.incarnation:
                        self.join(client, i)
                out = []
                self._hold_initial()
                for spec in self.layout.fragments:
                    shard = self.owners[spec.index]
                    version, tensors = self._fetch(shard, clients[shard], spec.index, ports)
                    out.append((spec.index, version, tensors))
                self.versions = [v for _, v, _ in out]
                for client in clients:
                    self._count(client)
                for port in ports.values():  # the control threads keep their own
                    port.close()
                return out
            except SyncUnavailable as e:
                wait = backoff.fail()
                log.info("Synchronizer not reachable yet (%s); retrying in %.2fs", e, wait)
                self.stop_event.wait(wait)
        raise RuntimeError("stopped before the synchronizer answered")

    def _hold_initial(self) -> None:
        """With a delta broadcast encoding: hold our initial values of each fragment not yet
        held, under the token of their content (`broadcast.initial_token`), so that a
        version 0 equal to them is not downloaded, and version 1 comes as a delta. Copies:
        the parameters change as the loop trains, a held copy never does."""
        if self.broadcast_encoding not in broadcast.DELTAS or len(self.held) == len(
            self.layout.fragments
        ):
            return
        values = self.initial()
        for spec in self.layout.fragments:
            if spec.index in self.held:
                continue
            tensors = {
                t.name: values[t.name].detach().to("cpu", torch.float32, copy=True)
                for t in spec.tensors
            }
            self.held[spec.index] = Held(broadcast.initial_token(tensors), tensors)

    def start(self) -> None:
        for shard in range(len(self.urls)):  # a control and an upload thread per shard
            for target in (self._control_loop, self._upload_loop):
                name = f"ddiloco-{target.__name__}" + (f"-{shard}" if shard else "")
                t = threading.Thread(target=target, args=(shard,), name=name, daemon=True)
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

    def send(self, meta: UpdateMeta, delta: Tensors, payload: bytes | None = None) -> None:
        """Queue an update: its float delta, or its `payload` encoded already (quantized)."""
        if payload is None:
            self.outbox.put(meta, delta)
        else:
            self.outbox.put(meta, delta, payload=payload)

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
    def _control_loop(self, shard: int = 0) -> None:
        client, backoff = self._client(shard=shard), Backoff()
        ports: dict[int, SyncClient] = {}  # this thread's bulk-port client (`_fetch`)
        mine = set(self.owned(shard))  # a shard answers 0 for the fragments it does not own
        have = [v if p in mine else 0 for p, v in enumerate(self.versions)]
        while not self.stop_event.is_set():
            hb = self.snapshot
            try:
                if hb is not None:
                    hb = hb.model_copy(
                        update={
                            "known_versions": list(have),
                            "wait_s": self.cfg.poll_s,
                            "known_requested": sorted(self.shard_requested[shard]),
                        }
                    )
                    resp = client.heartbeat(hb)
                    self.shard_requested[shard] = set(resp.requested)
                    if resp.finished:  # any shard's word ends the job (synchronizer/budget.py)
                        self.finished = True
                    self.tokens_merged = max(self.tokens_merged, resp.tokens_merged)
                    self.requested = set().union(*self.shard_requested)
                    for p, v in enumerate(resp.versions):
                        if p in mine and v > have[p]:
                            version, tensors = self._fetch(shard, client, p, ports)
                            have[p] = version
                            latest = self.snapshot
                            self.arrival_steps[(p, version)] = latest.step if latest else 0
                            self.arrived.put((p, version, tensors))
                    with self.lock:  # each shard's thread writes its own fragments' versions
                        self.versions = [
                            v if p in mine else self.versions[p]
                            for p, v in enumerate(resp.versions[: len(self.versions)])
                        ]
                self._count(client)
                backoff.ok()
                if hb is None:
                    self.stop_event.wait(0.05)
            except SyncRefused as e:
                if e.kind == "unknown_learner":
                    log.warning("Synchronizer does not know this learner; joining again")
                    self._rejoin(client, backoff, shard)
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

    def _rejoin(self, client: SyncClient, backoff: Backoff, shard: int = 0) -> None:
        try:
            self.join(client, shard)
        except (SyncRefused, SyncUnavailable, UsageError) as e:
            log.warning("Re-join failed: %s", e)
            self.stop_event.wait(backoff.fail())

    def _upload_target(self, shard: int) -> str:
        url = self.upload_urls[shard]
        if url is None or time.monotonic() < self.fallback_until[shard]:
            return self.urls[shard]
        return url

    def _fetch(
        self, shard: int, main: SyncClient, p: int, ports: dict[int, SyncClient]
    ) -> tuple[int, Tensors]:
        """Fragment p from the shard's upload port when it has one (`ports` keeps the calling
        thread's client for it), else, or when the port fails, through `main` (the module
        docstring)."""
        url = self._upload_target(shard)
        if url == self.urls[shard]:
            return self._download(main, p)
        port = ports.get(shard)
        if port is None or port.base_url != url.rstrip("/"):
            if port is not None:
                port.close()
            port = ports[shard] = SyncClient(
                url, self.tokens, http2=False, tls=self.tls, sendmsg=True
            )
        try:
            return self._download(port, p)
        except SyncUnavailable as e:  # a GET is safe to repeat: the main URL at once
            if not self._fall_back(shard, port, e):
                log.debug("Upload port %s: fragment %d from %s (%s)", url, p, main.base_url, e)
        finally:
            self._count(port)
        return self._download(main, p)

    def _download(self, client: SyncClient, p: int) -> tuple[int, Tensors]:
        """Fragment p through `client`, asking for a delta from the copy held of it (a delta
        broadcast encoding, wire/broadcast.py); the copy it arrives as is held next.
        The arrived tensors are never written to (the loop adopts them; the next delta is
        written into tensors of its own): holding them keeps one float32 copy of p."""
        version, got = client.download(p, self.held.get(p))
        if got.token is None:
            self.held.pop(p, None)
        else:
            self.held[p] = Held(got.token, got.tensors)
        return version, got.tensors

    def _upload_client(self, shard: int, client: SyncClient | None) -> SyncClient:
        """The client for the shard's current upload target (a new one when it moved)."""
        url = self._upload_target(shard)
        if client is not None and client.base_url == url.rstrip("/"):
            return client
        if client is not None:
            client.close()
        main = url == self.urls[shard]
        http2 = self.cfg.upload_http2 and main
        # to the upload port (or a relay) the parts go from their own memory (upload_sender.py)
        return SyncClient(url, self.tokens, http2=http2, tls=self.tls, sendmsg=not main)

    def _fall_back(self, shard: int, client: SyncClient, e: Exception) -> bool:
        """An upload port never reached (a proxy or firewall that passes only the main port):
        send to the main URL for `UPLOAD_FALLBACK_S`, then try the upload port again."""
        if not (isinstance(e, SyncUnavailable) and e.unreached):
            return False
        if client.base_url == self.urls[shard].rstrip("/"):
            # the main URL unreachable too: an outage, not a port only the upload's path
            # lacks. Retried with backoff, and to the upload port again once it ends.
            self.fallback_until[shard] = 0.0
            return False
        self.fallback_until[shard] = time.monotonic() + UPLOAD_FALLBACK_S
        log.warning(
            "Upload port %s unreachable (%s); uploading to %s for %.0f s",
            client.base_url,
            e,
            self.urls[shard],
            UPLOAD_FALLBACK_S,
        )
        return True

    def _post(self, shard: int, client: SyncClient, entry: Entry) -> UpdateResponse:
        """Post an update to the shard's upload target. One its upload port turned away (a
        503, or a connection reset before any answer: the port at its connection caps) goes
        to the main URL at once; the next update tries the upload port again."""
        meta = entry.meta
        try:
            return client.post_update(meta.fragment, entry.encoded())  # a re-send: same bytes
        except SyncUnavailable as e:
            if not e.turned_away or client.base_url == self.urls[shard].rstrip("/"):
                raise
            now = time.monotonic()  # a warning per shard per UPLOAD_FALLBACK_S at most
            warn = now - self.turned_away_said[shard] >= UPLOAD_FALLBACK_S
            if warn:
                self.turned_away_said[shard] = now
            log.log(
                logging.WARNING if warn else logging.DEBUG,
                "Upload port %s turned update %s away (%s); posting it to %s",
                client.base_url,
                meta.update_id(),
                e,
                self.urls[shard],
            )
        main = self.turned_away[shard]
        if main is None:
            main = self.turned_away[shard] = SyncClient(
                self.urls[shard], self.tokens, http2=self.cfg.upload_http2, tls=self.tls
            )
        try:
            return main.post_update(meta.fragment, entry.encoded())
        except SyncUnavailable as e:  # not the upload port's fault: retried as an outage
            raise SyncUnavailable(f"turned away by the upload port, then {e}") from None
        finally:
            self._count(main)

    def _upload_loop(self, shard: int = 0) -> None:
        client, backoff = self._upload_client(shard, None), Backoff()
        # each shard's thread takes the oldest update of that shard's fragments: one shard
        # away holds back only its own (one shard: every fragment, strict FIFO)
        mine = frozenset(self.owned(shard)) if len(self.urls) > 1 else None
        while not self.stop_event.is_set():
            entry = self.outbox.take(timeout=0.1, fragments=mine)
            if entry is None:
                continue
            meta = entry.meta
            client = self._upload_client(shard, client)
            try:
                resp = self._post(shard, client, entry)
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
                if self._fall_back(shard, client, e):
                    continue  # the same update, at once, to the main URL
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
