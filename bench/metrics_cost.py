"""What the synchronizer's metrics cost: CPU per accepted update and scrape time, on against off.

    .venv/bin/python bench/metrics_cost.py                        # 16 clients per arm, 60 s
    .venv/bin/python bench/metrics_cost.py --clients 32 --seconds 120 --scrape-every 1

A bench, not a test. Three real `ddiloco synchronizer` processes run side by side, at the same
time, on the same machine (so they share its load), each with the same M learner clients of
bench/load.py (a heartbeat every 0.5 s over h2c, a download of each fragment that moved, a
bf16 update of the next fragment every ~3 s over HTTP/1.1, the same seeds in every arm):

- `off`:     DDILOCO_METRICS=0: every instrument a no-op, /metrics answers 404;
- `on`:      metrics on, never scraped: what the instruments cost by themselves;
- `scraped`: metrics on, scraped every `--scrape-every` seconds (Prometheus' default is
             15 s; 1 s here makes the scrape's share visible).

For each arm it reads the synchronizer's CPU seconds (/proc, user + system) over the run and
divides by the updates accepted and by the GB received; it times every scrape of `scraped`
(p50, p99, size) and, as a floor, the same GET against `off` (a 404: one request's fixed
cost). It prints the figures and the ratios on / off and scraped / off, and with `--json`
writes them. The load average before and after is printed: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pycurl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load  # bench/load.py: the learner clients, the layout, /proc readers

from ddiloco.learner.sync_client import SyncClient
from ddiloco.local.processes import ddiloco_command, free_port
from ddiloco.wire import codec, tls
from ddiloco.wire.auth import TokenFile
from ddiloco.wire.protocol import LAYOUT_KEY, JoinRequest

ARMS = {"off": "0", "on": "1", "scraped": "1"}


class Arm:
    """One synchronizer process and its URL, token and log."""

    def __init__(self, name: str, work: Path, quorum: int) -> None:
        self.name = name
        self.dir = work / name
        self.dir.mkdir(parents=True)
        self.token_file = self.dir / "token"
        tls.write_pem(os.urandom(18).hex().encode() + b"\n", self.token_file, private=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_")}
        env |= {
            "DDILOCO_TOKEN_FILE": str(self.token_file),
            "DDILOCO_QUORUM": str(quorum),
            "DDILOCO_METRICS": ARMS[name],
        }
        argv = ddiloco_command(
            "synchronizer",
            "--port",
            str(self.port),
            "--state-dir",
            str(self.dir / "state"),
            "--log-level",
            "WARNING",
        )
        self.log = open(self.dir / "sync.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.admin = SyncClient(self.url, TokenFile(self.token_file), timeout=30)

    def ready(self, layout: load.Layout) -> None:
        deadline = time.time() + 90
        while not self.admin.healthy():
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"synchronizer {self.name} did not start; see {self.dir}")
            time.sleep(0.1)
        gen = torch.Generator().manual_seed(0)
        initial = {
            t.name: torch.randn(t.shape, generator=gen) * 0.02
            for f in layout.fragments
            for t in f.tensors
        }
        self.admin.join(JoinRequest(learner_id="admin", layout_digest=layout.digest()))
        self.admin.init(codec.encode(initial, {LAYOUT_KEY: layout.model_dump_json()}))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.admin.close()
        self.log.close()


def get_timed(curl: pycurl.Curl, url: str) -> tuple[float, int, int]:
    """One plain HTTP/1.1 GET, as a Prometheus scrape is: (seconds, status, body bytes)."""
    body = bytearray()
    curl.setopt(pycurl.URL, url)
    curl.setopt(pycurl.WRITEFUNCTION, body.extend)
    t0 = time.perf_counter()
    curl.perform()
    return time.perf_counter() - t0, int(curl.getinfo(pycurl.RESPONSE_CODE)), len(body)


def scraper(url: str, every: float, end: float, out: list[tuple[float, int, int]]) -> None:
    curl = pycurl.Curl()
    curl.setopt(pycurl.TIMEOUT, 30)
    while time.time() < end:
        t_next = time.time() + every
        try:
            out.append(get_timed(curl, url))
        except pycurl.error as e:
            out.append((float("nan"), -1, 0))
            print(f"  scrape of {url} failed: {e}", flush=True)
        time.sleep(max(0.0, t_next - time.time()))
    curl.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16, help="learner clients per arm")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--scrape-every", type=float, default=1.0, help="seconds between scrapes")
    ap.add_argument("--quorum", type=int, default=4, help="K of every synchronizer")
    ap.add_argument("--params", type=int, default=120_000)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ddiloco-metrics-cost-"))
    layout = load.make_layout(args.params, args.fragments)
    arms = [Arm(name, work, args.quorum) for name in ARMS]
    ids = [f"load-{i}" for i in range(args.clients)]
    load0 = os.getloadavg()
    try:
        for arm in arms:
            arm.ready(layout)
        print(
            f"metrics_cost: arms {', '.join(ARMS)} side by side, {args.clients} clients each, "
            f"{args.seconds:.0f} s, scrape every {args.scrape_every:g} s, load average "
            f"{load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} on {os.cpu_count()} cores",
            flush=True,
        )
        ctx = mp.get_context("spawn")
        queues = {arm.name: ctx.Queue() for arm in arms}
        t0 = time.time()
        end = t0 + args.seconds
        procs = [
            ctx.Process(
                target=load.worker,
                args=(
                    ids,
                    arm.url,
                    str(arm.token_file),
                    dict.fromkeys(ids),
                    layout.model_dump_json(),
                    end,
                    queues[arm.name],
                ),
            )
            for arm in arms
        ]
        for p in procs:
            p.start()
        cpu0 = {arm.name: load.cpu_seconds(arm.proc.pid) for arm in arms}
        by_name = {arm.name: arm for arm in arms}
        scrapes: dict[str, list[tuple[float, int, int]]] = {"scraped": [], "off": []}
        threads = [
            threading.Thread(
                target=scraper,
                args=(f"{by_name[n].url}/metrics", args.scrape_every, end, scrapes[n]),
                daemon=True,
            )
            for n in scrapes
        ]
        for t in threads:
            t.start()
        results = {name: q.get(timeout=args.seconds + 240) for name, q in queues.items()}
        for p in procs:
            p.join(timeout=30)
        for t in threads:
            t.join(timeout=30)
        wall = time.time() - t0
        cpu = {arm.name: load.cpu_seconds(arm.proc.pid) - cpu0[arm.name] for arm in arms}
        status = {arm.name: arm.admin.status() for arm in arms}
    finally:
        for arm in arms:
            arm.stop()
    load1 = os.getloadavg()

    figures: dict[str, Any] = {
        "clients": args.clients,
        "seconds": round(wall, 1),
        "scrape_every_s": args.scrape_every,
        "load_average_start": [round(x, 2) for x in load0],
        "load_average_end": [round(x, 2) for x in load1],
        "arms": {},
    }
    print(
        f"\n{'arm':8} {'accepted':>9} {'errors':>7} {'GB in':>7} {'merges':>7} {'CPU s':>7} "
        f"{'ms CPU/update':>14} {'CPU s/GB':>9}"
    )
    for name in ARMS:
        r, st = results[name], status[name]
        accepted = r["statuses"].get("accepted", 0)
        errors = sum(r["errors"].values())
        gb = st.bytes_up / 1e9
        per_update = 1e3 * cpu[name] / max(1, accepted)
        per_gb = cpu[name] / gb if gb else float("nan")
        figures["arms"][name] = {
            "accepted": accepted,
            "errors": errors,
            "gb_in": round(gb, 4),
            "merges": st.merges,
            "cpu_s": round(cpu[name], 2),
            "ms_cpu_per_update": round(per_update, 3),
            "cpu_s_per_gb": round(per_gb, 2),
        }
        print(
            f"{name:8} {accepted:9d} {errors:7d} {gb:7.3f} {st.merges:7d} {cpu[name]:7.2f} "
            f"{per_update:14.3f} {per_gb:9.2f}"
        )
    base = figures["arms"]["off"]["ms_cpu_per_update"]
    for name in ("on", "scraped"):
        ratio = figures["arms"][name]["ms_cpu_per_update"] / base if base else float("nan")
        figures["arms"][name]["cpu_per_update_vs_off"] = round(ratio, 3)
        print(f"CPU per accepted update, {name} / off: {ratio:.3f}x")
    for name, rows in scrapes.items():
        ok = [dt for dt, code, _ in rows if code in (200, 404)]
        codes = sorted({code for _, code, _ in rows})
        size = max((n for _, _, n in rows), default=0)
        fig = {
            "n": len(rows),
            "status": codes,
            "p50_ms": round(1e3 * load.pct(ok, 0.5), 2),
            "p99_ms": round(1e3 * load.pct(ok, 0.99), 2),
            "max_ms": round(1e3 * max(ok, default=float("nan")), 2),
            "bytes": size,
        }
        figures[f"scrape_{name}"] = fig
        print(
            f"GET /metrics on {name}: n={fig['n']} status {codes} p50 {fig['p50_ms']} ms "
            f"p99 {fig['p99_ms']} ms max {fig['max_ms']} ms, {size} bytes"
        )
    print(f"load average at the end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    failed = any(a["errors"] for a in figures["arms"].values()) or figures["scrape_scraped"][
        "status"
    ] != [200]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
