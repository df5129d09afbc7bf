"""Where one synchronizer shard's resident memory goes, owner by owner, under the round trip.

    .venv/bin/python bench/sync_memory.py                  # 64M params, P = 4, M = 16, 60 s
    .venv/bin/python bench/sync_memory.py --seconds 30 --broadcast-encoding bfloat16
    .venv/bin/python bench/sync_memory.py --params 4e6 --learners 4 --seconds 10 --json out.json

Runs what `bench/sync_ingest.py --arms rt-up` runs (its clients: M learner threads posting real
bf16 updates of P fragments to the upload port, each also long-polling heartbeats and
downloading every new version of every fragment; a fresh state directory on disk; K = 4;
every update encoding accepted), with one difference: the synchronizer is `ddiloco
synchronizer` (server.py's `main`, the same settings and flags) started inside a child
process of this script (`--serve`), beside a sampler thread that can see its objects.

Every `--interval` seconds the sampler reads the process's resident memory from
/proc/self/status (RssAnon: private anonymous pages, the heap and torch's tensors; RssShmem:
shared anonymous pages, which Python's `mmap.mmap(-1, n)` makes: the upload bodies and
direct-I/O staging buffers; RssFile: mapped files, which is the libraries' code: the state's
files are written with O_DIRECT or through the page cache and never mapped, so the page
cache they fill is the kernel's, not in this process's resident set) and, at the same
instant, sums the bytes of each owner by walking the synchronizer's objects (module
docstring of synchronizer/__init__.py: which object owns which state):

- Theta + momentum: each owned fragment's installed `FragmentState` (float32);
- superseded state: a state replaced while the background writer was writing its file
  (`Fragment.retired`, `.writing`), kept until that write ends;
- round sums: each open round's running sum (`RoundSum.sum`, float32, stream.py) and its
  queued dequantized terms;
- absorbed contributions: a learner's second update in one round is summed into float32 of
  its own (`Contribution.owned`, contribution.py);
- merges in flight: float32 of the pool (`buffers.POOL`) handed out and held by none of the
  above, i.e. a merge's new Theta, momentum and claimed direction between take and install
  (sizes from a wrapper of `POOL.take` installed in the child: the pool keeps only addresses);
- float32 pool, idle: `POOL.idle_bytes` (primed at init, PER_MERGE tensors per tensor per
  fragment, and every tensor given back, up to the pool's cap);
- bodies held by rounds: upload bodies (`buffers.BODIES`, mmap capacities) pinned because a
  contribution or a queued term still views them (bf16 and quantized updates are kept as
  sent until their merge);
- bodies in flight: bodies handed out and not pinned: being received, admitted or logged;
- bodies idle: `BODIES.idle_bytes` (primed at init, two per fragment per accepted encoding,
  and every body given back, up to the pool's cap);
- served payload: each fragment's version served now (`Fragment.served`: its payload buffers
  in the broadcast encoding, and for a delta encoding S_v in float32);
- served spares: retired payload buffers kept per fragment for the next merge's encode
  (`Served.spares`, served_buffers.py: KEEP per kind), one possibly still being sent;
- direct-I/O stages: idle 32 MB staging buffers of the file writer (storage/direct_io.py).

Accounted bytes are object sizes (tensors' nbytes, buffers' lengths), not pages; a body's
mmap is counted at its capacity (its size rounded up to the pool's 1 MiB grain, its tail
pages never touched unless primed). The rest of RssAnon + RssShmem is the residual: the
interpreter, torch and the libraries' heaps (the "before init" row: measured before the
layout exists), sockets' buffers, and payloads no longer served that a download still sends.

Printed: the run's peak (the sample with the most RssAnon + RssShmem once the clients run)
broken down by owner, in bytes and bytes per parameter, beside each owner's own maximum over
the run and the counts behind it (bodies, contributions, merges at once); the peaks of the
run's first and second half (is the peak stable?), of the init and of VmHWM (the kernel's
high-water mark, init included). Shut down by touching a file the sampler watches; the
child writes its samples as JSON (`--serve` mode, never run by hand).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sync_ingest  # bench/sync_ingest.py: the layout, the payloads, the learner clients

OWNERS = (
    ("theta_momentum", "Theta + momentum (installed state, float32)"),
    ("superseded_state", "superseded state awaiting its file write"),
    ("round_sums", "open rounds' running sums (float32)"),
    ("absorbed", "absorbed contributions (float32)"),
    ("merging", "merges in flight (POOL tensors held by a merge)"),
    ("pool_idle", "float32 pool, idle"),
    ("bodies_round", "upload bodies held by rounds (pinned)"),
    ("bodies_flight", "upload bodies in flight"),
    ("bodies_idle", "upload bodies, idle in the pool"),
    ("served", "served payload (current version)"),
    ("served_spares", "served payload spares (retired buffers)"),
    ("stages", "direct-I/O staging buffers, idle"),
)
"""Each owner's key and its line in the table, in the table's order."""

PHASES = ("start", "init", "run")
"""The sampler's phases: the app up and idle, before the parent posts the init (it touches
`init`); the init and priming until the clients start (it touches `running`); the clients'
run (until it touches `stop`)."""


# ---- the child: the synchronizer and its sampler ------------------------------------------
def proc_status() -> dict[str, int]:
    """This process's RssAnon, RssFile, RssShmem, VmRSS and VmHWM, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem", "VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def account(sync: Any, pool_sizes: dict[int, int]) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes per owner (`OWNERS`) and the counts behind them, from the synchronizer's objects
    (a `Synchronizer`, service.py). Reads without its locks: each container is copied in one
    step (atomic under the GIL); a buffer is counted once, for the first owner that holds it."""
    from ddiloco.synchronizer.buffers import BODIES, POOL
    from ddiloco.synchronizer.storage import direct_io

    owners = dict.fromkeys((k for k, _ in OWNERS), 0)
    counts: dict[str, int] = {}
    seen: set[int] = set()  # tensors' data_ptr, buffers' id

    def tensors(key: str, ts: Any) -> int:
        n = 0
        for t in list(ts):
            ptr = getattr(t, "data_ptr", None)
            if ptr is None or not t.numel() or ptr() in seen:
                continue
            seen.add(ptr())
            owners[key] += t.nbytes
            n += 1
        return n

    def buffer(key: str, view: Any) -> None:
        obj = view.obj if isinstance(view, memoryview) else view
        if obj is None or id(obj) in seen:
            return
        seen.add(id(obj))
        owners[key] += len(obj)

    frags = list(sync.fragments)
    owned = [frags[p] for p in sync.owned if p < len(frags)]
    for f in owned:
        fs = f.state
        tensors("theta_momentum", [*fs.params.values(), *fs.momentum.values()])
    for f in owned:
        for old in (f.retired, f.writing):
            if old is not None:
                tensors("superseded_state", [*old.params.values(), *old.momentum.values()])
    contributions = absorbed = merges = 0
    for f in owned:
        rs = f.sum
        tensors("round_sums", list(rs.sum.values()))
        for ts, _, _, own in list(rs.queue):
            if own:
                tensors("round_sums", list(ts.values()))
        merging = list(f.merging.values())
        merges += bool(merging)
        for c in [*list(f.round.contributions.values()), *merging]:
            contributions += 1
            if c.owned:
                absorbed += 1
                tensors("absorbed", list(c.delta.values()))
    for f in owned:
        served = f.served
        for view in (served.whole, served.delta):
            if view is not None:
                buffer("served", view)
        if served.held:  # S_v: views of the whole payload's buffer, counted just above
            whole = served.whole.obj if served.whole is not None else None
            own = [t for t in served.held.values() if not _views(t, whole)]
            tensors("served", own)
    spares = sync.payloads.spares
    for p in sync.owned:
        for buf in list(spares[p]) if p < len(spares) else []:
            buffer("served_spares", buf)
    counts["served_spares"] = sum(len(s) for s in spares)
    # the pools: what they hand out is held by the owners above, or else by a merge
    ours = list(POOL.ours)
    held = [ptr for ptr in ours if ptr not in seen]
    owners["merging"] = sum(pool_sizes.get(ptr, 0) for ptr in held)
    owners["pool_idle"] = POOL.idle_bytes
    counts["pool_idle"] = sum(len(v) for v in list(POOL.idle.values()))
    pins = dict(BODIES.pins)
    pinned = flight = 0
    for buf in list(BODIES.ours.values()):
        if pins.get(id(buf)):
            owners["bodies_round"] += len(buf)
            pinned += 1
        else:
            owners["bodies_flight"] += len(buf)
            flight += 1
    owners["bodies_idle"] = BODIES.idle_bytes
    counts |= {
        "bodies_round": pinned,
        "bodies_flight": flight,
        "bodies_idle": sum(len(v) for v in list(BODIES.idle.values())),
        "contributions": contributions,
        "absorbed": absorbed,
        "merging": merges,
        "merging_tensors": len(held),
    }
    stages = list(direct_io._stages)
    owners["stages"] = sum(len(s) for s in stages)
    counts["stages"] = len(stages)
    return owners, counts


class Sampler(threading.Thread):
    """Samples /proc/self/status and `account` every `interval` s; keeps, per phase, the
    sample with the most RssAnon + RssShmem and each owner's largest figure."""

    def __init__(
        self, sync: Callable[[], Any], pool_sizes: dict[int, int], root: Path, interval: float
    ) -> None:
        super().__init__(daemon=True, name="memory-sampler")
        self.sync, self.pool_sizes, self.root, self.interval = sync, pool_sizes, root, interval
        self.peaks: dict[str, dict[str, Any]] = {}
        self.owner_max: dict[str, int] = {}
        self.count_max: dict[str, int] = {}
        self.series: list[tuple[float, str, int, int]] = []
        """(seconds from the start, phase, RssAnon + RssShmem, accounted)."""
        self.t0 = time.monotonic()
        self.done = threading.Event()

    def phase(self) -> str:
        if (self.root / "running").exists():
            return "run"
        return "init" if (self.root / "init").exists() else "start"

    def sample(self) -> None:
        sync = self.sync()
        phase = self.phase()
        owners: dict[str, int] = {}
        counts: dict[str, int] = {}
        if sync is not None and sync.layout is not None and sync.fragments:
            for _ in range(5):  # a container resized between its copy and its walk: again
                try:
                    owners, counts = account(sync, self.pool_sizes)
                    break
                except (RuntimeError, IndexError, AttributeError):
                    continue
        st = proc_status()
        resident = st["RssAnon"] + st["RssShmem"]
        accounted = sum(owners.values())
        self.series.append((time.monotonic() - self.t0, phase, resident, accounted))
        best = self.peaks.get(phase)
        if best is None or resident > best["resident"]:
            self.peaks[phase] = {
                "t": time.monotonic() - self.t0,
                "resident": resident,
                "status": st,
                "owners": owners,
                "counts": counts,
            }
        if phase == "run":
            for k, v in owners.items():
                self.owner_max[k] = max(self.owner_max.get(k, 0), v)
            for k, v in counts.items():
                self.count_max[k] = max(self.count_max.get(k, 0), v)

    def run(self) -> None:
        stop = self.root / "stop"
        while not stop.exists():
            try:
                self.sample()
            except Exception as e:  # a sample that failed: said in the report, not fatal
                self.series.append((time.monotonic() - self.t0, f"error {e!r}", 0, 0))
            time.sleep(self.interval)
        self.report()
        self.done.set()

    def report(self) -> None:
        out = {
            "peaks": self.peaks,
            "owner_max": self.owner_max,
            "count_max": self.count_max,
            "series": self.series,
            "final": proc_status(),
            "smaps_rollup": Path("/proc/self/smaps_rollup").read_text(),
        }
        tmp = self.root / "report.json.tmp"
        tmp.write_text(json.dumps(out))
        tmp.replace(self.root / "report.json")


