"""`ddiloco local`: the whole system on this machine, no Kubernetes. Start here.

    ddiloco local                                   # 4 learners, tiny GPT, 60 s, stdlib corpus
    ddiloco local --learners 3 --max-seconds 60 --seed 1 --report r.json
    ddiloco local --chaos kill                      # SIGKILL a learner every ~12 s, restart it
    ddiloco local --chaos kill --warm-spares 0      # ... without the hot spare taking over
    ddiloco local --tls                             # HTTPS (h2 by ALPN), the run's own CA
    ddiloco local --mtls                            # ... and client certificates (mutual TLS)

It prints a live table while it runs, then a summary, and writes <out>/report.json and
<out>/report.png (eval loss over time; per-learner computing / waiting / dead timeline).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from ddiloco.local.chaos import KINDS
from ddiloco.local.launcher import LocalConfig, LocalRun


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="ddiloco local", description="Run a synchronizer and M learners here."
    )
    # --- the method ---
    ap.add_argument("--learners", type=int, default=4, help="M, learner processes (default 4)")
    ap.add_argument(
        "--quorum", type=int, default=1, help="K, minimum contributors per merge (default 1)"
    )
    ap.add_argument(
        "--no-grace", action="store_true", help="merge at the quorum, without the grace window"
    )
    ap.add_argument(
        "--merge", choices=["rda", "mean"], default="rda", help="non-embedding merge (default rda)"
    )
    ap.add_argument(
        "-H", type=int, default=24, dest="h", help="inner steps between hand-overs of a fragment"
    )
    ap.add_argument(
        "-P", type=int, default=4, dest="fragments", help="number of fragments (default 4)"
    )
    ap.add_argument("--tau", type=int, default=2, help="overlap steps (default 2)")
    ap.add_argument(
        "--outer-lr",
        type=float,
        default=LocalConfig.outer_lr,
        help=f"eta, outer learning rate (default {LocalConfig.outer_lr})",
    )
    ap.add_argument(
        "--outer-momentum",
        type=float,
        default=LocalConfig.outer_momentum,
        help=f"mu, outer Nesterov momentum (default {LocalConfig.outer_momentum})",
    )
    # --- model and data ---
    ap.add_argument(
        "--model",
        default="tiny",
        help="preset: tiny, small, base, gpt2 (default tiny), or hf:PATH, a local Hugging Face "
        "config or model directory (hf:llama-tiny: the small Llama shipped with ddiloco)",
    )
    ap.add_argument("--model-entry", help="module:function returning a Task (your model and data)")
    ap.add_argument(
        "--data",
        help="text, JSONL or Parquet files or a folder, or a uint16 .bin "
        "(default: Python stdlib sources)",
    )
    ap.add_argument("--tokenizer", help="local tokenizer for --data (default: the model's)")
    ap.add_argument(
        "--data-field", default="text", help="text column of JSONL and Parquet (default text)"
    )
    ap.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="ranks per learner: each learner a data-parallel group of processes (default 1)",
    )
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--inner-lr", type=float, default=3e-3)
    # --- budget, chaos, output ---
    ap.add_argument(
        "--max-seconds", type=float, default=0.0, help="training wall-clock budget (default 60)"
    )
    ap.add_argument("--max-steps", type=int, default=0, help="inner steps per learner slot")
    ap.add_argument(
        "--chaos",
        choices=KINDS,
        default="none",
        help="kill (SIGKILL + delayed restart), pause (SIGSTOP/SIGCONT), slow (a slow half), "
        "straggler, partition (cut a learner's connections), scavenge (learners join and leave), "
        "sync (synchronizer SIGKILL + restart); combine with '+', e.g. kill+pause",
    )
    ap.add_argument(
        "--warm-spares",
        type=int,
        default=1,
        help="pre-started learner processes that replace killed ones (default 1; 0: a killed "
        "learner restarts as a fresh process after the schedule's delay)",
    )
    ap.add_argument(
        "--spare-takeover",
        choices=["immediate", "after-delay"],
        default="immediate",
        help="immediate (default): a ready spare takes a killed learner's slot at once, as a "
        "hot spare pod does; after-delay: only once the schedule's restart delay is over "
        "(what the bench does for every arm)",
    )
    ap.add_argument(
        "--tls",
        action="store_true",
        help="HTTPS between learners and synchronizer: a CA and certificates in <out>/tls",
    )
    ap.add_argument(
        "--mtls", action="store_true", help="mutual TLS: --tls plus a client cert per learner"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="run directory (default runs/local-<time>)")
    ap.add_argument("--report", type=Path, help="also copy the JSON report here")
    ap.add_argument("--quiet", action="store_true", help="no live table")
    return ap.parse_args(argv)


def live_table(run: LocalRun) -> Table:
    t = Table(
        title=f"ddiloco local  t={run.elapsed():5.1f}s  sync={'up' if run.sync.alive() else 'DOWN'}"
    )
    for col in ("learner", "state", "step", "loss", "restarts"):
        t.add_column(col, justify="right" if col not in ("learner", "state") else "left")
    for child in run.learners:
        state = (
            "done"
            if child.finished
            else "paused"
            if child.paused_since
            else "up"
            if child.alive()
            else "dead"
        )
        last = _last_step(run, child.name)
        t.add_row(
            child.name,
            state,
            str(last.get("step", 0)),
            f"{last.get('loss', float('nan')):.3f}",
            str(max(0, len(child.starts) - 1)),
        )
    ev = run.evaluator.history[-1] if run.evaluator and run.evaluator.history else None
    if ev:
        t.caption = f"global model: eval loss {ev[1]:.3f} at version {ev[2]}"
    return t


def _last_step(run: LocalRun, lid: str) -> dict[str, Any]:
    path = run.learner_log(lid)
    if not path.exists():
        return {}
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 4096))
        for line in reversed(f.read().decode(errors="replace").splitlines()):
            if '"dt"' in line:
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
    return {}


def summary(report: dict[str, Any]) -> Table:
    t = Table(title="ddiloco local: summary")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        (
            "eval loss (initial -> final)",
            f"{report['eval_loss_initial']:.3f} -> {report['eval_loss_final']:.3f}",
        ),
        ("goodput", f"{report['goodput']:.3f}"),
        ("merged-work ratio", f"{report['merged_work_ratio']:.3f}"),
        ("system uptime", f"{report['system_uptime']:.3f}"),
        ("merges (global version)", f"{report['merges']} ({report['global_version']})"),
        ("mean contributors per merge", f"{report['mean_contributors']:.2f}"),
        (
            "tokens computed / merged",
            f"{report['tokens_computed']:,} / {report['tokens_merged']:,}",
        ),
        ("bytes up / down", f"{report['bytes_up']:,} / {report['bytes_down']:,}"),
        ("learner restarts", str(report["learner_restarts"])),
        ("wall seconds", f"{report['wall_seconds']:.1f}"),
        ("TLS", _tls_row(report.get("tls") or {})),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def _tls_row(t: dict[str, Any]) -> str:
    if not t.get("enabled"):
        return "off (h2c)"
    return f"{'mutual' if t.get('mutual') else 'on'} ({t.get('http_version') or '?'})"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s local %(levelname)s: %(message)s")
    console = Console()
    cfg = LocalConfig(
        learners=args.learners,
        quorum=args.quorum,
        grace=not args.no_grace,
        merge=args.merge,
        model=args.model,
        model_entry=args.model_entry,
        data=args.data,
        tokenizer=args.tokenizer,
        data_field=args.data_field,
        nproc_per_node=args.nproc_per_node,
        max_seconds=args.max_seconds,
        max_steps=args.max_steps,
        chaos=args.chaos,
        seed=args.seed,
        h=args.h,
        fragments=args.fragments,
        tau=args.tau,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        batch_size=args.batch_size,
        inner_lr=args.inner_lr,
        warm_spares=args.warm_spares,
        spare_takeover=args.spare_takeover,
        tls=args.tls,
        mtls=args.mtls,
        **({"out": args.out} if args.out else {}),
    )
    tls_on = "mtls" if cfg.mtls else "on" if cfg.tls else "off"
    console.print(
        f"ddiloco local: {cfg.learners} learners, K={cfg.quorum}, chaos={cfg.chaos}, "
        f"tls={tls_on}, out={cfg.out}"
    )
    interactive = console.is_terminal and not args.quiet
    if interactive:
        with Live(console=console, refresh_per_second=4) as live:
            report = LocalRun(cfg, on_tick=lambda run: live.update(live_table(run))).run()
    else:
        last = [0.0]

        def tick(run: LocalRun) -> None:
            if not args.quiet and time.time() - last[0] >= 10:
                last[0] = time.time()
                console.print(live_table(run))

        report = LocalRun(cfg, on_tick=tick).run()
    from ddiloco.local.plot import plot_report

    png = plot_report(report, Path(cfg.out) / "report.png")
    console.print(summary(report))
    console.print(f"report: {Path(cfg.out) / 'report.json'}   plot: {png}")
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(cfg.out) / "report.json", args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
