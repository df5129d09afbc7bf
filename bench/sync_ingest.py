"""How fast one synchronizer takes in updates: real processes, real updates, loopback.

    .venv/bin/python bench/sync_ingest.py                       # 64M params, P = 4, M = 16, 30 s
    .venv/bin/python bench/sync_ingest.py --seconds 10 --params 16e6 --arms h2,h1
    .venv/bin/python bench/sync_ingest.py --arms h1 --encodings bfloat16,int8,int4 --shards 1,2 \
        --state-on tmpfs
    .venv/bin/python bench/sync_ingest.py --arms up --offered 0,0.1,0.2   # merge times vs load

Each arm starts a real `ddiloco synchronizer` process (its own state directory, quorum K,
the adaptive grace window on), initializes a layout of `--params` float32 parameters in `P`
fragments (one [rows, 4096] tensor each), and runs M learner clients in threads of this
process. Each client joins, then posts real bf16 updates (safetensors, with the metadata a
learner sends) of its fragments round-robin, each against the version it last heard of
(heartbeats once a second, as a learner does), for `--seconds`. The payloads are built once
per fragment; only the header's metadata changes per post, so the clients cost little
beside the server (they share the machine's cores: on 2 cores the figure is a lower bound).

Printed per arm, side by side: accepted GB/s and updates/s, merges/s, the synchronizer's CPU
seconds per accepted GB (from /proc/<pid>/stat), the merge time per fragment and the time
from a round's first update to its merged fragment being served (p50 and p99, from the
synchronizer's own /metrics histograms) as a fraction of tau x step time for a 1 s step
(tau = 2), and, in the same run, the memcpy rate of one update's bytes: the physical limit.
Also the time from a round's quorum to its merged fragment being served (the grace window,
the merge and persisting it), and from the round's close (its window's end) to served: the
synchronizer's own part, which the window (Eq. 3: half the slack, at most one step) does not
hold; each part of a merge in ms (compute, durable, encode, install, finish), and the
slowest merges of each arm with their parts (the synchronizer logs each merge's); and the
synchronizer's peak resident memory. Arms are every combination of a transport (`--arms`: up,
HTTP/1.1 into the synchronizer's upload port, which learners use (synchronizer/upload_port.py); h1,
HTTP/1.1 into the main port's ASGI server; h2, HTTP/2 cleartext by prior knowledge into the
main port; rt-h2 and rt-up, the round trip: up, with each client also running a learner's control
thread that long-polls heartbeats and downloads every new version of its fragments, over HTTP/2
from the main port or from the upload port (falling back to the main port on a server whose port
takes uploads only), printed with egress GB/s, the share of merges x M downloaded, and the
synchronizer's CPU per GB moved), an update encoding
(`--encodings`: bfloat16, float32, int8, int4, built by `encodings.encode_update` as a learner
does; the synchronizer accepts all of them) and a shard count (`--shards`: S processes,
`ddiloco synchronizer --shard i --shards S`, each fragment posted to its owner; the figures
are for all S together, and per shard: on 2 cores S shards share the same cores, so this
shows the per-shard cost, not a speed-up). `--state-on tmpfs` puts the state directories in
/dev/shm: the update path without the disk's fsync bound (`disk`, the default, is the temp
directory's file system). `--offered G` paces the clients to G GB/s together (each starts
its posts on a schedule, as learners that finish their H steps on time do): at saturation
(0, the default) a merge competes with every update for the cores, so its time there is a
queueing figure; below it, the merge's own. `--snapshot-lag 0,4` runs each arm with the
merge made durable by its fragment file before serving (0) and by a merge journal record,
the file written after (4, the default; synchronizer/storage/journal.py). `--settle S` leaves each
arm's first S seconds out of the merge and round figures (and the slowest merges): every arm
starts a fresh synchronizer, whose first rounds are all fragments' at once on a cold process,
a few merges of a minute's arm but none of an hour's; the merges within the mark are then
printed for the whole arm too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddiloco.learner.sync_client import SyncClient, SyncRefused, SyncUnavailable
from ddiloco.learner.uploads import with_port
from ddiloco.local.processes import free_port
from ddiloco.wire import broadcast, codec, encodings
from ddiloco.wire.protocol import (
    HELD_QUERY,
    LAYOUT_KEY,
    FragmentSpec,
    Heartbeat,
    HeartbeatResponse,
    JoinRequest,
    JoinResponse,
    Layout,
    TensorSpec,
    UpdateMeta,
    shard_map,
)

TOKEN = "bench-ingest"
COLS = 4096
TAU = 2
STEP_S = 1.0
GOAL = 0.25
"""The issue's mark for merge and quorum -> served, as a fraction of tau x step."""
PHASES = ("compute", "durable", "encode", "install", "finish")
"""The parts of a merge (ddiloco_merge_phase_seconds), printed in ms at p50 / p99."""
CLK_TCK = os.sysconf("SC_CLK_TCK")