def serve(root: Path, interval: float, argv: list[str]) -> int:
    """The child: `ddiloco synchronizer argv` in this process, sampled (module docstring)."""
    from ddiloco.synchronizer import app as app_module
    from ddiloco.synchronizer import server
    from ddiloco.synchronizer.buffers import POOL

    apps: list[Any] = []
    make = app_module.create_app

    def capture(settings: Any) -> Any:  # server.main imports create_app when it runs
        apps.append(make(settings))
        return apps[-1]

    app_module.create_app = capture  # type: ignore[assignment]
    sizes: dict[int, int] = {}
    take = POOL.take

    def sized_take(shape: Any) -> Any:  # the pool keeps addresses only: their sizes here
        t = take(shape)
        sizes[t.data_ptr()] = t.nbytes
        return t

    POOL.take = sized_take  # type: ignore[method-assign]
    sampler = Sampler(
        lambda: getattr(apps[0].state, "sync", None) if apps else None, sizes, root, interval
    )
    sampler.start()
    return server.main(argv)


# ---- the parent: the clients, then the table ------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the sampled synchronizer, drive it as sync_ingest's round-trip arm does for
    `args.seconds`, and return the child's report."""

    from ddiloco.learner.sync_client import SyncClient
    from ddiloco.local.processes import free_port
    from ddiloco.wire import encodings

    lay = sync_ingest.layout(int(args.params), args.fragments)
    base = "/dev/shm" if args.state_on == "tmpfs" else None
    root = Path(tempfile.mkdtemp(prefix="sync-memory-", dir=base))
    port = free_port()
    env = {
        **os.environ,
        "DDILOCO_TOKEN": sync_ingest.TOKEN,
        "DDILOCO_QUORUM": str(args.quorum),
        "DDILOCO_UPDATE_ENCODINGS": ",".join(encodings.ALL),
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", str(root),
           "--interval", str(args.interval), "--", "--port", str(port),
           "--upload-port", str(free_port()), "--state-dir", str(root / "state")]  # fmt: skip
    if args.broadcast_encoding:
        cmd += ["--broadcast-encoding", args.broadcast_encoding]
    log = open(root / "sync.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        boss = SyncClient(url, sync_ingest.TOKEN, http2=False, timeout=600)
        deadline = time.monotonic() + 120
        while not boss.healthy():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"synchronizer did not start: {(root / 'sync.log').read_text()}")
            time.sleep(0.2)
        body = sync_ingest.init_payload(lay)
        sync_ingest.join(boss, "init")
        time.sleep(1.0)  # the sampler's "start" phase: the app up and idle
        (root / "init").touch()
        boss.init(body)
        del body
        boss.close()
        payloads = [
            sync_ingest.Payload(f.tensors[0].name, f.tensors[0].shape, 10 + f.index, args.encoding)
            for f in lay.fragments
        ]
        owner = [0] * len(lay.fragments)
        stop = threading.Event()
        tallies = [sync_ingest.Tally() for _ in range(args.learners)]
        round_trip = args.transport == "rt-up"
        shared = [sync_ingest.Learner() if round_trip else None for _ in tallies]
        threads = [
            threading.Thread(
                target=sync_ingest.client_loop,
                args=([url], owner, f"l-{i}", args.transport, payloads, stop, tallies[i]),
                kwargs={"shared": shared[i]},
                daemon=True,
            )
            for i in range(args.learners)
        ]
        threads += [
            threading.Thread(
                target=sync_ingest.download_loop,
                args=([url], owner, f"l-{i}", args.transport, len(lay.fragments), x, stop),
                kwargs={"t": tallies[i]},
                daemon=True,
            )
            for i, x in enumerate(shared)
            if x is not None
        ]
        (root / "running").touch()
        for th in threads:
            th.start()
        time.sleep(args.seconds)
        stop.set()
        for th in threads:
            th.join(timeout=120)
        (root / "stop").touch()
        deadline = time.monotonic() + 60
        while not (root / "report.json").exists():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"no report: {(root / 'sync.log').read_text()[-4000:]}")
            time.sleep(0.1)
        report = json.loads((root / "report.json").read_text())
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(root, ignore_errors=True)
    report["params"] = sum(f.numel() for f in lay.fragments)
    report["accepted"] = sum(t.accepted for t in tallies)
    report["downloads"] = sum(t.downloads for t in tallies)
    report["errors"] = sum(t.errors + t.down_errors for t in tallies)
    report["args"] = vars(args)
    return report


