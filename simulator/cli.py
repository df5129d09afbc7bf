"""`ddiloco simulate`: the method at a scale no test machine has.

    ddiloco simulate paper-table [--json] [--plot goodput.png]   # the paper's goodput table, reproduced
    ddiloco simulate run --chips 1200000 --learners 8 [--json]   # one fleet, all four methods
    ddiloco simulate wide-area [--json]                          # 12B over four 2-5 Gbps sites
    ddiloco simulate --plan --chips 600000 --link-gbps 10        # best M, K, P, H for a fleet
    ddiloco simulate --calibrate r.json [--json]                 # replay a `ddiloco local` run

Pure Python + numpy; the paper table takes ~15 s on one core. Assumptions: `paper.py`;
failure model: `failures.py`; methods: `strategies.py`; links: `network.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ddiloco.cli.errors import usage_errors
from ddiloco.simulator.config import YEAR_S, FailureConfig, NetworkConfig, RunConfig


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")


def _add_fleet(p: argparse.ArgumentParser, *, chips: int = 1_200_000, learners: int = 8) -> None:
    # -- the fleet and how it is split
    p.add_argument("--chips", type=int, default=chips, help="accelerators in the fleet, N")
    p.add_argument("--learners", "-M", type=int, default=learners, help="learner slots M")
    p.add_argument(
        "--chips-per-learner", type=int, help="instead of -M: M = chips / chips-per-learner"
    )
    p.add_argument("--quorum", "-K", type=int, default=1, help="minimum quorum K (K = M: sync)")
    p.add_argument("--fragments", "-P", type=int, default=24, help="fragments P")
    p.add_argument("-H", type=int, default=24, help="inner steps between merges of a fragment")
    p.add_argument("--tau", type=int, default=2, help="overlap tau, steps")
    # -- failures and what they cost
    d = FailureConfig()
    p.add_argument(
        "--mtbi-days",
        type=float,
        default=YEAR_S / 86400,
        help="mean time between interruptions of one chip, days",
    )
    p.add_argument(
        "--slice-chips",
        type=int,
        default=d.slice_chips,
        help="chips a failure takes out of service",
    )
    p.add_argument("--step-s", type=float, default=d.step_s, help="inner step time, seconds")
    p.add_argument(
        "--step-cv",
        type=float,
        default=d.step_cv,
        help="per-slice step-time spread (coefficient of variation)",
    )
    p.add_argument(
        "--restart-s", type=float, default=d.restart_s, help="non-elastic restart time, seconds"
    )
    p.add_argument("--shrink-s", type=float, default=d.shrink_s, help="elastic shrink pause, s")
    p.add_argument("--regrow-s", type=float, default=d.regrow_s, help="elastic regrow pause, s")
    p.add_argument(
        "--repair-scale-s",
        type=float,
        default=d.repair.scale_s,
        help="repair time: exponentiated-Weibull scale, seconds",
    )
    # -- the run
    p.add_argument("--horizon-days", type=float, default=4.0, help="simulated wall time, days")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _failure_config(a: argparse.Namespace) -> FailureConfig:
    from ddiloco.simulator.config import RepairConfig

    return FailureConfig(
        chip_mtbi_s=a.mtbi_days * 86400,
        slice_chips=a.slice_chips,
        step_s=a.step_s,
        step_cv=a.step_cv,
        restart_s=a.restart_s,
        shrink_s=a.shrink_s,
        regrow_s=a.regrow_s,
        repair=RepairConfig(scale_s=a.repair_scale_s),
    )


def _run_config(a: argparse.Namespace) -> RunConfig:
    if a.chips_per_learner:
        a.learners = max(1, a.chips // a.chips_per_learner)
    return RunConfig(
        chips=a.chips,
        learners=a.learners,
        quorum=a.quorum,
        fragments=a.fragments,
        H=a.H,
        tau=a.tau,
        horizon_s=a.horizon_days * 86400,
        seed=a.seed,
    )


def _add_network(p: argparse.ArgumentParser) -> None:
    d = NetworkConfig()
    p.add_argument("--params", type=float, default=d.params, help="model parameters")
    p.add_argument(
        "--link-gbps",
        default=",".join(str(x) for x in d.link_gbps),
        help="per-site wide-area links, Gbit/s, comma separated",
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=d.latency_s * 1000,
        help="one-way latency between sites, ms",
    )
    p.add_argument("--up-bits", type=int, default=d.up_bits, help="upload precision, bits")
    p.add_argument(
        "--down-bits", type=int, default=d.down_bits, help="merged fragment precision, bits"
    )
    p.add_argument("--grad-bits", type=int, default=d.grad_bits, help="DP gradient bits")
    p.add_argument(
        "--ranks-per-site",
        type=int,
        default=d.ranks_per_site,
        help="DP ranks per site in the all-reduce ring (and learners per site)",
    )
    p.add_argument(
        "--ring-step-latencies",
        type=float,
        default=d.ring_step_latencies,
        help="one-way latencies each all-reduce ring step waits (gloo over TCP: 2)",
    )
    p.add_argument(
        "--no-dp-overlap",
        dest="dp_overlap",
        action="store_false",
        help="DP's all-reduce follows its compute instead of overlapping it",
    )


def _network_config(a: argparse.Namespace) -> NetworkConfig:
    links = tuple(float(x) for x in str(a.link_gbps).split(",") if x.strip())
    return NetworkConfig(
        params=a.params,
        link_gbps=links,
        up_bits=a.up_bits,
        down_bits=a.down_bits,
        grad_bits=a.grad_bits,
        latency_s=a.latency_ms / 1000,
        ranks_per_site=a.ranks_per_site,
        ring_step_latencies=a.ring_step_latencies,
        dp_overlap=a.dp_overlap,
    )


def cmd_paper_table(a: argparse.Namespace) -> int:
    from ddiloco.simulator.paper import format_table, paper_table

    table = paper_table(horizon_s=a.horizon_days * 86400, seed=a.seed)
    if a.plot:
        from ddiloco.simulator.report import plot_paper_table

        plot_paper_table(table, a.plot)
    if a.json:
        _out(
            json.dumps(
                {r: {c: round(v, 4) for c, v in cols.items()} for r, cols in table.items()},
                indent=2,
            )
        )
    else:
        _out(format_table(table))
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    from ddiloco.simulator.network import decoupled_traffic
    from ddiloco.simulator.report import format_runs, plot_learners, run_summary
    from ddiloco.simulator.strategies import STRATEGIES, simulate

    fail, run, net = _failure_config(a), _run_config(a), _network_config(a)
    rows, results = [], []
    for strategy in a.strategy or STRATEGIES:
        r = simulate(strategy, run, fail)
        extra: dict[str, float] = {
            "wall_hours_to_tokens": r.wall_to_tokens_s(a.tokens, a.tokens_per_chip_s) / 3600,
        }
        if strategy == "decoupled":
            t = decoupled_traffic(net, fail.step_s, run.fragments, run.H, run.tau)
            extra["bytes_up_per_site_per_hour"] = t.bytes_up_per_hour
            extra["bytes_down_per_site_per_hour"] = t.bytes_down_per_hour
            extra["peak_gbps_per_site"] = t.peak_gbps
        results.append(r)
        rows.append(run_summary(r, extra))
    if a.plot:
        plot_learners(results, a.plot)
    _out(json.dumps(rows, indent=2) if a.json else format_runs(rows))
    return 0


PAPER_WIDE_AREA = {"speedup": "more than 20x", "bandwidth_8_sites": "0.84 vs 198 Gbps"}


def _default_syncer() -> Any:
    from ddiloco.simulator.syncer import SyncerConfig

    return SyncerConfig()


def _syncer_config(a: argparse.Namespace) -> Any:
    from ddiloco.simulator.syncer import DOWNLOAD_ENCODINGS, SyncerConfig, parse_capacity

    d = SyncerConfig()
    caps = {**d.shard_gbps, **parse_capacity(a.shard_gbps)} if a.shard_gbps else d.shard_gbps
    encode = d.encode_gvps
    if a.shard_encode_gvps:
        given = parse_capacity(
            a.shard_encode_gvps, "--shard-encode-gvps", DOWNLOAD_ENCODINGS, "G values/s"
        )
        encode = {**encode, **given}
    return SyncerConfig(
        shard_gbps=caps,
        out_gbps=d.out_gbps if a.shard_out_gbps is None else a.shard_out_gbps,
        download_encoding=a.download_encoding,
        encode_gvps=encode,
        max_shards=a.max_shards,
    )


def _add_syncer(p: argparse.ArgumentParser) -> None:
    from ddiloco.simulator.syncer import DOWNLOAD_ENCODINGS

    p.add_argument(
        "--shard-gbps",
        default="",
        help="update GB/s one synchronizer shard ingests when it serves nothing, by encoding, "
        "e.g. bf16=1.0,int8=0.9,int4=0.8 (default: this project's measurement, "
        "simulator/syncer.py)",
    )
    p.add_argument(
        "--shard-out-gbps",
        type=float,
        default=None,
        help="served GB/s one shard sends when it ingests nothing (default: fitted to this "
        "project's round trip, simulator/syncer.py)",
    )
    p.add_argument(
        "--download-encoding",
        default="bfloat16",
        choices=DOWNLOAD_ENCODINGS,
        help="what learners download of every merge, the synchronizer's broadcast_encoding "
        "(the links' bits stay --down-bits)",
    )
    p.add_argument(
        "--shard-encode-gvps",
        default="",
        help="G parameters per second one shard encodes a merge for serving in a quantized "
        "download encoding, e.g. int8-delta=0.2,int4-delta=0.15 (default: measured, "
        "simulator/syncer.py)",
    )
    p.add_argument("--max-shards", type=int, default=64, help="most synchronizer shards to try")


def wide_area_figures(
    net: NetworkConfig,
    step_s: float,
    fragments: int,
    H: int,
    tau: int,
    syncer_cfg: Any = None,
    dp_compute_s: float | None = None,
) -> dict[str, Any]:
    """The four-site run, and the eight-site bandwidth comparison."""
    from ddiloco.simulator.network import decoupled_traffic, dp_bandwidth_gbps, wide_area

    four = wide_area(
        net, step_s=step_s, fragments=fragments, H=H, tau=tau, dp_compute_s=dp_compute_s
    )
    int4 = NetworkConfig(
        params=net.params,
        up_bits=4,
        down_bits=net.down_bits,
        link_gbps=net.link_gbps,
        latency_s=net.latency_s,
    )
    eight = {
        "dp_gbps_per_site": dp_bandwidth_gbps(net.params, net.grad_bits, 8, step_s),
        "decoupled_gbps_per_site_bf16": decoupled_traffic(
            net, step_s, fragments, H, tau
        ).up_mean_gbps,
        "decoupled_gbps_per_site_int4_up": decoupled_traffic(
            int4, step_s, fragments, H, tau
        ).up_mean_gbps,
    }
    from ddiloco.simulator.syncer import ENCODINGS, fit

    cfg = syncer_cfg or _default_syncer()
    syncer = {
        enc: (
            None
            if (got := fit(
                cfg, params=net.params, learners=net.sites, H=H,
                step_s=step_s, fragments=fragments, tau=tau, encodings=(enc,),
            )) is None
            else {"shards": got.shards, "mean_gbps": got.mean_gbps, "out_gbps": got.out_gbps,
                  "utilisation": got.mean_utilisation, "serve_share": got.serve_share,
                  "round_s": got.round_s}
        )
        for enc in ENCODINGS
    }  # fmt: skip
    return {
        "four_sites": four,
        "eight_sites": eight,
        "synchronizer": syncer,
        "paper": PAPER_WIDE_AREA,
        "assumptions": {
            "params": net.params,
            "links_gbps": list(net.link_gbps),
            "step_s": step_s,
            "P": fragments,
            "H": H,
            "tau": tau,
            "grad_bits": net.grad_bits,
            "up_bits": net.up_bits,
            "learners": net.sites,
            "download_encoding": cfg.download_encoding,
            "shard_gbps": dict(cfg.shard_gbps),
            "shard_out_gbps": cfg.out_gbps,
        },
    }


def format_wide_area(f: dict[str, Any]) -> str:
    four, eight = f["four_sites"], f["eight_sites"]
    a = f["assumptions"]
    return "\n".join(
        [
            f"{a['params'] / 1e9:.0f}B parameters, {len(a['links_gbps'])} sites, links "
            f"{'/'.join(f'{x:g}' for x in a['links_gbps'])} Gbps, step {a['step_s']:g} s, "
            f"P={a['P']} H={a['H']} tau={a['tau']}",
            f"  sync DP all-reduce per step       {four['dp_allreduce_s']:8.1f} s "
            f"(step {four['dp_step_s']:.1f} s vs {four['decoupled_step_s']:.1f} s)",
            f"  speed-up over synchronous DP      {four['speedup']:8.1f}x   "
            f"paper: {f['paper']['speedup']}",
            f"  Decoupled per site, up / down     {four['decoupled_up_gbps_per_site']:8.2f} / "
            f"{four['decoupled_down_gbps_per_site']:.2f} Gbps (peak {four['decoupled_peak_gbps_per_site']:.2f}"
            f"; slowest link {four['slowest_link_utilisation']:.0%} busy)",
            "eight sites, bandwidth per site to hide communication in the step:",
            f"  data-parallel                     {eight['dp_gbps_per_site']:8.1f} Gbps",
            f"  Decoupled (bf16 / int4 up)        {eight['decoupled_gbps_per_site_bf16']:8.2f} / "
            f"{eight['decoupled_gbps_per_site_int4_up']:.2f} Gbps   paper: "
            f"{f['paper']['bandwidth_8_sites']} (Decoupled vs DP)",
            "synchronizer shards that keep merging off the critical path (K = 1), by update "
            f"encoding ({a['learners']} learners download every merge in "
            f"{a['download_encoding']}):",
            *(
                f"  {enc:<5} " + (
                    "none up to --max-shards" if v is None else
                    f"S = {v['shards']:<3} ({v['mean_gbps']:.2f} GB/s in, {v['out_gbps']:.2f} "
                    f"out, {v['utilisation']:.0%} busy of which serving {v['serve_share']:.0%}, "
                    f"a round ingested in {v['round_s']:.2f} s)"
                )
                for enc, v in f.get("synchronizer", {}).items()
            ),
        ]
    )  # fmt: skip


def cmd_wide_area(a: argparse.Namespace) -> int:
    f = wide_area_figures(
        _network_config(a), a.step_s, a.fragments, a.H, a.tau, _syncer_config(a), a.dp_compute_s
    )
    _out(json.dumps(f, indent=2) if a.json else format_wide_area(f))
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    from ddiloco.simulator.plan import as_json, format_plan, search

    cands = search(_run_config(a), _failure_config(a), _network_config(a), syncer=_syncer_config(a))
    _out(json.dumps(as_json(cands, a.top), indent=2) if a.json else format_plan(cands, a.top))
    return 0


def cmd_calibrate(a: argparse.Namespace) -> int:
    from ddiloco.simulator.calibrate import calibrate, format_calibration

    results = [calibrate(p) for p in a.reports]
    _out(json.dumps(results, indent=2) if a.json else format_calibration(results))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddiloco simulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("paper-table", help="the paper's goodput table, reproduced")
    t.add_argument("--json", action="store_true", help="print JSON: row -> column -> goodput")
    t.add_argument("--plot", help="also write a PNG plot here")
    t.add_argument("--horizon-days", type=float, default=4.0, help="simulated days per cell")
    t.add_argument("--seed", type=int, default=0, help="random seed")
    t.set_defaults(fn=cmd_paper_table)

    r = sub.add_parser("run", help="one fleet under every method")
    _add_fleet(r)
    _add_network(r)
    r.add_argument(
        "--strategy",
        action="append",
        choices=["dp", "elastic_dp", "diloco", "decoupled"],
        help="only this method (repeatable)",
    )
    r.add_argument("--tokens", type=float, default=1e12, help="token budget for wall time")
    r.add_argument(
        "--tokens-per-chip-s", type=float, default=1000.0, help="tokens one chip trains per second"
    )
    r.add_argument("--plot", help="write per-learner goodput PNG here")
    r.set_defaults(fn=cmd_run)

    w = sub.add_parser("wide-area", help="12B over four sites with 2-5 Gbps links")
    _add_network(w)
    w.add_argument("--step-s", type=float, default=5.0, help="inner step compute time, s")
    w.add_argument(
        "--dp-compute-s", type=float, help="DP's compute per step, s (default: --step-s)"
    )
    w.add_argument("--fragments", "-P", type=int, default=24, help="fragments P")
    w.add_argument("-H", type=int, default=24, help="inner steps between merges")
    w.add_argument("--tau", type=int, default=2, help="overlap tau, steps")
    w.add_argument("--json", action="store_true", help="print JSON")
    _add_syncer(w)
    w.set_defaults(fn=cmd_wide_area)

    pl = sub.add_parser("plan", help="search M, K, P, H for a fleet")
    _add_fleet(pl, chips=600_000)
    _add_network(pl)
    pl.set_defaults(link_gbps="100", horizon_days=1.0)
    pl.add_argument("--top", type=int, default=5, help="how many configurations to print")
    _add_syncer(pl)
    pl.set_defaults(fn=cmd_plan)

    c = sub.add_parser("calibrate", help="replay `ddiloco local` reports")
    c.add_argument("reports", nargs="+", help="report JSON files")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(fn=cmd_calibrate)
    return p


def _normalise(argv: list[str]) -> list[str]:
    """`--plan ...` and `--calibrate r.json` are spelled as flags in the issue: map them."""
    if "--calibrate" in argv:
        rest = [x for x in argv if x != "--calibrate"]
        return ["calibrate", *rest]
    if "--plan" in argv:
        return ["plan", *[x for x in argv if x != "--plan"]]
    return argv


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_normalise(list(sys.argv[1:] if argv is None else argv)))
    # Pure computation on the arguments: a ValueError is a bad value or combination (config.py
    # names the field), an OSError or KeyError a report that cannot be read: one line, exit 2.
    with usage_errors("ddiloco simulate", KeyError):
        return int(args.fn(args))


if __name__ == "__main__":
    raise SystemExit(main())