def layout(params: int, fragments: int) -> Layout:
    rows = max(1, params // fragments // COLS)
    return Layout(
        fragments=[
            FragmentSpec(index=p, tensors=[TensorSpec(name=f"w{p}", shape=[rows, COLS])])
            for p in range(fragments)
        ]
    )


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


class Payload:
    """One fragment's update body in one encoding (`encodings.encode_update`, as a learner builds
    it): the data buffer is built once, the header's metadata per post."""

    def __init__(self, name: str, shape: list[int], seed: int, encoding: str) -> None:
        g = torch.Generator().manual_seed(seed)
        t = torch.randn(shape, generator=g) * 1e-4
        template = UpdateMeta(
            learner_id="x", fragment=0, base_version=0, steps=1, tokens=1, learner_step=1
        )
        payload, _ = encodings.encode_update({name: t}, template, encoding)
        header = codec.read_header(payload, codes=True)
        self.encoding = encoding
        self.entries = {
            k: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
            for k, e in header.tensors.items()
        }
        self.extra = {k: v for k, v in header.metadata.items() if k == encodings.BLOCK_KEY}
        self.data = payload[len(payload) - header.data_bytes :]

    def body(self, meta: UpdateMeta) -> list[bytes]:
        """The post's parts, header then data, sent without joining them (as a learner posts
        `codec.pieces`: a joined 32 MB body per post cost the clients 3x the CPU)."""
        meta = meta.model_copy(update={"encoding": self.encoding})
        header = {**self.entries, "__metadata__": {**meta.to_metadata(), **self.extra}}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return [struct.pack("<Q", len(raw)) + raw, self.data]


@dataclass
class Tally:
    accepted: int = 0
    accepted_bytes: int = 0
    duplicate: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    downloads: int = 0
    down_bytes: int = 0
    down_errors: int = 0
    down_via_port: int = 0
    """Downloads the upload port served (the rest went to the main port)."""


@dataclass
class Learner:
    """What a round-trip client's two threads share, as a learner's upload and control
    threads do: the joins (the uploader's), the versions last heard, the step."""

    joins: list[JoinResponse] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    step: int = 0
    joined: threading.Event = field(default_factory=threading.Event)
    delta: bool = False
    """The synchronizer serves a delta encoding: downloads name the copy held."""


ROUND_TRIP = ("rt-h2", "rt-up")
"""Transports whose clients also download every new version of their fragments, as learners
do: over HTTP/2 to the main port (the learners' path before the upload port served fragments),
or from the upload port (its GET, falling back to the main port where it answers 404: a
synchronizer whose port takes uploads only). Uploads go to the upload port in both."""


def heartbeat(client: SyncClient, hb: Heartbeat) -> HeartbeatResponse:
    """A heartbeat with only the fields set (a server of an older commit refuses fields it
    does not know)."""
    body = hb.model_dump_json(exclude_defaults=True).encode()
    _, _, answer = client.request("POST", "/v1/heartbeat", body)
    return HeartbeatResponse.model_validate_json(answer)


def fetch(client: SyncClient, p: int, held: dict[int, Any] | None = None) -> tuple[int, int]:
    """Download fragment p as the learner's client does, up to its bytes (version, size):
    the tensors' decoding is the learner's cost, and the same either way. `held` (a delta
    broadcast encoding): the copy of each fragment this client holds, named in the request
    so that the synchronizer answers the delta from it, and updated from the answer as a
    learner updates its own (broadcast.read: decoding a delta is the learner's cost too)."""
    path = f"/v1/fragments/{p}"
    if held is not None and p in held:
        path += f"?{HELD_QUERY}={held[p].token}"
    _, headers, body = client.request("GET", path)
    if held is not None:
        try:
            got = broadcast.read(body, held.get(p))
        except broadcast.StaleBase:  # a delta for a copy this client no longer holds
            held.pop(p, None)
            return fetch(client, p, held)
        if got.token is not None:
            held[p] = broadcast.Held(got.token, got.tensors)
    return int(headers["x-ddiloco-version"]), len(body)


def download_loop(
    urls: list[str],
    owner: list[int],
    lid: str,
    transport: str,
    fragments: int,
    shared: Learner,
    stop: threading.Event,
    t: Tally,
) -> None:
    """A learner's control thread: long-poll heartbeats (1 s) to each shard and download
    every fragment whose version moved past the one held, from the shard's upload port
    (rt-up) or over HTTP/2 from its main port (rt-h2); the bodies are dropped."""
    if not shared.joined.wait(60):
        return
    mains = [SyncClient(url, TOKEN, http2=True, timeout=120) for url in urls]
    ports: list[SyncClient | None] = [None] * len(urls)
    if transport == "rt-up":
        ports = [
            SyncClient(with_port(u, j.upload_port), TOKEN, http2=False, timeout=120, sendmsg=True)
            if j.upload_port
            else None
            for u, j in zip(urls, shared.joins, strict=True)
        ]
    have = list(shared.versions)
    held: dict[int, Any] | None = {} if shared.delta else None
    try:
        while not stop.is_set():
            for s, c in enumerate(mains):
                try:
                    hb = heartbeat(
                        c,
                        Heartbeat(
                            learner_id=lid, step=shared.step, steps=[0] * fragments,
                            tokens=[0] * fragments, base_versions=list(shared.versions),
                            tokens_total=shared.step * 1000, step_seconds=STEP_S,
                            compute_seconds=float(shared.step),
                            uptime_seconds=float(shared.step) + 1.0,
                            known_versions=[v if owner[q] == s else 0 for q, v in enumerate(have)],
                            wait_s=1.0 / len(urls),
                        ),
                    )  # fmt: skip
                except (SyncUnavailable, SyncRefused):
                    t.down_errors += 1
                    time.sleep(0.2)
                    continue
                for q, v in enumerate(hb.versions):
                    if owner[q] != s:
                        continue
                    shared.versions[q] = max(shared.versions[q], v)
                    if v <= have[q] or stop.is_set():
                        continue
                    port = ports[s]
                    try:
                        if port is not None:
                            try:
                                version, size = fetch(port, q, held)
                                t.down_via_port += 1
                            except SyncRefused as e:
                                if e.status not in (404, 405):
                                    raise
                                ports[s] = port = None  # a port that takes uploads only
                        if port is None:
                            version, size = fetch(c, q, held)
                        t.down_bytes += size
                    except (SyncUnavailable, SyncRefused):
                        t.down_errors += 1
                        continue
                    t.downloads += 1
                    have[q] = version
    finally:
        for x in [*mains, *ports]:
            if x is not None:
                x.close()


def client_loop(
    urls: list[str],
    owner: list[int],
    lid: str,
    transport: str,
    payloads: list[Payload],
    stop: threading.Event,
    t: Tally,
    rate: float = 0.0,
    joined: bool = False,
    sendmsg: bool = True,
    shared: Learner | None = None,
) -> None:
    """One learner: joins every shard, heartbeats to each once a second, posts fragment p
    to its owner `owner[p]` against the version that shard last said; with `rate` (bytes
    per second) each post starts on a schedule of that many bytes per second, as a learner
    that finishes its H steps on time would send (a late post is not made up for twice).
    With `shared` (a round-trip arm) the heartbeats and versions are its `download_loop`'s."""
    cs = [SyncClient(url, TOKEN, http2=transport == "h2", timeout=120) for url in urls]
    joins = [join(c, lid) for c in cs]
    ups = cs  # h1 and h2: updates go to the main port, as control calls do
    if transport in (
        "up",
        *ROUND_TRIP,
    ):  # the upload port each shard named at join (upload_port.py)
        ports = [j.upload_port for j in joins]
        assert all(ports), "a synchronizer without an upload port"
        ups = [SyncClient(with_port(u, q), TOKEN, http2=False, timeout=120, sendmsg=sendmsg)
               for u, q in zip(urls, ports, strict=True)]  # fmt: skip
    versions = [joins[owner[p]].versions[p] for p in range(len(payloads))]
    if shared is not None:
        shared.joins, shared.versions = joins, versions  # one list: the heartbeats update it
        shared.joined.set()
    step, last_hb = 0, 0.0
    p = int(lid.rsplit("-", 1)[1]) % len(payloads)
    due = time.monotonic()
    try:
        while not stop.is_set():
            now = time.monotonic()
            if shared is not None:
                shared.step = step
            elif now - last_hb > 1.0:
                for s, c in enumerate(cs):
                    hb = heartbeat(
                        c,
                        Heartbeat(
                            learner_id=lid, step=step, steps=[0] * len(payloads),
                            tokens=[0] * len(payloads), base_versions=versions,
                            tokens_total=step * 1000, step_seconds=STEP_S,
                            compute_seconds=float(step), uptime_seconds=float(step) + 1.0,
                        ),
                    )  # fmt: skip
                    for q, v in enumerate(hb.versions):
                        if owner[q] == s:
                            versions[q] = v
                last_hb = now
            step += 1
            c = ups[owner[p]]
            meta = UpdateMeta(
                learner_id=lid, fragment=p, base_version=versions[p], steps=1, tokens=1000,
                learner_step=step, incarnation=joins[owner[p]].incarnation,
            )  # fmt: skip
            parts = payloads[p].body(meta)
            body: bytes | list[bytes] = b"".join(parts) if joined else parts
            size = sum(map(len, parts))
            if rate:
                if stop.wait(max(0.0, due - time.monotonic())):
                    break
                due = max(due, time.monotonic() - 1.0) + size / rate
            t0 = time.perf_counter()
            try:
                r = c.post_update(p, body)
            except SyncRefused as e:
                t.refused[e.kind] = t.refused.get(e.kind, 0) + 1
                if e.kind == "stale":
                    last_hb = 0.0
            except SyncUnavailable:
                t.errors += 1
                time.sleep(0.2)
            else:
                t.latencies.append(time.perf_counter() - t0)
                if r.status == "accepted":
                    t.accepted += 1
                    t.accepted_bytes += size
                    versions[p] = max(versions[p], r.round_version - 1)
                else:
                    t.duplicate += 1
            p = (p + 1) % len(payloads)
    finally:
        for c in {id(c): c for c in cs + ups}.values():
            c.close()


def histogram(text: str, name: str, label: str = "") -> dict[float, float]:
    """le -> cumulative count, summed over label sets (those holding `label`, e.g.
    'phase="compute"', when given), of a Prometheus histogram."""
    out: dict[float, float] = {}
    for m in re.finditer(rf"^{name}_bucket{{([^}}]*)}} ([0-9.e+-]+)$", text, re.M):
        if label not in m.group(1):
            continue
        le = re.search(r'le="([^"]+)"', m.group(1))
        if le:
            key = float("inf") if le.group(1) == "+Inf" else float(le.group(1))
            out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def quantile(h: dict[float, float], q: float) -> float | None:
    """The q-quantile, interpolated linearly inside the bucket that holds it (as
    Prometheus's histogram_quantile does; None without observations). Inside the +Inf
    bucket it is the highest finite bound: a lower bound."""
    if not h or h.get(float("inf"), 0) == 0:
        return None
    total, below, lo = h[float("inf")], 0.0, 0.0
    for le in sorted(h):
        if h[le] >= q * total:
            if le == float("inf"):
                return lo
            inside = h[le] - below
            return lo + (le - lo) * ((q * total - below) / inside if inside else 1.0)
        below, lo = h[le], le
    return None


def within(h: dict[float, float], bound: float) -> tuple[int, int] | None:
    """(observations <= bound, all) of a histogram that has `bound` for a bucket."""
    if not h or bound not in h:
        return None
    return int(h[bound]), int(h[float("inf")])


def sum_count(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram over its label sets."""
    sums = [float(x) for x in re.findall(rf"^{name}_sum(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]
    counts = [
        float(x) for x in re.findall(rf"^{name}_count(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    ]
    return sum(sums), sum(counts)


def memcpy_gbps(nbytes: int, repeat: int = 7) -> float:
    """One thread copying one update's bytes between two buffers (best of `repeat`)."""
    src = bytearray(os.urandom(1 << 20)) * max(1, nbytes >> 20)
    dst = bytearray(len(src))
    view = memoryview(dst)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        view[:] = src
        best = min(best, time.perf_counter() - t0)
    return len(src) / best / 1e9


def join(client: SyncClient, lid: str) -> JoinResponse:
    """Join as `lid`, sending only the fields set (a server of an older commit, side by side
    in `--servers`, refuses fields it does not know)."""
    body = JoinRequest(learner_id=lid).model_dump_json(exclude_defaults=True).encode()
    _, _, answer = client.request("POST", "/v1/join", body)
    got = json.loads(answer)
    got.setdefault("broadcast_encoding", "float32")  # a server from before it could be set
    return JoinResponse.model_validate(got)


@dataclass(frozen=True)
class Arm:
    transport: str
    """h2 or h1 into the main port (uvicorn), or up: HTTP/1.1 into the upload port."""
    encoding: str
    shards: int
    offered: float = 0.0
    """GB/s the M clients offer together, paced (0: each posts as fast as it is answered)."""
    lag: int | None = None
    """The synchronizer's `--snapshot-lag` (None: its default, 4): 0 writes each merge's
    fragment file before serving it, > 0 journals the merge and writes the file after."""
    server: str = ""
    """The label of the interpreter that runs the synchronizer (`--servers`; "": this one)."""
    bodies: str = "parts"
    """How the clients post a body: its parts (header, data), `joined` into one buffer, or
    its parts through libcurl's read callback (`curl`: the client before upload_sender.py)."""
    down: str = ""
    """The synchronizer's `--broadcast-encoding` ("": its default, which a synchronizer
    of an older commit also has)."""

    @property
    def name(self) -> str:
        paced = f" @{self.offered:g}" if self.offered else ""
        lag = f" L={self.lag}" if self.lag is not None else ""
        server = f" [{self.server}]" if self.server else ""
        bodies = f" {self.bodies}" if self.bodies != "parts" else ""
        down = f" down={self.down}" if self.down else ""
        return f"{self.transport} {self.encoding} S={self.shards}{lag}{paced}{bodies}{down}{server}"


def start_shard(
    i: int, arm: Arm, args: argparse.Namespace, root: Path
) -> tuple[subprocess.Popen[bytes], str, Any]:
    port = free_port()
    env = {
        **os.environ,
        "DDILOCO_TOKEN": TOKEN,
        "DDILOCO_QUORUM": str(args.quorum),
        "DDILOCO_UPDATE_ENCODINGS": ",".join(encodings.ALL),
    }
    log = open(root / f"sync-{i}.log", "w")  # noqa: SIM115 - closed by the caller
    python = args.pythons.get(arm.server, sys.executable)
    cmd = [python, "-m", "ddiloco.cli.main", "synchronizer", "--port", str(port),
           "--upload-port", str(free_port()), "--state-dir", str(root / f"s-{i}")]  # fmt: skip
    if arm.shards > 1:
        cmd += ["--shard", str(i), "--shards", str(arm.shards)]
    if arm.lag is not None:
        cmd += ["--snapshot-lag", str(arm.lag)]
    if arm.down:
        cmd += ["--broadcast-encoding", arm.down]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


def init_payload(lay: Layout) -> bytes:
    """The init upload: every tensor of `lay` drawn from one seeded generator, and the layout."""
    g = torch.Generator().manual_seed(0)
    init = {
        t.name: torch.randn(t.shape, generator=g) * 0.02 for f in lay.fragments for t in f.tensors
    }
    return codec.encode(init, {LAYOUT_KEY: lay.model_dump_json()})


def run_arm(arm: Arm, args: argparse.Namespace, lay: Layout) -> dict[str, Any]:
    http2 = arm.transport == "h2"
    base = "/dev/shm" if args.state_on == "tmpfs" else None
    root = Path(tempfile.mkdtemp(prefix="ingest-", dir=base))
    shards = [start_shard(i, arm, args, root) for i in range(arm.shards)]
    urls = [url for _, url, _ in shards]
    owner = shard_map(lay, arm.shards)
    try:
        bosses = [SyncClient(url, TOKEN, http2=http2, timeout=600) for url in urls]
        deadline = time.monotonic() + 60
        for (proc, _, _), boss in zip(shards, bosses, strict=True):
            while not boss.healthy():
                if time.monotonic() > deadline or proc.poll() is not None:
                    logs = "".join(f.read_text() for f in root.glob("sync-*.log"))
                    raise RuntimeError(f"synchronizer did not start: {logs}")
                time.sleep(0.2)
        body = init_payload(lay)
        for boss in bosses:  # each shard keeps its own fragments of the one init upload
            join(boss, "init")
            boss.init(body)
        del body
        payloads = [
            Payload(f.tensors[0].name, f.tensors[0].shape, 10 + f.index, arm.encoding)
            for f in lay.fragments
        ]
        stop = threading.Event()
        tallies = [Tally() for _ in range(args.learners)]
        delta = arm.down.endswith("-delta")
        shared = [Learner(delta=delta) if arm.transport in ROUND_TRIP else None for _ in tallies]
        threads = [
            threading.Thread(
                target=client_loop,
                args=(urls, owner, f"l-{i}", arm.transport, payloads, stop, tallies[i]),
                kwargs={
                    "rate": arm.offered * 1e9 / args.learners,
                    "joined": arm.bodies == "joined",
                    "sendmsg": arm.bodies != "curl",
                    "shared": shared[i],
                },
                daemon=True,
            )
            for i in range(args.learners)
        ]
        threads += [
            threading.Thread(
                target=download_loop,
                args=(urls, owner, f"l-{i}", arm.transport, len(lay.fragments), x, stop),
                kwargs={"t": tallies[i]},
                daemon=True,
            )
            for i, x in enumerate(shared)
            if x is not None
        ]
        s0 = [b.status() for b in bosses]
        pids = [proc.pid for proc, _, _ in shards]
        cpu0, t0 = sum(map(cpu_seconds, pids)), time.monotonic()
        own0 = cpu_seconds(os.getpid())
        for th in threads:
            th.start()
        before, settled_at = "", None  # the metrics as the arm settles (--settle)
        if 0 < args.settle < args.seconds:
            time.sleep(args.settle)
            settled_at = time.time()
            before = "".join(b.request("GET", "/metrics")[2].decode() for b in bosses)
        time.sleep(args.seconds - (args.settle if settled_at else 0.0))
        stop.set()
        for th in threads:
            th.join(timeout=120)
        wall = time.monotonic() - t0
        cpu = sum(map(cpu_seconds, pids)) - cpu0
        own = cpu_seconds(os.getpid()) - own0
        rss = max(map(peak_rss_mb, pids))
        s1 = [b.status() for b in bosses]
        metrics = "".join(b.request("GET", "/metrics")[2].decode() for b in bosses)
        for b in bosses:
            b.close()
    finally:
        for proc, _, _log in shards:
            proc.terminate()
        for proc, _, log in shards:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
        logged = slow_merges(root, settled_at)
        shutil.rmtree(root, ignore_errors=True)
    acc_bytes = sum(t.accepted_bytes for t in tallies)
    down_bytes = sum(t.down_bytes for t in tallies)
    downloads = sum(t.downloads for t in tallies)
    accepted = sum(t.accepted for t in tallies)
    merges = sum(b.merges - a.merges for a, b in zip(s0, s1, strict=True))
    refused: dict[str, int] = {}
    for t in tallies:
        for k, v in t.refused.items():
            refused[k] = refused.get(k, 0) + v
    lat = sorted(x for t in tallies for x in t.latencies)
    budget = TAU * STEP_S
    whole = histogram(metrics, "ddiloco_merge_duration_seconds")

    def hist(name: str, label: str = "") -> dict[float, float]:
        """The histogram of what was observed once the arm settled (all of it without
        --settle)."""
        h, h0 = histogram(metrics, name, label), histogram(before, name, label)
        return {le: n - h0.get(le, 0.0) for le, n in h.items()}

    def frac(name: str, q: float) -> float | None:
        v = quantile(hist(name), q)
        return None if v is None else v / budget

    def mean(text: str, name: str) -> float | None:
        s1, n1 = sum_count(text, name)
        s0, n0 = sum_count(before, name)
        return (s1 - s0) / (n1 - n0) if n1 > n0 else None

    def ratio(v: float | None) -> float | None:
        return None if v is None else v / budget

    return {
        "arm": arm.name,
        "transport": arm.transport,
        "encoding": arm.encoding,
        "shards": arm.shards,
        "offered_gbps": arm.offered,
        "snapshot_lag": arm.lag,
        "state_on": args.state_on,
        "server": arm.server,
        "down": arm.down,
        "accepted_gbps": acc_bytes / wall / 1e9,
        "egress_gbps": down_bytes / wall / 1e9,
        "downloads": downloads,
        "downloads_via_port": sum(t.down_via_port for t in tallies),
        "download_errors": sum(t.down_errors for t in tallies),
        "download_cover": downloads / (merges * args.learners) if merges else None,
        "cpu_s_per_gb_moved": cpu / ((acc_bytes + down_bytes) / 1e9) if acc_bytes else None,
        "server_cpu_s": cpu,
        "accepted_gb": acc_bytes / 1e9,
        "down_gb": down_bytes / 1e9,
        "load": os.getloadavg()[0],
        "per_shard_gbps": acc_bytes / wall / 1e9 / arm.shards,
        "updates_per_s": accepted / wall,
        "merges_per_s": merges / wall,
        "cpu_s_per_gb": cpu / (acc_bytes / 1e9) if acc_bytes else None,
        "server_cpu_share": cpu / wall,
        "server_peak_rss_mb": rss,
        "client_cpu_s_per_gb": own / (acc_bytes / 1e9) if acc_bytes else None,
        "client_cpu_share": own / wall,
        "post_p50_s": lat[len(lat) // 2] if lat else None,
        "post_p99_s": lat[int(len(lat) * 0.99)] if lat else None,
        "merge_p50_frac": frac("ddiloco_merge_duration_seconds", 0.5),
        "merge_p99_frac": frac("ddiloco_merge_duration_seconds", 0.99),
        "served_p50_frac": frac("ddiloco_round_served_seconds", 0.5),
        "served_p99_frac": frac("ddiloco_round_served_seconds", 0.99),
        "close_p50_frac": frac("ddiloco_round_close_served_seconds", 0.5),
        "close_p99_frac": frac("ddiloco_round_close_served_seconds", 0.99),
        "publish_p50_frac": frac("ddiloco_round_publish_seconds", 0.5),
        "publish_p99_frac": frac("ddiloco_round_publish_seconds", 0.99),
        "merge_mean_frac": ratio(mean(metrics, "ddiloco_merge_duration_seconds")),
        "merges_within_whole": within(whole, GOAL * budget),
        "merge_p99_whole_frac": ratio(quantile(whole, 0.99)),
        "merges_within": within(hist("ddiloco_merge_duration_seconds"), GOAL * budget),
        "close_within": within(hist("ddiloco_round_close_served_seconds"), GOAL * budget),
        "phases": {
            ph: (
                quantile(hist("ddiloco_merge_phase_seconds", f'phase="{ph}"'), 0.5),
                quantile(hist("ddiloco_merge_phase_seconds", f'phase="{ph}"'), 0.99),
            )
            for ph in PHASES
        },
        "file_writes": {
            by: (
                int(h.get(float("inf"), 0)),
                quantile(h, 0.5),
                quantile(h, 0.99),
            )
            for by in ("background", "merge")
            for h in [hist("ddiloco_fragment_file_write_seconds", f'by="{by}"')]
        },
        "slowest": logged[:SLOWEST],
        "served_mean_frac": ratio(mean(metrics, "ddiloco_round_served_seconds")),
        "grace_mean_s": mean(metrics, "ddiloco_grace_window_seconds"),
        "refused": refused,
        "errors": sum(t.errors for t in tallies),
    }


MERGED = re.compile(
    r"^(\S+ [0-9:]+),(\d+) .*Merged fragment=(\d+) version=(\d+) .* in (\d+) ms \((.*)\)$", re.M
)
SLOWEST = 5
"""The slowest merges of an arm printed with their parts (from the synchronizer's log)."""


SHORT = {
    "compute": "c",
    "durable": "d",
    "encode": "e",
    "install": "i",
    "finish": "f",
    "ran": " ran ",
    "queued": " queued ",
    "inputs": " inputs@",
    "record": " record@",
}
"""The parts' names in the slowest merges' lines: compute, durable, encode, install,
finish; then, of the compute, its time on a core (ran) and runnable waiting for one; of a
journaled merge's durable part, when its inputs' fsync and its record's fdatasync returned
(ms from its start, the compute's end: they run side by side)."""


def slow_merges(root: Path, since: float | None = None) -> list[dict[str, Any]]:
    """Every merge the shards logged (served at `since`, a time.time(), or later), slowest
    first: fragment, version, ms, and its parts in ms (the log line `service.py` writes as
    the merge is served, after the local time it was)."""
    out = []
    for f in root.glob("sync-*.log"):
        for m in MERGED.finditer(f.read_text(errors="replace")):
            at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
            if since is not None and at < since:
                continue
            parts = dict(kv.rsplit(" ", 1) for kv in m.group(6).split(", ") if " " in kv)
            out.append(
                {
                    "fragment": int(m.group(3)),
                    "version": int(m.group(4)),
                    "ms": int(m.group(5)),
                    "parts": {k: int(v) for k, v in parts.items()},
                    "resummed": " sum=resummed " in m.group(0),
                }
            )
    return sorted(out, key=lambda r: -r["ms"])


def slowest_table(rows: list[dict[str, Any]]) -> str:
    """Each arm's slowest merges and where their time went: the merges that make the p99."""
    lines = []
    for r in rows:
        cells = [
            f"f{m['fragment']} v{m['version']}{' R' if m.get('resummed') else ''} {m['ms']} ms ("
            + " ".join(f"{SHORT.get(k, k)}{v}" for k, v in m["parts"].items())
            + ")"
            for m in r["slowest"]
        ]
        lines.append(f"  {r['arm']:<30} " + "; ".join(cells))
    return "\n".join(lines)


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def pair(r: dict[str, Any], key: str) -> str:
    return f"{fmt(r[key + '_p50_frac'], '.3f')} / {fmt(r[key + '_p99_frac'], '.3f')}"


def table(rows: list[dict[str, Any]], mem: float) -> str:
    head = (
        f"{'arm':<30} {'GB/s':>6} {'/shard':>6} {'x memcpy':>8} {'upd/s':>6} {'merge/s':>7} "
        f"{'CPU s/GB':>8} {'cores srv/cli':>13} {'post p50':>8} {'merge p50/p99':>15} {'quorum->served':>15} "
        f"{'close->served':>15} "
        f"{'publish p50/p99':>16} {'mean merge/served':>17} {'grace s':>7}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['arm']:<30} {r['accepted_gbps']:6.3f} {r['per_shard_gbps']:6.3f} "
            f"{r['accepted_gbps'] / mem:8.3f} {r['updates_per_s']:6.1f} {r['merges_per_s']:7.2f} "
            f"{fmt(r['cpu_s_per_gb'], '8.2f')} "
            f"{r['server_cpu_share']:6.2f}/{r['client_cpu_share']:<6.2f} "
            f"{fmt(r['post_p50_s'], '8.3f')} "
            f"{pair(r, 'merge'):>15} {pair(r, 'served'):>15} {pair(r, 'close'):>15} "
            f"{pair(r, 'publish'):>16} "
            f"{fmt(r['merge_mean_frac'], '.3f'):>8}/{fmt(r['served_mean_frac'], '.3f'):<8} "
            f"{fmt(r['grace_mean_s'], '7.3f')}"
        )
        if r["refused"] or r["errors"]:
            lines.append(f"{'':<30} refused {r['refused']}, errors {r['errors']}")
    return "\n".join(lines)


def share(v: tuple[int, int] | None) -> str:
    return "-" if v is None else f"{v[0]} / {v[1]} ({v[0] / max(1, v[1]):.1%})"


def phase_table(rows: list[dict[str, Any]]) -> str:
    """Each part of a merge, in ms at p50 / p99: where its time goes."""
    lines = [f"{'arm':<30} " + " ".join(f"{ph:>13}" for ph in PHASES)]
    for r in rows:
        cells = [
            f"{fmt(None if a is None else a * 1e3, '.0f')}/{fmt(None if b is None else b * 1e3, '.0f')}"
            for a, b in (r["phases"][ph] for ph in PHASES)
        ]
        lines.append(f"{r['arm']:<30} " + " ".join(f"{c:>13}" for c in cells))
    return "\n".join(lines)


def h2_ratios(rows: list[dict[str, Any]]) -> list[str]:
    """h2 / h1 and up / h1 accepted throughput, for each (encoding, shards) measured both
    ways."""
    out = []
    by = {(r["transport"], r["encoding"], r["shards"]): r for r in rows}
    for (transport, enc, shards), r in by.items():
        h1 = by.get(("h1", enc, shards))
        if transport in ("h2", "up") and h1 is not None and h1["accepted_gbps"]:
            ratio = r["accepted_gbps"] / h1["accepted_gbps"]
            out.append(f"{transport} / h1 accepted throughput ({enc}, S={shards}): {ratio:.2f}x")
    return out


def round_trip_table(rows: list[dict[str, Any]]) -> str:
    """Ingress and egress, merges/s, the share of (merges x M) downloaded, the synchronizer's
    CPU per GB moved both ways, and per GB downloaded: its CPU less what the same server's
    upload-only arm spent per GB accepted times this arm's accepted GB (an estimate: what the
    uploads cost alone)."""
    by = {(r["transport"], r["encoding"], r["shards"], r["server"], r["down"]): r for r in rows}
    head = (
        f"{'arm':<36} {'in GB/s':>7} {'out GB/s':>8} {'merge/s':>7} {'cover':>6} "
        f"{'CPU s/GB moved':>14} {'CPU s/GB in':>11} {'CPU s/GB out (est)':>18} {'load':>5}"
    )
    lines = [head]
    for (transport, enc, shards, server, _), r in by.items():
        base = by.get(("up", enc, shards, server, ""))
        out = None
        if transport in ROUND_TRIP and base and base["cpu_s_per_gb"] and r["down_gb"]:
            uploads = base["cpu_s_per_gb"] * r["accepted_gb"]
            out = (r["server_cpu_s"] - uploads) / r["down_gb"]
        lines.append(
            f"{r['arm']:<36} {r['accepted_gbps']:7.3f} {r['egress_gbps']:8.3f} "
            f"{r['merges_per_s']:7.2f} {fmt(r['download_cover'], '6.2f')} "
            f"{fmt(r['cpu_s_per_gb_moved'], '14.2f')} {fmt(r['cpu_s_per_gb'], '11.2f')} "
            f"{fmt(out, '18.2f')} {r['load']:5.1f}"
        )
        if r["downloads"]:
            lines.append(
                f"{'':<36} {r['downloads']} downloads, {r['downloads_via_port']} from the bulk "
                f"port, {r['download_errors']} errors"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=64e6)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--learners", type=int, default=16)
    ap.add_argument("--quorum", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds at each arm's start whose merges the merge and round figures leave out"
        " (each arm starts a fresh synchronizer: its first rounds are every fragment's at once,"
        " on a cold process); the merges within the mark are printed for the whole arm too",
    )
    ap.add_argument(
        "--arms",
        default="up,h1,h2",
        help="transports, comma-separated: up, h1, h2; rt-h2, rt-up: up with every client also"
        " downloading every new version (over HTTP/2 to the main port, or from the upload port)",
    )
    ap.add_argument(
        "--encodings", default="bfloat16", help="update encodings, comma-separated (encodings.py)"
    )
    ap.add_argument("--shards", default="1", help="shard counts, comma-separated (e.g. 1,2)")
    ap.add_argument(
        "--offered",
        default="0",
        help="GB/s the clients offer together, paced, comma-separated (0: as fast as "
        "answered; e.g. 0,0.15 measures the merge's times at saturation and at a load below it)",
    )
    ap.add_argument(
        "--warmup",
        type=float,
        default=10.0,
        help="seconds of the first arm run first and discarded (0: none); the first arm of a "
        "run on a fresh machine measured 0.25 GB/s where the same arm later gave 0.63",
    )
    ap.add_argument(
        "--snapshot-lag",
        default="",
        help="synchronizer --snapshot-lag values, comma-separated (e.g. 0,4: each merge's "
        "file before serving against journaled merges; empty: the default only)",
    )
    ap.add_argument(
        "--state-on",
        choices=["disk", "tmpfs"],
        default="disk",
        help="state directories on the temp directory's disk, or in /dev/shm (no fsync bound)",
    )
    ap.add_argument(
        "--servers",
        default="",
        help="label=python pairs, comma-separated: each arm runs once per interpreter, "
        "alternated (e.g. new=.venv/bin/python,old=/tmp/old/.venv/bin/python: two trees' "
        "synchronizers side by side, the same clients); empty: this interpreter",
    )
    ap.add_argument(
        "--downloads",
        default="",
        help="the synchronizer's broadcast encodings for the round-trip arms, comma-separated "
        "(float32, bfloat16, int8, int8-delta, int4-delta; empty: its default); the server "
        "labelled old in --servers (an older commit) runs only the default",
    )
    ap.add_argument(
        "--bodies",
        default="parts",
        help="how clients post a body, comma-separated: parts (header and data, not "
        "joined: as `SyncClient.post_update` takes `codec.pieces`), joined (one buffer), or "
        "curl (parts through libcurl's read callback: the learner's client before upload_sender.py)",
    )
    args = ap.parse_args(argv)
    args.pythons = dict(x.split("=", 1) for x in args.servers.split(",")) if args.servers else {}
    lags = [int(x) for x in args.snapshot_lag.split(",")] if args.snapshot_lag else [None]
    downs = args.downloads.split(",") if args.downloads else [""]
    arms = [
        Arm(t, e, int(s), float(o), lag, server, bodies, d if t in ROUND_TRIP else "")
        for d in downs
        for o in args.offered.split(",")
        for lag in lags
        for bodies in args.bodies.split(",")
        for server in (list(args.pythons) or [""])
        for s in args.shards.split(",")
        for e in args.encodings.split(",")
        for t in args.arms.split(",")
        if not (d and server == "old") and (t in ROUND_TRIP or d == downs[0])
    ]
    for a in arms:
        if (
            a.transport not in ("up", "h1", "h2", *ROUND_TRIP)
            or a.encoding not in encodings.ALL
            or a.shards < 1
            or a.offered < 0
            or a.bodies not in ("parts", "joined", "curl")
        ):
            ap.error(
                f"unknown arm {a.name!r}: transports up/h1/h2/rt-h2/rt-up, encodings "
                f"{sorted(encodings.ALL)}"
            )
    lay = layout(int(args.params), args.fragments)
    n = lay.fragments[0].numel()
    print(
        f"layout: {sum(f.numel() for f in lay.fragments) / 1e6:.1f}M params in "
        f"{args.fragments} fragments ({n * 2 / 1e6:.0f} MB per bf16 update); "
        f"M = {args.learners}, K = {args.quorum}, {args.seconds:.0f} s per arm; state on "
        f"{args.state_on}; cores {os.cpu_count()}, load {os.getloadavg()[0]:.1f}"
    )
    mem = memcpy_gbps(n * 2)
    if args.warmup > 0:
        warm = run_arm(arms[0], argparse.Namespace(**{**vars(args), "seconds": args.warmup}), lay)
        print(f"  warm-up, {arms[0].name}: {warm['accepted_gbps']:.3f} GB/s (discarded)")
    rows = []
    for a in arms:
        rows.append(run_arm(a, args, lay))
        print(f"  {a.name}: {rows[-1]['accepted_gbps']:.3f} GB/s, load {os.getloadavg()[0]:.1f}")
    print(f"\nmemcpy of one update's bytes: {mem:.2f} GB/s (the physical limit)")
    print(
        "merge, quorum->served, close->served (the window's end to served: the synchronizer's"
        " own part) and publish: p50 / p99 (interpolated in the histograms' buckets) and means,"
        " as fractions of tau x step (1 s step); grace: the mean window in seconds"
    )
    print(table(rows, mem))
    print("\nparts of a merge (ddiloco_merge_phase_seconds), ms p50/p99:")
    print(phase_table(rows))
    print(
        f"\nthe {SLOWEST} slowest merges (the synchronizer's log): fragment, version, ms"
        " (c compute, d durable, e encode, i install, f finish; R: the merge summed its round"
        " itself, not as it came)"
    )
    print(slowest_table(rows))
    print(f"\nmerges and close->served within {GOAL} of tau x step (count / all):")
    for r in rows:
        print(
            f"  {r['arm']:<30} merge {share(r['merges_within'])}, close->served "
            f"{share(r['close_within'])}"
            + (
                f"; whole arm: merge {share(r['merges_within_whole'])}, p99 "
                f"{fmt(r['merge_p99_whole_frac'], '.3f')}"
                if args.settle
                else ""
            )
        )
    print("\nsynchronizer peak resident memory (VmHWM, the largest shard's), MB:")
    for r in rows:
        print(f"  {r['arm']:<30} {r['server_peak_rss_mb']:.0f}")
    print("\nfragment files written (ddiloco_fragment_file_write_seconds): count, s p50 / p99")
    for r in rows:
        cells = [
            f"{by} {n}, {fmt(a, '.2f')} / {fmt(b, '.2f')}"
            for by, (n, a, b) in r["file_writes"].items()
        ]
        print(f"  {r['arm']:<30} " + "; ".join(cells))
    for line in h2_ratios(rows):
        print(line)
    if any(r["transport"] in ROUND_TRIP for r in rows):
        print("\nthe round trip (every client downloads every new version of its fragments):")
        print(round_trip_table(rows))
    print(json.dumps({"memcpy_gbps": mem, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