def halves(series: list[list[Any]]) -> tuple[int, int]:
    """The run phase's peak resident bytes (RssAnon + RssShmem) in its first and second half."""
    pts = [(t, r) for t, phase, r, _ in series if phase == "run"]
    if not pts:
        return 0, 0
    mid = (pts[0][0] + pts[-1][0]) / 2
    return (
        max((r for t, r in pts if t <= mid), default=0),
        max((r for t, r in pts if t > mid), default=0),
    )


def table(report: dict[str, Any]) -> str:
    """The run's peak by owner (module docstring), and the figures around it."""
    n = report["params"]
    peak = report["peaks"].get("run")
    if peak is None:
        return "no sample of the run"
    own, cnt = peak["owners"], peak["counts"]
    mx, cmx = report["owner_max"], report["count_max"]
    st = peak["status"]
    gb = 1e9

    def row(label: str, b: float, m: float | None = None, note: str = "") -> str:
        most = "" if m is None else f"{m / gb:8.3f}"
        return f"{label:<52} {b / gb:8.3f} {b / n:8.1f} {most:>8}  {note}"

    notes = {
        "bodies_round": f"{cnt.get('bodies_round', 0)} at the peak, most {cmx.get('bodies_round', 0)}",
        "bodies_flight": f"{cnt.get('bodies_flight', 0)} at the peak, most {cmx.get('bodies_flight', 0)}",
        "bodies_idle": f"{cnt.get('bodies_idle', 0)} idle at the peak",
        "absorbed": f"{cnt.get('absorbed', 0)} of {cnt.get('contributions', 0)} contributions;"
        f" most {cmx.get('absorbed', 0)} of {cmx.get('contributions', 0)}",
        "merging": f"{cnt.get('merging', 0)} merges, {cnt.get('merging_tensors', 0)} tensors;"
        f" most {cmx.get('merging', 0)} merges",
        "pool_idle": f"{cnt.get('pool_idle', 0)} tensors",
        "served_spares": f"{cnt.get('served_spares', 0)} buffers",
        "stages": f"{cnt.get('stages', 0)} stages",
    }
    lines = [
        f"{'owner (at the run peak)':<52} {'GB':>8} {'B/param':>8} {'max GB':>8}  counts",
    ]
    total = 0
    for key, label in OWNERS:
        total += own.get(key, 0)
        lines.append(row(label, own.get(key, 0), mx.get(key, 0), notes.get(key, "")))
    resident = st["RssAnon"] + st["RssShmem"]
    before = report["peaks"].get("start", {}).get("status", {})
    base = before.get("RssAnon", 0) + before.get("RssShmem", 0)
    lines += [
        row("accounted, sum of the owners", total),
        row("residual: RssAnon + RssShmem - accounted", resident - total),
        row("  of which before init (interpreter, torch, the app)", base),
        row("RssAnon (private anonymous)", st["RssAnon"]),
        row("RssShmem (shared anonymous: mmap bodies, stages)", st["RssShmem"]),
        row("RssFile (mapped files: the libraries)", st["RssFile"]),
        row("VmRSS at the run peak", st["VmRSS"]),
    ]
    first, second = halves(report["series"])
    init = report["peaks"].get("init", {}).get("resident", 0)
    samples = sum(1 for s in report["series"] if s[1] == "run")
    lines += [
        "",
        f"accounted / (RssAnon + RssShmem) at the run peak: {total / resident:.3f}",
        f"run peak (RssAnon + RssShmem), first half / second half: {first / gb:.3f} / "
        f"{second / gb:.3f} GB; init's peak {init / gb:.3f} GB; VmHWM at the end "
        f"{report['final']['VmHWM'] / gb:.3f} GB ({report['final']['VmHWM'] / n:.1f} B/param)",
        f"{n / 1e6:.1f}M params; {report['accepted']} updates accepted, "
        f"{report['downloads']} downloads, {report['errors']} client errors; {samples} samples "
        f"of the run, peak at {peak['t']:.1f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--params", type=float, default=64e6)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--learners", type=int, default=16)
    ap.add_argument("--quorum", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between samples")
    ap.add_argument("--encoding", default="bfloat16", help="the updates' encoding")
    ap.add_argument(
        "--transport",
        choices=["rt-up", "up"],
        default="rt-up",
        help="rt-up: every client also downloads every new version (sync_ingest.py's round"
        " trip); up: uploads only",
    )
    ap.add_argument(
        "--broadcast-encoding", default="", help="the synchronizer's (empty: its default)"
    )
    ap.add_argument("--state-on", choices=["disk", "tmpfs"], default="disk")
    ap.add_argument("--json", help="also write the report here")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.serve:
        return serve(Path(args.serve), args.interval, [a for a in rest if a != "--"])
    if rest:
        ap.error(f"unknown arguments {rest}")
    report = run(args)
    print(
        f"{report['params'] / 1e6:.1f}M params in {args.fragments} fragments, M = "
        f"{args.learners}, K = {args.quorum}, {args.encoding} updates, {args.transport}, "
        f"broadcast {args.broadcast_encoding or 'default'}, state on {args.state_on}, "
        f"{args.seconds:.0f} s, sampled every {args.interval} s"
    )
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def _views(t: object, buf: object) -> bool:
    """Whether tensor `t`'s memory lies inside bytearray `buf` (a view made by frombuffer)."""
    if not isinstance(buf, bytearray) or not hasattr(t, "data_ptr"):
        return False
    start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return start <= t.data_ptr() < start + len(buf)
