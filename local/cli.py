"""`ddiloco local`: the whole system on this machine, no Kubernetes. Start here.

    ddiloco local                                   # 4 learners, tiny GPT, 60 s, stdlib corpus
    ddiloco local --learners 3 --max-seconds 60 --seed 1 --report r.json
    ddiloco local --chaos kill                      # SIGKILL a learner every ~12 s, restart it
    ddiloco local --chaos kill --hot-spares 0      # ... without the hot spare taking over
    ddiloco local --tls                             # HTTPS (h2 by ALPN), the run's own CA
    ddiloco local --mtls                            # ... and client certificates (mutual TLS)
    ddiloco local --learner-metrics                 # learners serve /metrics: <out>/metrics.json
    ddiloco local --sync-shards 2                   # two synchronizer shards, status merged

It prints a live table while it runs, then a summary, and writes <out>/report.json,
<out>/report.png (eval loss over time; per-learner computing / waiting / dead timeline) and
<out>/report.html (the same and more, one self-contained page: local/report_html.py).

    ddiloco local --tensorboard runs/tb             # also TensorBoard event files (tensorboardX)
    ddiloco local report runs/local-x               # rebuild report.html and .png from report.json
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ddiloco.cli.errors import UsageError, fail, usage_errors
from ddiloco.local.chaos import KINDS
from ddiloco.local.launcher import LocalConfig, LocalRun
from ddiloco.wire.protocol import BROADCAST_ENCODINGS, DEFAULT_BROADCAST_ENCODING

PROG = "ddiloco local"


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
        "--merge-scale",
        choices=["contributors", "live"],
        default="live",
        help="average each merge over the whole live set's tokens (default) or over its "
        "contributors only (the paper's rule)",
    )
    ap.add_argument(
        "-H", type=int, default=24, dest="h", help="inner steps between hand-overs of a fragment"
    )
    ap.add_argument(
        "-P", type=int, default=4, dest="fragments", help="number of fragments (default 4)"
    )
    ap.add_argument("--tau", type=int, default=2, help="overlap steps (default 2)")
    ap.add_argument(
        "--sync-shards",
        type=int,
        default=1,
        help="S, synchronizer shards: S processes, each owning a share of the fragments "
        "(default 1)",
    )
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
        "--init-from",
        help="start the model from this model directory's safetensors weights (a `ddiloco "
        "export` or a Hugging Face snapshot) instead of its seeded init",
    )
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
        "--total-tokens",
        type=int,
        default=0,
        help="the job's budget in merged tokens: the run ends once they are merged and every "
        "learner stopped (default 0: none; --max-seconds still caps it when given)",
    )
    ap.add_argument(
        "--chaos",
        choices=KINDS,
        default="none",
        help="kill (SIGKILL + delayed restart), pause (SIGSTOP/SIGCONT), slow (a slow half), "
        "straggler, partition (cut a learner's connections), scavenge (learners join and leave), "
        "sync (synchronizer SIGKILL + restart); combine with '+', e.g. kill+pause",
    )
    ap.add_argument(
        "--chaos-unit",
        choices=["seconds", "steps"],
        default="seconds",
        help="draw the chaos in seconds of the run (default) or in inner steps of each learner "
        "(needs --max-steps; kill, pause, partition, slow, straggler)",
    )
    ap.add_argument(
        "--hot-spares",
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
    ap.add_argument(
        "--learner-metrics",
        action="store_true",
        help="each learner serves Prometheus metrics on a loopback port of its own "
        "(listed in <out>/metrics.json)",
    )
    ap.add_argument(
        "--update-encoding",
        choices=["float32", "bfloat16", "int8", "int4"],
        default="bfloat16",
        help="how learners send updates, and the one the synchronizer accepts: float32, "
        "bfloat16 (default), or blockwise int8 / int4 with error feedback",
    )
    ap.add_argument(
        "--broadcast-encoding",
        choices=list(BROADCAST_ENCODINGS),
        default=DEFAULT_BROADCAST_ENCODING,
        help="how the synchronizer serves merged fragments: bfloat16 (default), float32, int8, "
        "or int8-delta / int4-delta (quantized deltas from the copy each learner holds)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="run directory (default runs/local-<time>)")
    ap.add_argument("--report", type=Path, help="also copy the JSON report here")
    ap.add_argument(
        "--tensorboard",
        type=Path,
        metavar="DIR",
        help="write TensorBoard event files under DIR/<run name> (eval loss, training loss, "
        "goodput, merged work, bytes; needs tensorboardX)",
    )
    ap.add_argument("--quiet", action="store_true", help="no live table")
    return ap.parse_args(argv)


class LiveStatus:
    """The run's synchronizer status for the live table: GET /v1/status at most once a second
    (cli/statusview.py renders it, as `ddiloco status` does); a synchronizer that is away
    (chaos `sync`) keeps the last answer on screen, marked stale."""

    def __init__(self, every_s: float = 1.0) -> None:
        from ddiloco.cli.statusview import StatusView

        self.view = StatusView()
        self.every_s = every_s
        self.status: Any = None
        self.error = ""
        self._at = 0.0
        self._client: Any = None

    def poll(self, run: LocalRun) -> None:
        from ddiloco.learner.sync_client import SyncRefused, SyncUnavailable

        if time.monotonic() - self._at < self.every_s:
            return
        self._at = time.monotonic()
        try:
            if self._client is None:
                self._client = run.client(timeout=1.0)
            self.status = self._client.status()
            self.view.update(self.status)
            self.error = ""
        except (SyncUnavailable, SyncRefused) as e:
            self.error = str(e)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _state(child: Any) -> str:
    if child.finished:
        return "done"
    if child.paused_since:
        return "paused"
    return "up" if child.alive() else "dead"


def live_table(run: LocalRun, live: LiveStatus) -> RenderableType:
    """Fragments, learners (the process state and restarts known here, the rest from the
    synchronizer's status) and the summary line; the global model's last eval loss below."""
    live.poll(run)
    up = ",".join("up" if s.alive() else "DOWN" for s in run.syncs)
    title = f"ddiloco local  t={run.elapsed():5.1f}s  sync={up}"
    if live.error and live.status is not None:
        title += "  (status stale: synchronizer away)"
    ev = run.evaluator.history[-1] if run.evaluator and run.evaluator.history else None
    caption = f"global model: eval loss {ev[1]:.3f} at version {ev[2]}" if ev else None
    if live.status is None:
        return Text(f"{title}\nwaiting for the synchronizer's status {live.error}".rstrip())
    return live.view.render(
        live.status,
        title=title,
        caption=caption,
        states={c.name: _state(c) for c in run.learners},
        extra={"restarts": {c.name: str(max(0, len(c.starts) - 1)) for c in run.learners}},
        learners=[c.name for c in run.learners],
    )


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
    budget = report.get("budget")
    if budget:
        state = "reached" if budget["reached"] else "not reached"
        rows.append(
            (
                "token budget",
                f"{state}: {budget['tokens_merged']:,} / {budget['total_tokens']:,} merged",
            )
        )
    for k, v in rows:
        t.add_row(k, v)
    return t


def _tls_row(t: dict[str, Any]) -> str:
    if not t.get("enabled"):
        return "off (h2c)"
    return f"{'mutual' if t.get('mutual') else 'on'} ({t.get('http_version') or '?'})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:  # `ddiloco local report OUT_DIR`
        from ddiloco.local.report_html import main as report_main

        return report_main(argv[1:])
    args = parse(argv)
    if args.tensorboard is not None:
        from ddiloco.local.tensorboard import missing

        if (why := missing()) is not None:
            sys.stderr.write(f"ddiloco local: error: {why}\n")
            return 2
    logging.basicConfig(level="INFO", format="%(asctime)s local %(levelname)s: %(message)s")
    console = Console()
    with usage_errors(PROG):  # a bad flag or input: one line, exit 2 (cli/errors.py)
        cfg = LocalConfig(
            learners=args.learners,
            quorum=args.quorum,
            grace=not args.no_grace,
            merge=args.merge,
            merge_scale=args.merge_scale,
            model=args.model,
            model_entry=args.model_entry,
            init_from=args.init_from,
            data=args.data,
            tokenizer=args.tokenizer,
            data_field=args.data_field,
            nproc_per_node=args.nproc_per_node,
            max_seconds=args.max_seconds,
            max_steps=args.max_steps,
            total_tokens=args.total_tokens,
            chaos=args.chaos,
            chaos_unit=args.chaos_unit,
            seed=args.seed,
            h=args.h,
            fragments=args.fragments,
            tau=args.tau,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            batch_size=args.batch_size,
            inner_lr=args.inner_lr,
            hot_spares=args.hot_spares,
            spare_takeover=args.spare_takeover,
            tls=args.tls,
            mtls=args.mtls,
            tensorboard=args.tensorboard,
            learner_metrics=args.learner_metrics,
            sync_shards=args.sync_shards,
            update_encoding=args.update_encoding,
            broadcast_encoding=args.broadcast_encoding,
            **({"out": args.out} if args.out else {}),
        )
        from ddiloco.learner.cli import check_model_and_data

        # before any process starts
        check_model_and_data(cfg.model, cfg.model_entry, cfg.data, cfg.init_from)
    tls_on = "mtls" if cfg.mtls else "on" if cfg.tls else "off"
    console.print(
        f"ddiloco local: {cfg.learners} learners, K={cfg.quorum}, chaos={cfg.chaos}, "
        f"tls={tls_on}, out={cfg.out}"
    )
    interactive = console.is_terminal and not args.quiet
    status = LiveStatus()
    try:
        if interactive:
            with Live(console=console, refresh_per_second=4) as live:
                report = LocalRun(
                    cfg, on_tick=lambda run: live.update(live_table(run, status))
                ).run()
        else:
            last = [0.0]

            def tick(run: LocalRun) -> None:
                if not args.quiet and time.time() - last[0] >= 10:
                    last[0] = time.time()
                    console.print(live_table(run, status))

            report = LocalRun(cfg, on_tick=tick).run()
    except UsageError as e:  # inputs only a model's load could refuse (learner/weights.py)
        fail(PROG, e)
    except RuntimeError as e:  # the run could not go on: a learner that never started, ...
        lines = str(e).splitlines() or [type(e).__name__]
        sys.stderr.write(f"{PROG}: error: {lines[0]}\n" + "".join(f"  {x}\n" for x in lines[1:]))
        return 1  # a runtime failure (cli/errors.py); its log tail is indented below the line
    finally:
        status.close()
    from ddiloco.local.plot import plot_report
    from ddiloco.local.report_html import write_html

    png = plot_report(report, Path(cfg.out) / "report.png")
    page = write_html(report, Path(cfg.out) / "report.html")
    console.print(summary(report))
    console.print(f"report: {Path(cfg.out) / 'report.json'}   plot: {png}   page: {page}")
    if cfg.learner_metrics:
        out = Path(cfg.out)
        console.print(f"metrics: {out / 'metrics.json'}, last scrapes in {out / 'metrics'}")
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(cfg.out) / "report.json", args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
