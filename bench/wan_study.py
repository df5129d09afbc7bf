"""The paper's wide-area comparison over a real shaped link: data-parallel against Decoupled
DiLoCo, M = 4 learners in two regions, at each rung of a bandwidth ladder, next to what
`ddiloco simulate wide-area` predicts for the same configuration.

    .venv/bin/python bench/wan_study.py                                # ~15 min, 2 cores, root
    .venv/bin/python bench/wan_study.py --rates 20mbit,2mbit --steps 60 --json /tmp/w.json

Regions: two network namespaces joined by local/wanlink.py's link (veth, tbf at the rung's
rate each way, a relay adding the round trip). Home holds the synchronizer, learner slots 0
and 1 (data-parallel: ranks 0 and 1, and the launcher's rendezvous store); remote holds
slots 2 and 3, which dial home's address across the link. Both arms run the same model,
data, seed, batch and step budget per slot (equal tokens):

- `dp`: local/dp_run.py, gradients (fp32) all-reduced by gloo's ring every step; the ring
  0-1-2-3 crosses the link once each way, so each direction carries 2(R-1)/R of the
  gradient per step (R = 4 ranks) and waits 2(R-1) one-way delays;
- `decoupled`: `ddiloco local` (K = 1, grace, RDA), H = 24, P = 4, tau = 2, updates and
  merged fragments in bf16, the remote learners' HTTP/2 and upload connections across the
  link.

For every run it reads the eval-loss curve of the global model; the target loss is the
worst final loss of all runs (every run reaches it), and wall time to target is when the
curve crosses it (linear between evaluations), from the first inner step. Bytes over the
link are the veth counters, both directions, during the run, per trained token. The
speed-up is given twice: to the target (what the paper reports; it also carries the
difference in loss per token between the methods, which the simulator does not model) and
in steps per second per slot at equal tokens (what the simulator predicts).
`--table-from DIR` prints the table again from a run's directory.

The compute-to-transfer ratio of a rung is one data-parallel compute step against the time
its all-reduce needs on the link (bytes per direction / rate); the paper's 12B model in bf16
over a ring of four sites at 2-5 Gbps (`ddiloco simulate wide-area`, 5 s steps) sits at
1 : 11.5 to 1 : 29. The simulator is run as a subprocess with the measured compute step times
(Decoupled: the learners' mean step; data-parallel: per step the slowest rank's, which a
lock-step ring waits for, as dp.py all-reduces after backward, not overlapped), the model's
parameter count, the rung's rate and half its RTT as latency, two sites of two ranks, and
fp32 gradients / bf16 fragments:

    ddiloco simulate wide-area --params N --link-gbps r,r --latency-ms RTT/2 --step-s dt \
        --ranks-per-site 2 --ring-step-latencies 2 --grad-bits 32 --up-bits 16 \
        --down-bits 16 -P 4 -H 24 --tau 2 --dp-compute-s dt_dp --no-dp-overlap --json

with r the rung's rate times 1448/1514 (TCP payload of full frames; tc counts frames) and
2 one-way latencies per ring step: gloo hands each message over after the receiver's ready
notice, a round trip per step, which `--probe` measures on the link:

    .venv/bin/python bench/wan_study.py --probe     # gloo all-reduce, 4 ranks, RTT 0/40/80 ms

Needs root and `ip netns` (local/wanlink.py `available()`). Figures: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HOME_SLOTS, REMOTE_SLOTS = (0, 1), (2, 3)
ARMS = ("dp", "decoupled")
PAYLOAD = 1448 / 1514
"""TCP payload per link-layer byte of a full frame: tc's rate counts frames, the simulator's
link carries payload."""
PAPER_RATIO = "1 : 11.5 to 1 : 29 (12B bf16, ring of 4 sites at 5 and 2 Gbps, 5 s steps)"


# --- inside the home namespace: one arm, one rung ---
def run_arm(a: argparse.Namespace) -> None:
    """Run one arm with slots 2 and 3 in the remote namespace; writes <out>/report.json."""
    out = Path(a.out)
    remote = ["ip", "netns", "exec", a.remote_ns]
    if a.arm == "dp":
        from ddiloco.local.dp_run import DPConfig, DPRun

        dp = DPRun(
            DPConfig(
                learners=4, max_steps=a.steps, max_seconds=a.cap_s, eval_every=a.eval_every,
                ckpt_every=2, seed=a.seed, out=out,
            )
        )  # fmt: skip
        for slot, child in enumerate(dp.ranks):
            far = slot in REMOTE_SLOTS
            # gloo listens on the side's link address; the ranks share one env dict: copy it
            child.env = {**child.env, "GLOO_SOCKET_IFNAME": a.remote_dev if far else a.home_dev}
            if far:
                child.argv = [*remote, *child.argv]
                child.env["DDILOCO_DP_STORE_HOST"] = a.home_ip
        dp.run()
        return
    from ddiloco.local.config import LocalConfig
    from ddiloco.local.launcher import LocalRun

    run = LocalRun(
        LocalConfig(
            learners=4, max_steps=a.steps, eval_every=a.eval_every, seed=a.seed, h=24,
            fragments=4, tau=2, update_encoding="bfloat16", broadcast_encoding="bfloat16",
            out=out,
        )
    )  # fmt: skip
    run.sync.env["DDILOCO_HOST"] = "0.0.0.0"  # the remote learners dial home's address
    for slot in REMOTE_SLOTS:
        child = run.learners[slot]
        argv = list(child.argv)
        i = argv.index("--sync-url")
        argv[i + 1] = f"http://{a.home_ip}:{run.port}"
        argv += ["--upload-url", f"http://{a.home_ip}:{run.upload_ports[0]}"]
        child.argv = [*remote, *argv]
    run.run()


# --- gloo's all-reduce on the link, alone (--probe) ---
def probe_rank(a: argparse.Namespace) -> None:
    """One rank: median seconds of all-reduces of 1 and of the model's fp32 gradient."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(a.home_ip, a.probe_port, is_master=False, timeout=timedelta(60))
    dist.init_process_group("gloo", store=store, rank=a.probe_rank, world_size=4)
    medians = {}
    for numel in (1, a.probe_numel):
        x = torch.ones(numel)
        for _ in range(3):
            dist.all_reduce(x)
        dist.barrier()
        times = []
        for _ in range(20):
            t = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t)
        medians[numel] = sorted(times)[len(times) // 2]
    print(json.dumps(medians), flush=True)


def probe(params: int) -> None:
    """Latencies per all-reduce: gloo's ring over the link at 1 Gbit, RTT 0, 40 and 80 ms."""
    import torch.distributed as dist

    from ddiloco.local.wanlink import WanLink, in_netns

    base: dict[str, float] = {}
    for rtt in (0.0, 40.0, 80.0):
        with WanLink(rate="1000mbit", rtt_ms=rtt) as link:
            with in_netns(link.home.ns):
                store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            procs = []
            for rank in range(4):
                side = link.home if rank in HOME_SLOTS else link.remote
                env = {**os.environ, "GLOO_SOCKET_IFNAME": side.dev, "OMP_NUM_THREADS": "1"}
                argv = [
                    sys.executable, "-P", str(Path(__file__).resolve()), "--home-ip",
                    link.home.ip, "--probe-port", str(store.port), "--probe-rank", str(rank),
                    "--probe-numel", str(params),
                ]  # fmt: skip
                procs.append(
                    link.popen(side.name, argv, env=env, stdout=subprocess.PIPE, text=True)
                )
            got = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
            del store
        med = {k: statistics.median(g[k] for g in got) for k in got[0]}
        if rtt == 0:
            base = med
        for k, v in med.items():
            per = f"{(v - base[k]) / (rtt / 2000):.1f} one-way latencies" if rtt else "no delay"
            print(f"RTT {rtt:3g} ms, {int(k):>8} floats: {v * 1000:7.1f} ms ({per})")
    print("a 4-rank ring has 2(R-1) = 6 steps: latencies / 6 = one-way latencies per step")


# --- the driver, in the machine's own namespace ---
def crossing(history: list[tuple[float, float]], target: float) -> float | None:
    """First time the (t, loss) curve reaches `target`, linear between points."""
    prev: tuple[float, float] | None = None
    for t, loss in history:
        if loss <= target:
            if prev is None or prev[1] <= target:
                return t
            t0, l0 = prev
            return t0 + (t - t0) * (l0 - target) / (l0 - loss)
        prev = (t, loss)
    return None


def step_stats(out: Path) -> tuple[float, float, float]:
    """(mean compute seconds per step, mean wall seconds per step, mean over step numbers of
    the slowest slot's compute) from the slots' step logs. The last is what a lock-step
    data-parallel step waits for before its all-reduce can finish."""
    from ddiloco.local.report import read_jsonl

    dts, walls = [], []
    by_step: dict[int, float] = {}
    for log in sorted((out / "learners").glob("*.jsonl")):
        steps = [r for r in read_jsonl(log) if "dt" in r and "step" in r]
        dts += [float(r["dt"]) for r in steps]
        for r in steps:
            by_step[int(r["step"])] = max(by_step.get(int(r["step"]), 0.0), float(r["dt"]))
        if len(steps) > 1:
            walls.append((steps[-1]["t"] - steps[0]["t"]) / (len(steps) - 1))
    return statistics.fmean(dts), statistics.fmean(walls), statistics.fmean(by_step.values())


def row_of(out: Path, rtt_ms: float) -> dict[str, Any]:
    """One run's figures from its directory (report.json, step logs, link.json)."""
    from ddiloco.local.wanlink import parse_rate

    report = json.loads((out / "report.json").read_text())
    link = json.loads((out / "link.json").read_text())
    dt, wall_step, slowest = step_stats(out)
    return {
        "rate": link["rate"],
        "rate_bps": parse_rate(link["rate"]),
        "rtt_ms": rtt_ms,
        "arm": link["arm"],
        "wall_s": report["wall_seconds"],
        "goodput": report["goodput"],
        "tokens": report["tokens_computed"],
        "link_bytes": link["link_bytes"],
        "step_compute_s": dt,
        "step_slowest_s": slowest,
        "step_wall_s": wall_step,
        "history": [(float(h[0]), float(h[1])) for h in report["eval_history"]],
        "final_loss": float(report["eval_history"][-1][1]),
    }


def simulate(
    params: int, rate_bps: float, rtt_ms: float, step_s: float, dp_compute_s: float
) -> dict[str, Any]:
    gbps = rate_bps * PAYLOAD / 1e9
    argv = [
        sys.executable, "-P", "-m", "ddiloco.cli.main", "simulate", "wide-area",
        "--params", str(params), "--link-gbps", f"{gbps:g},{gbps:g}",
        "--latency-ms", f"{rtt_ms / 2:g}", "--step-s", f"{step_s:.5f}",
        "--ranks-per-site", "2", "--ring-step-latencies", "2", "--grad-bits", "32",
        "--up-bits", "16", "--down-bits", "16",
        "-P", "4", "-H", "24", "--tau", "2", "--dp-compute-s", f"{dp_compute_s:.5f}",
        "--no-dp-overlap", "--json",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT)
    four: dict[str, Any] = json.loads(done.stdout)["four_sites"]
    four["command"] = " ".join(["ddiloco", *argv[argv.index("simulate") :]])
    return four


def model_params(seed: int) -> int:
    from ddiloco.learner.task import build_task

    task = build_task(preset="tiny", seed=seed, batch_size=8)
    return sum(p.numel() for p in task.model.parameters() if p.requires_grad)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rates", default="100mbit,24mbit,9mbit,3.6mbit", help="the ladder")
    ap.add_argument("--rtt-ms", type=float, default=40.0)
    ap.add_argument("--steps", type=int, default=96, help="steps per learner slot")
    ap.add_argument("--cap-s", type=float, default=400.0, help="wall cap per run, s")
    ap.add_argument("--eval-every", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/wan-" + time.strftime("%Y%m%d-%H%M%S"))
    ap.add_argument("--json", help="also write the table's rows here")
    # one arm inside the home namespace (the driver starts these)
    ap.add_argument("--arm", choices=["dp", "decoupled"], help=argparse.SUPPRESS)
    for flag in ("--remote-ns", "--home-ip", "--home-dev", "--remote-dev"):
        ap.add_argument(flag, help=argparse.SUPPRESS)
    ap.add_argument("--table-from", help="print the table of an earlier run's --out, run nothing")
    ap.add_argument("--probe", action="store_true", help="measure gloo's all-reduce latencies")
    for flag in ("--probe-port", "--probe-rank", "--probe-numel"):
        ap.add_argument(flag, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.arm:
        run_arm(a)
        return 0
    if a.probe_port:
        probe_rank(a)
        return 0
    if a.probe:
        probe(model_params(a.seed))
        return 0
    if a.table_from:
        rates = list(dict.fromkeys(a.rates.split(",")))
        outs = [Path(a.table_from) / f"{rate}-{arm}" for rate in rates for arm in ARMS]
        return finish([row_of(o, a.rtt_ms) for o in outs], model_params(a.seed), a)

    from ddiloco.local.wanlink import WanLink, available

    why = available()
    if why:
        print(f"wan_study: cannot build a shaped link: {why}", file=sys.stderr)
        return 2
    params = model_params(a.seed)
    rows: list[dict[str, Any]] = []
    t_start = time.time()
    for rate in a.rates.split(","):
        with WanLink(rate=rate, rtt_ms=a.rtt_ms) as link:
            for arm in ARMS:
                out = Path(a.out) / f"{rate}-{arm}"
                out.mkdir(parents=True, exist_ok=True)
                before = link.counters()
                cmd = [
                    sys.executable, "-P", str(Path(__file__).resolve()), "--arm", arm,
                    "--out", str(out), "--steps", str(a.steps), "--cap-s", str(a.cap_s),
                    "--eval-every", str(a.eval_every), "--seed", str(a.seed),
                    "--remote-ns", link.remote.ns, "--home-ip", link.home.ip,
                    "--home-dev", link.home.dev, "--remote-dev", link.remote.dev,
                ]  # fmt: skip
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                with open(out / "driver.log", "w") as log:
                    subprocess.run(
                        link.argv("home", cmd), cwd=ROOT, env=env, check=True,
                        stdout=log, stderr=subprocess.STDOUT,
                    )  # fmt: skip
                after = link.counters()
                (out / "link.json").write_text(
                    json.dumps(
                        {
                            "rate": rate,
                            "arm": arm,
                            "link_bytes": sum(after.values()) - sum(before.values()),
                            "counters": {k: after[k] - before[k] for k in after},
                        }
                    )
                )
                rows.append(row_of(out, a.rtt_ms))
                r = rows[-1]
                print(
                    f"{rate:>8} {arm:>9}: {r['wall_s']:7.1f} s, compute step "
                    f"{r['step_compute_s'] * 1000:6.1f} ms (slowest slot "
                    f"{r['step_slowest_s'] * 1000:6.1f} ms), wall step "
                    f"{r['step_wall_s'] * 1000:7.1f} ms, final loss {r['final_loss']:.4f}",
                    flush=True,
                )
    print(f"all runs: {time.time() - t_start:.0f} s")
    return finish(rows, params, a)


def finish(rows: list[dict[str, Any]], params: int, a: argparse.Namespace) -> int:
    target = max(float(r["final_loss"]) for r in rows)
    for r in rows:
        r["to_target_s"] = crossing(r["history"], target)
        r["bytes_per_token"] = r["link_bytes"] / max(r["tokens"], 1)
    print(table(rows, params, target, a.rtt_ms))
    for r in rows:
        r.pop("history")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


def table(rows: list[dict[str, Any]], params: int, target: float, rtt_ms: float) -> str:
    by = {(r["rate"], r["arm"]): r for r in rows}
    lines = [
        f"model: tiny, {params} parameters ({params * 4 / 1e6:.2f} MB fp32 gradient); "
        f"M = 4 (2 home + 2 remote); target eval loss {target:.4f} (worst final loss)",
        f"paper's compute : transfer, data-parallel: {PAPER_RATIO}",
        "| rung | rate | RTT | compute : transfer (DP) | DP wall to target | DiLoCo wall to "
        "target | speed-up to target | speed-up in steps/s | speed-up simulated | sim. / meas. "
        "(steps/s) | goodput DP / DiLoCo | link bytes/token DP / DiLoCo | steps/s per slot DP "
        "/ DiLoCo |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rates = list(dict.fromkeys(r["rate"] for r in rows))
    for i, rate in enumerate(rates, 1):
        dp, dd = by[(rate, "dp")], by[(rate, "decoupled")]
        transfer = 2 * 3 / 4 * params * 4 * 8 / dp["rate_bps"]  # a ring of 4, fp32
        sim = simulate(params, dp["rate_bps"], rtt_ms, dd["step_compute_s"], dp["step_slowest_s"])
        measured = (
            dp["to_target_s"] / dd["to_target_s"]
            if dp["to_target_s"] and dd["to_target_s"]
            else None
        )
        dp["sim"] = dd["sim"] = sim
        rate_speedup = dp["step_wall_s"] / dd["step_wall_s"]
        dp["speedup_to_target"] = dd["speedup_to_target"] = measured
        dp["speedup_steps"] = dd["speedup_steps"] = rate_speedup
        lines.append(
            f"| {i} | {rate} | {rtt_ms:g} ms | 1 : {transfer / dp['step_compute_s']:.1f} | "
            f"{_s(dp['to_target_s'])} | {_s(dd['to_target_s'])} | "
            f"{'-' if measured is None else f'{measured:.2f}x'} | {rate_speedup:.2f}x | "
            f"{sim['speedup']:.2f}x | {sim['speedup'] / rate_speedup:.2f} | "
            f"{dp['goodput']:.2f} / {dd['goodput']:.2f} | "
            f"{dp['bytes_per_token']:.0f} / {dd['bytes_per_token']:.0f} | "
            f"{1 / dp['step_wall_s']:.2f} / {1 / dd['step_wall_s']:.2f} |"
        )
    lines.append("simulator commands:")
    lines += [f"  {by[(rate, 'dp')]['sim']['command']}" for rate in rates]
    return "\n".join(lines)


def _s(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.1f} s"


if __name__ == "__main__":
    sys.exit(main())
