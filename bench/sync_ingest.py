"""How fast one synchronizer takes in updates: real processes, real updates, loopback.

    .venv/bin/python bench/sync_ingest.py                       # 64M params, P = 4, M = 16, 30 s
    .venv/bin/python bench/sync_ingest.py --seconds 10 --params 16e6 --arms h2,h1

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
Arms: h2 (HTTP/2 cleartext, what learners use) and h1 (HTTP/1.1 into the same server).
"""

from __future__ import annotations

import argparse
import json
import os
import re
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

from ddiloco.local.processes import free_port
from ddiloco.synchronizer import codec
from ddiloco.synchronizer.client import SyncClient, SyncRefused, SyncUnavailable
from ddiloco.synchronizer.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    Heartbeat,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

TOKEN = "bench-ingest"
COLS = 4096
TAU = 2
STEP_S = 1.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


def layout(params: int, fragments: int) -> Layout:
    rows = max(1, params // fragments // COLS)
    return Layout(
        fragments=[
            FragmentSpec(index=p, tensors=[TensorSpec(name=f"w{p}", shape=[rows, COLS])])
            for p in range(fragments)
        ]
    )


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


class Payload:
    """One fragment's update body: the data buffer is built once, the header per post."""

    def __init__(self, name: str, shape: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        t = (torch.randn(shape, generator=g) * 1e-4).to(torch.bfloat16)
        self.name, self.shape = name, shape
        self.data = t.view(torch.uint8).numpy().tobytes()

    def body(self, meta: UpdateMeta) -> bytes:
        header = {
            self.name: {"dtype": "BF16", "shape": self.shape, "data_offsets": [0, len(self.data)]},
            "__metadata__": meta.to_metadata(),
        }
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw + self.data


@dataclass
class Tally:
    accepted: int = 0
    accepted_bytes: int = 0
    duplicate: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    latencies: list[float] = field(default_factory=list)


def client_loop(
    url: str, lid: str, http2: bool, payloads: list[Payload], stop: threading.Event, t: Tally
) -> None:
    c = SyncClient(url, TOKEN, http2=http2, timeout=120)
    join = c.join(JoinRequest(learner_id=lid, layout_digest=None))
    versions = list(join.versions)
    step, last_hb = 0, 0.0
    p = int(lid.rsplit("-", 1)[1]) % len(payloads)
    try:
        while not stop.is_set():
            now = time.monotonic()
            if now - last_hb > 1.0:
                hb = c.heartbeat(
                    Heartbeat(
                        learner_id=lid, step=step, steps=[0] * len(payloads),
                        tokens=[0] * len(payloads), base_versions=versions,
                        tokens_total=step * 1000, step_seconds=STEP_S,
                        compute_seconds=float(step), uptime_seconds=float(step) + 1.0,
                    )
                )  # fmt: skip
                versions, last_hb = list(hb.versions), now
            step += 1
            meta = UpdateMeta(
                learner_id=lid, fragment=p, base_version=versions[p], steps=1, tokens=1000,
                learner_step=step, incarnation=join.incarnation,
            )  # fmt: skip
            body = payloads[p].body(meta)
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
                    t.accepted_bytes += len(body)
                    versions[p] = max(versions[p], r.round_version - 1)
                else:
                    t.duplicate += 1
            p = (p + 1) % len(payloads)
    finally:
        c.close()


def histogram(text: str, name: str) -> dict[float, float]:
    """le -> cumulative count, summed over label sets, of a Prometheus histogram."""
    out: dict[float, float] = {}
    for m in re.finditer(rf"^{name}_bucket{{([^}}]*)}} ([0-9.e+-]+)$", text, re.M):
        le = re.search(r'le="([^"]+)"', m.group(1))
        if le:
            key = float("inf") if le.group(1) == "+Inf" else float(le.group(1))
            out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def quantile(h: dict[float, float], q: float) -> float | None:
    """Upper bound of the bucket holding the q-quantile (None without observations)."""
    if not h or h.get(float("inf"), 0) == 0:
        return None
    total = h[float("inf")]
    for le in sorted(h):
        if h[le] >= q * total:
            return le
    return None


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


def run_arm(name: str, args: argparse.Namespace, lay: Layout) -> dict[str, Any]:
    http2 = name == "h2"
    port = free_port()
    state = Path(tempfile.mkdtemp(prefix=f"ingest-{name}-"))
    env = {**os.environ, "DDILOCO_TOKEN": TOKEN, "DDILOCO_QUORUM": str(args.quorum)}
    log = open(state / "sync.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddiloco.cli.main", "synchronizer", "--port", str(port),
         "--state-dir", str(state / "s")],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        boss = SyncClient(url, TOKEN, http2=http2, timeout=600)
        deadline = time.monotonic() + 60
        while not boss.healthy():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(
                    f"synchronizer did not start: {(state / 'sync.log').read_text()}"
                )
            time.sleep(0.2)
        boss.join(JoinRequest(learner_id="init"))
        g = torch.Generator().manual_seed(0)
        init = {
            t.name: torch.randn(t.shape, generator=g) * 0.02
            for f in lay.fragments
            for t in f.tensors
        }
        boss.init(codec.encode(init, {LAYOUT_KEY: lay.model_dump_json()}))
        del init
        payloads = [
            Payload(f.tensors[0].name, f.tensors[0].shape, seed=10 + f.index) for f in lay.fragments
        ]
        stop = threading.Event()
        tallies = [Tally() for _ in range(args.learners)]
        threads = [
            threading.Thread(
                target=client_loop,
                args=(url, f"l-{i}", http2, payloads, stop, tallies[i]),
                daemon=True,
            )
            for i in range(args.learners)
        ]
        s0 = boss.status()
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        for th in threads:
            th.start()
        time.sleep(args.seconds)
        stop.set()
        for th in threads:
            th.join(timeout=120)
        wall = time.monotonic() - t0
        cpu = cpu_seconds(proc.pid) - cpu0
        s1 = boss.status()
        _, _, text = boss.request("GET", "/metrics")
        metrics = text.decode()
        boss.close()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    acc_bytes = sum(t.accepted_bytes for t in tallies)
    accepted = sum(t.accepted for t in tallies)
    merges = s1.merges - s0.merges
    refused: dict[str, int] = {}
    for t in tallies:
        for k, v in t.refused.items():
            refused[k] = refused.get(k, 0) + v
    lat = sorted(x for t in tallies for x in t.latencies)
    budget = TAU * STEP_S
    merge_h = histogram(metrics, "ddiloco_merge_duration_seconds")
    publish_h = histogram(metrics, "ddiloco_round_publish_seconds")

    def frac(h: dict[float, float], q: float) -> float | None:
        v = quantile(h, q)
        return None if v is None else v / budget

    return {
        "arm": name,
        "accepted_gbps": acc_bytes / wall / 1e9,
        "updates_per_s": accepted / wall,
        "merges_per_s": merges / wall,
        "cpu_s_per_gb": cpu / (acc_bytes / 1e9) if acc_bytes else None,
        "server_cpu_share": cpu / wall,
        "post_p50_s": lat[len(lat) // 2] if lat else None,
        "post_p99_s": lat[int(len(lat) * 0.99)] if lat else None,
        "merge_p50_frac": frac(merge_h, 0.5),
        "merge_p99_frac": frac(merge_h, 0.99),
        "publish_p50_frac": frac(publish_h, 0.5),
        "publish_p99_frac": frac(publish_h, 0.99),
        "refused": refused,
        "errors": sum(t.errors for t in tallies),
    }


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=64e6)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--learners", type=int, default=16)
    ap.add_argument("--quorum", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--arms", default="h2,h1", help="comma-separated: h2, h1")
    args = ap.parse_args(argv)
    lay = layout(int(args.params), args.fragments)
    n = lay.fragments[0].numel()
    print(
        f"layout: {sum(f.numel() for f in lay.fragments) / 1e6:.1f}M params in "
        f"{args.fragments} fragments ({n * 2 / 1e6:.0f} MB per bf16 update); "
        f"M = {args.learners}, K = {args.quorum}, {args.seconds:.0f} s per arm; "
        f"cores {os.cpu_count()}, load {os.getloadavg()[0]:.1f}"
    )
    mem = memcpy_gbps(n * 2)
    rows = [run_arm(a, args, lay) for a in args.arms.split(",")]
    print(f"\nmemcpy of one update's bytes: {mem:.2f} GB/s (the physical limit)")
    head = (
        f"{'arm':<4} {'GB/s':>6} {'x memcpy':>8} {'upd/s':>6} {'merge/s':>7} {'CPU s/GB':>8} "
        f"{'post p50':>8} {'merge p50/p99 (x tau*step)':>26} {'publish p50/p99':>16}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['arm']:<4} {r['accepted_gbps']:6.3f} {r['accepted_gbps'] / mem:8.3f} "
            f"{r['updates_per_s']:6.1f} {r['merges_per_s']:7.2f} {fmt(r['cpu_s_per_gb'], '8.2f')} "
            f"{fmt(r['post_p50_s'], '8.3f')} "
            f"{fmt(r['merge_p50_frac'], '.3f'):>12} / {fmt(r['merge_p99_frac'], '.3f'):<11} "
            f"{fmt(r['publish_p50_frac'], '.3f'):>7} / {fmt(r['publish_p99_frac'], '.3f')}"
        )
        if r["refused"] or r["errors"]:
            print(f"     refused {r['refused']}, errors {r['errors']}")
    if len(rows) == 2 and rows[1]["accepted_gbps"]:
        print(
            f"\nh2 / h1 accepted throughput: {rows[0]['accepted_gbps'] / rows[1]['accepted_gbps']:.2f}x"
        )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
