"""Load run: 64 learner clients against one real `ddiloco synchronizer` process, over TLS.

    .venv/bin/python bench/load.py --seconds 60              # validation run
    .venv/bin/python bench/load.py                           # 64 clients, 600 s, TLS (h2 by ALPN)
    .venv/bin/python bench/load.py --h2c --seconds 60        # cleartext HTTP/2, as without TLS
    .venv/bin/python bench/load.py --mtls                    # mutual TLS, a client cert per client

A bench, not a test: it loads the machine for its whole duration. It starts the synchronizer
as its own process (HTTPS with a CA issued here by wire/tls.py, the token in a file),
initializes a job (a tiny-GPT-sized model, 120k parameters in P = 4 fragments), then runs the
clients in a few worker processes (threads of SyncClient/pycurl, so the load generator's own
Python does not serialize them on one GIL). Each client does what a learner's two network
threads do, on their two connections: join, a heartbeat every 0.5 s over HTTP/2 (a learner
long-polls with wait_s = 0.5; here wait_s = 0 and a 0.5 s pause, the same rate, so that the
latency measured is the synchronizer's answer and not the poll's wait), a download of every
fragment whose version moved, and a bf16 update of the next fragment every ~3 s (H/P = 6 steps
of 0.5 s) over HTTP/1.1 (the learner's default for uploads). It prints, and with `--json`
writes: requests and errors by kind (any exception is an error: transport, 4xx, 5xx), latency
p50/p99/max of heartbeats, updates and downloads, merges, and the synchronizer's RSS over time
(start after init, peak, end) and CPU. The exit status is 1 if any request failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ddiloco.learner.sync_client import ClientTLS, SyncClient
from ddiloco.local.processes import ddiloco_command, free_port
from ddiloco.wire import codec, tls
from ddiloco.wire.auth import TokenFile
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    Heartbeat,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

WIDTH = 64
STEP_S = 0.5
"""The pretend inner-step time: H/P = 6 steps between two updates of a client."""
TOKENS_PER_STEP = 8 * 64


def make_layout(params: int, fragments: int) -> Layout:
    rows = max(1, params // (fragments * WIDTH))
    return Layout(
        fragments=[
            FragmentSpec(
                index=p,
                embedding=p == 0,
                tensors=[
                    TensorSpec(name=f"f{p}.w", shape=[rows, WIDTH]),
                    TensorSpec(name=f"f{p}.b", shape=[WIDTH]),
                ],
            )
            for p in range(fragments)
        ]
    )


# ---- the clients (worker processes) ------------------------------------------------------


class Stats:
    def __init__(self) -> None:
        self.lat: dict[str, list[float]] = {
            "heartbeat": [],
            "update": [],
            "download": [],
            "join": [],
        }
        self.errors: dict[str, int] = {}
        self.samples: list[str] = []
        self.statuses: dict[str, int] = {}
        self.http: dict[str, int] = {}
        self.lock = threading.Lock()

    def error(self, what: str, e: BaseException) -> None:
        with self.lock:
            key = f"{what}: {type(e).__name__}"
            self.errors[key] = self.errors.get(key, 0) + 1
            if len(self.samples) < 10:
                self.samples.append(f"{what}: {e}")

    def timed(self, what: str, client: SyncClient, fn: Any) -> Any:
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as e:
            self.error(what, e)
            return None
        dt = time.perf_counter() - t0
        with self.lock:
            self.lat[what].append(dt)
            self.http[client.http_version] = self.http.get(client.http_version, 0) + 1
        return out


def client_loop(
    lid: str,
    url: str,
    token_file: str,
    files: ClientTLS | None,
    layout: Layout,
    deadline: float,
    stats: Stats,
    seed: int,
) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = TokenFile(token_file)
    control = SyncClient(url, tokens, timeout=30, tls=files)
    upload = SyncClient(url, tokens, timeout=30, tls=files, http2=False)
    n = len(layout.fragments)
    # a few deltas per fragment, reused: their bytes do not matter, their size and norm do
    deltas = [
        [
            {
                t.name: (torch.randn(t.shape, generator=gen) * 1e-3).to(torch.bfloat16)
                for t in f.tensors
            }
            for _ in range(3)
        ]
        for f in layout.fragments
    ]
    time.sleep(rng.uniform(0, 2.0))  # stagger the joins
    join = stats.timed(
        "join",
        control,
        lambda: control.join(
            JoinRequest(learner_id=lid, layout_digest=layout.digest(), pid=os.getpid())
        ),
    )
    if join is None:
        return
    have = list(join.versions)
    step, t_start = 0, time.time()
    c_steps, c_tokens = [0] * n, [0] * n
    next_update = time.time() + rng.uniform(0.5, 3.0)
    p_next = rng.randrange(n)
    while time.time() < deadline:
        step += 1
        for p in range(n):
            c_steps[p] += 1
            c_tokens[p] += TOKENS_PER_STEP
        hb = Heartbeat(
            learner_id=lid,
            step=step,
            steps=c_steps,
            tokens=c_tokens,
            base_versions=have,
            step_seconds=STEP_S,
            compute_seconds=step * STEP_S,
            uptime_seconds=time.time() - t_start,
            tokens_total=step * TOKENS_PER_STEP,
            loss=3.0,
            known_versions=have,
            wait_s=0.0,
        )
        resp = stats.timed("heartbeat", control, lambda hb=hb: control.heartbeat(hb))
        if resp is not None:
            for p, v in enumerate(resp.versions):
                if v > have[p]:
                    got = stats.timed("download", control, lambda p=p: control.fragment(p))
                    if got is not None:
                        have[p] = got[0]
        if time.time() >= next_update:
            p = p_next
            meta = UpdateMeta(
                learner_id=lid,
                fragment=p,
                base_version=have[p],
                steps=c_steps[p],
                tokens=c_tokens[p],
                learner_step=step,
                incarnation=join.incarnation,
                encoding="bfloat16",
            )
            r = stats.timed(
                "update",
                upload,
                lambda meta=meta, d=deltas[p][step % 3]: upload.upload(meta, d),
            )
            if r is not None:
                with stats.lock:
                    stats.statuses[r.status] = stats.statuses.get(r.status, 0) + 1
                c_steps[p], c_tokens[p] = 0, 0
            p_next = (p + 1) % n
            next_update = time.time() + rng.uniform(0.8, 1.2) * (6 * STEP_S)
        time.sleep(STEP_S)
    control.close()
    upload.close()


def worker(
    ids: list[str],
    url: str,
    token_file: str,
    files: dict[str, ClientTLS | None],
    layout_json: str,
    deadline: float,
    out: Any,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    layout = Layout.model_validate_json(layout_json)
    stats = Stats()
    threads = [
        threading.Thread(
            target=client_loop,
            args=(
                lid,
                url,
                token_file,
                files[lid],
                layout,
                deadline,
                stats,
                int(lid.rsplit("-", 1)[1]),
            ),
            daemon=True,
        )
        for lid in ids
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, deadline - time.time() + 60))
    alive = sum(t.is_alive() for t in threads)
    if alive:
        stats.errors["client thread still running at the end"] = alive
    out.put(
        {
            "lat": stats.lat,
            "errors": stats.errors,
            "samples": stats.samples,
            "statuses": stats.statuses,
            "http": stats.http,
        }
    )


# ---- the synchronizer and the run --------------------------------------------------------


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--procs", type=int, default=4, help="worker processes the clients run in")
    ap.add_argument("--h2c", action="store_true", help="cleartext HTTP/2 instead of TLS")
    ap.add_argument("--mtls", action="store_true", help="mutual TLS: a client cert per client")
    ap.add_argument("--quorum", type=int, default=16, help="K of the synchronizer (default 16)")
    ap.add_argument("--params", type=int, default=120_000)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    if args.h2c and args.mtls:
        ap.error("--mtls needs TLS")

    work = Path(tempfile.mkdtemp(prefix="ddiloco-load-"))
    token_file = work / "token"
    tls.write_pem(os.urandom(18).hex().encode() + b"\n", token_file, private=True)
    ids = [f"load-{i}" for i in range(args.clients)]
    files: dict[str, ClientTLS | None] = dict.fromkeys([*ids, "admin"])
    port = free_port()
    flags: list[str] = []
    if not args.h2c:
        ca = tls.issue_ca("load CA", days=2)
        tls.write_pem(ca.cert_pem, work / "ca.crt")
        tls.write_pair(
            tls.issue_server(ca, ["localhost"], ["127.0.0.1"]),
            work / "server.crt",
            work / "server.key",
        )
        flags = ["--tls-cert", str(work / "server.crt"), "--tls-key", str(work / "server.key")]
        for name in files:
            if args.mtls:
                tls.write_pair(
                    tls.issue_client(ca, name), work / f"{name}.crt", work / f"{name}.key"
                )
                files[name] = ClientTLS(work / "ca.crt", work / f"{name}.crt", work / f"{name}.key")
            else:
                files[name] = ClientTLS(work / "ca.crt")
        if args.mtls:
            flags += ["--tls-client-ca", str(work / "ca.crt")]
    url = f"{'http' if args.h2c else 'https'}://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_")}
    env |= {"DDILOCO_TOKEN_FILE": str(token_file), "DDILOCO_QUORUM": str(args.quorum)}
    argv = ddiloco_command(
        "synchronizer",
        "--port",
        str(port),
        "--state-dir",
        str(work / "state"),
        "--log-level",
        "WARNING",
        *flags,
    )
    log = open(work / "sync.log", "ab")  # noqa: SIM115 - closed at the end
    sync = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    admin = SyncClient(url, TokenFile(token_file), timeout=30, tls=files["admin"])
    try:
        deadline = time.time() + 60
        while not admin.healthy():
            if sync.poll() is not None or time.time() > deadline:
                raise SystemExit(f"synchronizer did not start; see {work / 'sync.log'}")
            time.sleep(0.1)
        layout = make_layout(args.params, args.fragments)
        gen = torch.Generator().manual_seed(0)
        initial = {
            t.name: torch.randn(t.shape, generator=gen) * 0.02
            for f in layout.fragments
            for t in f.tensors
        }
        admin.join(JoinRequest(learner_id="admin", layout_digest=layout.digest()))
        admin.init(codec.encode(initial, {LAYOUT_KEY: layout.model_dump_json()}))
        update_kib = sum(f.numel() for f in layout.fragments) / len(layout.fragments) * 2 / 1024
        mode = "h2c" if args.h2c else "mutual TLS" if args.mtls else "TLS"
        print(
            f"load: {args.clients} clients in {args.procs} processes, {args.seconds:.0f} s, {mode}, "
            f"K={args.quorum}, {args.params} params in {args.fragments} fragments "
            f"(~{update_kib:.0f} KiB bf16 per update), synchronizer pid {sync.pid}",
            flush=True,
        )
        rss: list[tuple[float, int]] = []
        t0 = time.time()
        cpu0 = cpu_seconds(sync.pid)
        rss.append((0.0, rss_kib(sync.pid)))
        load0 = os.getloadavg()[0]
        end = t0 + args.seconds
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [
            ctx.Process(
                target=worker,
                args=(
                    ids[i :: args.procs],
                    url,
                    str(token_file),
                    files,
                    layout.model_dump_json(),
                    end,
                    q,
                ),
            )
            for i in range(args.procs)
        ]
        for p in procs:
            p.start()
        next_print = t0 + 60
        while time.time() < end:
            time.sleep(1.0)
            if sync.poll() is not None:
                print("synchronizer exited during the run", flush=True)
                break
            rss.append((time.time() - t0, rss_kib(sync.pid)))
            if time.time() >= next_print:
                next_print += 60
                st = admin.status()
                print(
                    f"  t={time.time() - t0:5.0f}s rss={rss[-1][1] / 1024:6.1f} MiB "
                    f"merges={st.merges} contributions={st.contributions_merged} "
                    f"refused={st.contributions_rejected} live={sum(x.alive for x in st.learners)}",
                    flush=True,
                )
        results = [q.get(timeout=180) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        wall = time.time() - t0
        cpu = cpu_seconds(sync.pid) - cpu0 if sync.poll() is None else float("nan")
        rss.append((wall, rss_kib(sync.pid) if sync.poll() is None else 0))
        status = admin.status()
        load1 = os.getloadavg()[0]
    finally:
        if sync.poll() is None:
            sync.send_signal(signal.SIGTERM)
            try:
                sync.wait(timeout=15)
            except subprocess.TimeoutExpired:
                sync.kill()
        log.close()

    lat: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    statuses: dict[str, int] = {}
    http: dict[str, int] = {}
    samples: list[str] = []
    for r in results:
        for k, v in r["lat"].items():
            lat.setdefault(k, []).extend(v)
        for d, src in ((errors, r["errors"]), (statuses, r["statuses"]), (http, r["http"])):
            for k, v in src.items():
                d[k] = d.get(k, 0) + v
        samples += r["samples"]
    n_err = sum(errors.values())
    n_req = sum(len(v) for v in lat.values()) + n_err
    figures: dict[str, Any] = {
        "mode": mode,
        "clients": args.clients,
        "seconds": round(wall, 1),
        "quorum": args.quorum,
        "requests": n_req,
        "errors": n_err,
        "errors_by_kind": errors,
        "update_statuses": statuses,
        "http_versions": http,
        "latency_ms": {
            k: {
                "n": len(v),
                "p50": round(pct(v, 0.5) * 1e3, 2),
                "p99": round(pct(v, 0.99) * 1e3, 2),
                "max": round(max(v) * 1e3, 2) if v else None,
                "mean": round(statistics.fmean(v) * 1e3, 2) if v else None,
            }
            for k, v in lat.items()
        },
        "merges": status.merges,
        "contributions_merged": status.contributions_merged,
        "refusals": status.refusals,
        "sync_rss_mib": {
            "start": round(rss[0][1] / 1024, 1),
            "peak": round(max(x for _, x in rss) / 1024, 1),
            "end": round(rss[-1][1] / 1024, 1),
            "every_60s": [round(x / 1024, 1) for t, x in rss if int(t) % 60 == 0 or t == wall][:40],
        },
        "sync_cpu_cores": round(cpu / wall, 2),
        "load_average": [round(load0, 1), round(load1, 1)],
        "requests_per_s": round(n_req / wall, 1),
    }
    print(
        f"{mode}: {args.clients} clients, {wall:.0f} s, {n_req} requests ({n_req / wall:.0f}/s), "
        f"{n_err} errors"
    )
    for k, v in figures["latency_ms"].items():
        print(
            f"  {k:<9} n={v['n']:<7} p50={v['p50']:7.2f} ms  p99={v['p99']:7.2f} ms  max={v['max']} ms"
        )
    r = figures["sync_rss_mib"]
    print(
        f"  synchronizer RSS: start {r['start']} MiB, peak {r['peak']} MiB, end {r['end']} MiB; "
        f"CPU {figures['sync_cpu_cores']} cores; load average {load0:.1f} -> {load1:.1f}"
    )
    print(
        f"  merges {status.merges}, contributions merged {status.contributions_merged}, "
        f"update answers {statuses}, protocols {http}, refusals {status.refusals}"
    )
    if n_err:
        print(f"  ERRORS {errors}: {samples}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 1 if n_err else 0


if __name__ == "__main__":
    sys.exit(main())
