"""Quality harness, so the method's quality claim can be believed: the global model's eval loss,
arms at equal tokens by construction, paired by seed, as a mean with a 95% interval of the paired
differences.

    .venv/bin/python bench/quality.py --arms sync_diloco,decoupled_grace --seeds 3 \\
        --learners 4 --steps 360 --out runs/q-tiny     # one small part: 6 runs, ~6 min, 2 cores
    .venv/bin/python bench/quality.py --seeds 5 --part 1/4 --out runs/q   # default arms, a quarter
    .venv/bin/python bench/quality.py --seeds 5 --part 2/4 --out runs/q   # ... the next quarter
    .venv/bin/python bench/quality.py --seeds 5 --report --out runs/q     # the tables, no runs
    .venv/bin/python bench/quality.py --list-arms

Equal tokens: every arm runs a step budget per learner slot (`--steps` N), not a wall
time: `ddiloco local` arms with `LocalConfig.max_steps` (a killed learner's replacement
trains what its slot has left), the data-parallel arm with `DPConfig.max_steps` (N group
steps of M ranks, each rank the learners' batch). So every arm computes M x N x batch x
block tokens; a run that did not (it hit the wall cap `--cap-seconds`) is marked and left out
of the comparisons. Under kill chaos the tokens are those *computed*: work lost with a killed
learner counts against the arm (the cost of chaos); merged work is in the table.

Chaos is in steps (local/chaos.py `make_schedule(..., steps=N)`): an event fires once its
target learner has trained `at_step` inner steps, so every arm of a seed meets each kill and
pause at the same point of its work, whatever its step times; the delays (a replacement's
start, a freeze) stay in seconds. Rates: a kill every ~120 steps, a 1-4 s freeze every ~90
steps (jittered +-30%, from step 24); `_pause` arms get the pauses alone. Each run records
how many events it received.

Pairing: `seed` is the model init (`torch.manual_seed(seed)` before the model is built, the
same in learners, ranks and evaluators), each slot's data order (windows drawn with
`(seed, slot)`, the same for a DiLoCo learner and a data-parallel rank of that slot) and the
chaos schedule. So the arms of one seed start from the same weights and see the same data
in the same order per slot; what differs is the method (and, under chaos, timing).

Eval: after the run, the final global model (the evaluator's copy after the last merges;
the data-parallel checkpoint of step N) is measured on `--eval-windows` non-overlapping
windows spread evenly over the held-out set (the stdlib corpus's last 5%, the same for every
arm, seed and M), far more than the 64 windows the in-run evaluator uses. Each run reports
the eval set's own standard error (sd of the window losses / sqrt(windows)); each comparison
reports the eval set's standard error of its mean paired difference (the windows are the
same for both arms), to be read against the interval over seeds.

Runs land in `<out>/runs/<arm>-s<seed>/` (`result.json` once done): a later invocation with
the same `--out` and settings skips the runs already there, so parts add up; `--part i/k`
takes the i-th of k chunks of the (seed, arm) grid, seed-major. The tables and
`<out>/quality.json` are always built from every finished run in `<out>`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quality_stats import paired_interval, window_losses  # bench/, beside this file

# ---- arms ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    runner: str
    """`diloco` (local/launcher.py, `ddiloco local`) or `dp` (local/dp_run.py)."""
    quorum_all: bool = False
    """K = M (synchronous DiLoCo); else K = 1."""
    grace: bool = True
    merge: str = "rda"
    merge_scale: str = "contributors"
    """SyncSettings.merge_scale; `live`: each merge averaged over the live set's tokens."""
    chaos: str = "none"
    """A key of CHAOS."""
    hot_spares: int = 0
    """DiLoCo arms: LocalConfig.hot_spares, taking a killed slot at once (`ddiloco local`'s
    default is 1): 0 restarts a killed learner as a fresh process after the delay."""


CHAOS: dict[str, tuple[str, dict[str, float] | None]] = {
    "none": ("none", None),
    "kill+pause": ("kill+pause", {"kill": 120.0, "pause": 90.0}),
    "pause": ("pause", {"pause": 90.0}),
}
"""Chaos name -> (local/chaos.py kind, mean inner steps between events per part)."""
ARMS: dict[str, Arm] = {
    "dp": Arm("dp"),
    "sync_diloco": Arm("diloco", quorum_all=True),
    "decoupled_grace": Arm("diloco"),
    "decoupled_k1": Arm("diloco", grace=False),
    "decoupled_grace_mean": Arm("diloco", merge="mean"),
    "decoupled_grace_chaos": Arm("diloco", chaos="kill+pause"),
    "sync_diloco_pause": Arm("diloco", quorum_all=True, chaos="pause"),
    "decoupled_grace_pause": Arm("diloco", chaos="pause"),
    "decoupled_grace_live": Arm("diloco", merge_scale="live"),
    "decoupled_grace_live_pause": Arm("diloco", merge_scale="live", chaos="pause"),
    "decoupled_grace_live_chaos": Arm("diloco", merge_scale="live", chaos="kill+pause"),
    "decoupled_grace_live_mean": Arm("diloco", merge="mean", merge_scale="live"),
    "decoupled_grace_live_chaos_spare": Arm(
        "diloco", merge_scale="live", chaos="kill+pause", hot_spares=1
    ),
}
DEFAULT_ARMS = ("sync_diloco", "decoupled_grace_live", "decoupled_grace_live_chaos_spare", "dp")
"""The study's winner (merge_scale live and a hot spare, the product defaults) against its
references."""
COMPARISONS: list[tuple[str, str, str]] = [
    ("decoupled_grace_chaos", "sync_diloco", "chaos cost: K=1+grace, kill+pause vs K=M, none"),
    ("decoupled_grace_pause", "sync_diloco_pause", "K=1+grace vs K=M, same pause chaos"),
    ("decoupled_grace", "sync_diloco", "K=1+grace vs K=M, no chaos"),
    ("decoupled_grace", "dp", "decoupled vs data-parallel, no chaos"),
    ("sync_diloco", "dp", "synchronous DiLoCo vs data-parallel, no chaos"),
    ("decoupled_grace_chaos", "decoupled_grace", "kill+pause vs none, K=1+grace"),
    ("decoupled_k1", "decoupled_grace", "no grace vs grace, K=1"),
    ("decoupled_grace_mean", "decoupled_grace", "weighted mean vs RDA, K=1+grace"),
    ("decoupled_grace_live", "decoupled_grace", "merge scale live vs contributors, K=1+grace"),
    ("decoupled_grace_live", "sync_diloco", "K=1+grace, live scale vs K=M, no chaos"),
    ("decoupled_grace_live_pause", "sync_diloco_pause", "K=1+grace live vs K=M, same pause"),
    ("decoupled_grace_live_chaos", "sync_diloco", "chaos cost, live scale: kill+pause vs K=M"),
    ("decoupled_grace_live_mean", "decoupled_grace_live", "weighted mean vs RDA, live scale"),
    (
        "decoupled_grace_live_chaos_spare",
        "sync_diloco",
        "chaos cost, live scale, a hot spare (ddiloco local's default) vs K=M",
    ),
    ("decoupled_grace_live", "dp", "decoupled (live scale) vs data-parallel, no chaos"),
]
"""(arm, reference, what it measures): reported wherever both arms have runs."""
SETTINGS = (
    "model",
    "learners",
    "steps",
    "batch_size",
    "h",
    "inner_lr",
    "outer_lr",
    "outer_momentum",
    "eval_windows",
)
"""The arguments every run of one `--out` must share (stored in <out>/settings.json)."""


def parse_seeds(text: str) -> list[int]:
    """`5` -> 0..4; `3-5` -> 3, 4, 5; `0,2,7` -> those."""
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",")]
        elif "-" in text:
            lo, hi = (int(s) for s in text.split("-", 1))
            seeds = list(range(lo, hi + 1))
        else:
            seeds = list(range(int(text)))
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds: N, A-B or A,B,C; got {text!r}") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seeds must be distinct and >= 0, got {text!r}")
    return seeds


def parse_part(text: str) -> tuple[int, int]:
    """`i/k` -> (i, k), 1 <= i <= k."""
    try:
        i, k = (int(s) for s in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"part must look like 2/4, got {text!r}") from None
    if not 1 <= i <= k:
        raise argparse.ArgumentTypeError(f"part i/k needs 1 <= i <= k, got {text!r}")
    return i, k


def parse_arms(text: str) -> list[str]:
    arms = [a for a in text.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise argparse.ArgumentTypeError(
            f"unknown arm {unknown[0] if unknown else text!r}; arms: {', '.join(ARMS)}"
        )
    return arms


def grid(arms: list[str], seeds: list[int], part: tuple[int, int] | None) -> list[tuple[str, int]]:
    """The (arm, seed) runs of a part: seed-major, so a part finishes whole seeds (pairs)."""
    runs = [(arm, seed) for seed in seeds for arm in arms]
    if part is None:
        return runs
    i, k = part
    return runs[(i - 1) * len(runs) // k : i * len(runs) // k]


def build_config(arm: str, seed: int, args: argparse.Namespace, out: Path) -> Any:
    """The LocalConfig or DPConfig of one run: everything but the method is the same."""
    from ddiloco.local.chaos import make_schedule
    from ddiloco.local.dp_run import DPConfig
    from ddiloco.local.launcher import LocalConfig

    spec = ARMS[arm]
    kind, every = CHAOS[spec.chaos]
    schedule = make_schedule(kind, learners=args.learners, steps=args.steps, seed=seed, every=every)
    common: dict[str, Any] = {
        "learners": args.learners,
        "model": args.model,
        "seed": seed,
        "batch_size": args.batch_size,
        "inner_lr": args.inner_lr,
        "max_steps": args.steps,
        "max_seconds": args.cap_seconds,
        "chaos": kind,
        "schedule": schedule,
        "eval_every": args.eval_every,
        "out": out,
    }
    if spec.runner == "dp":
        return DPConfig(elastic=False, **common)
    return LocalConfig(
        quorum=args.learners if spec.quorum_all else 1,
        grace=spec.grace,
        merge=spec.merge,
        merge_scale=spec.merge_scale,
        h=args.h,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        hot_spares=spec.hot_spares,
        spare_takeover="immediate",
        **common,
    )


# ---- one run ------------------------------------------------------------------------------


def run_one(arm: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Run one arm for one seed in `out`; its figures and the final model's window losses."""
    from ddiloco.local.dp_run import DPRun
    from ddiloco.local.launcher import LocalRun

    cfg = build_config(arm, seed, args, out)
    if ARMS[arm].runner == "dp":
        run: Any = DPRun(cfg)
        report = run.run()
        last = run.evaluator.history[-1] if run.evaluator.history else None
        fresh = last is not None and last[2] == args.steps  # the checkpoint of step N
        merged = report["tokens_computed"]
    else:
        run = LocalRun(cfg)
        report = run.run()
        if ARMS[arm].merge not in report["merge_rules"]:
            raise RuntimeError(f"{arm}: merged by {report['merge_rules']}, not {ARMS[arm].merge}")
        scaled = report["mean_merge_scale"] < 1.0
        if scaled != (ARMS[arm].merge_scale == "live" and args.learners > 1):
            raise RuntimeError(f"{arm}: mean merge scale {report['mean_merge_scale']}")
        hist = run.evaluator.history
        fresh = bool(hist) and hist[-1][2] == run.status.global_version
        merged = report["tokens_merged"]
    task = run.evaluator.task
    expected = args.learners * args.steps * task.tokens_per_batch
    losses = window_losses(task, task.model, args.eval_windows)
    n = len(losses)
    return {
        "arm": arm,
        "seed": seed,
        "eval_loss": statistics.fmean(losses),
        "eval_se": statistics.stdev(losses) / math.sqrt(n),
        "eval_windows": n,
        "parameters": sum(p.numel() for p in task.model.parameters()),
        "eval_loss_in_run": report["eval_loss_final"],
        "eval_loss_initial": report["eval_loss_initial"],
        "tokens": report["tokens_computed"],
        "tokens_expected": expected,
        "budget_met": report["tokens_computed"] == expected,
        "final_model_fresh": fresh,
        "tokens_merged": merged,
        "merged_work_ratio": report["merged_work_ratio"],
        "goodput": report["goodput"],
        "mean_contributors": report.get("mean_contributors"),
        "mean_merge_scale": report.get("mean_merge_scale", 1.0),
        "wall_seconds": report["wall_seconds"],
        "chaos_events_applied": len(report["chaos_applied"]),
        "window_losses": [round(x, 5) for x in losses],
    }


# ---- tables -------------------------------------------------------------------------------


def load_results(out: Path) -> dict[tuple[str, int], dict[str, Any]]:
    results = {}
    for path in sorted((out / "runs").glob("*/result.json")):
        r = json.loads(path.read_text())
        results[(r["arm"], int(r["seed"]))] = r
    return results


def summarize(results: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """Per arm: mean over seeds; per comparison: the paired interval over common seeds."""
    # equal tokens, and the model after the last merges: else the run is not comparable
    usable = {k: r for k, r in results.items() if r["budget_met"] and r["final_model_fresh"]}
    arms: dict[str, Any] = {}
    for arm in ARMS:
        rs = [r for (a, _), r in sorted(usable.items()) if a == arm]
        if not rs:
            continue
        losses = [r["eval_loss"] for r in rs]
        arms[arm] = {
            "seeds": [r["seed"] for r in rs],
            "eval_loss_mean": statistics.fmean(losses),
            "eval_loss_sd": statistics.stdev(losses) if len(rs) > 1 else None,
            "eval_se_mean": statistics.fmean(r["eval_se"] for r in rs),
            "tokens": rs[0]["tokens"],
            "merged_work_ratio": statistics.fmean(r["merged_work_ratio"] for r in rs),
            "goodput": statistics.fmean(r["goodput"] for r in rs),
            "merge_scale": statistics.fmean(r.get("mean_merge_scale", 1.0) for r in rs),
            "wall_seconds": statistics.fmean(r["wall_seconds"] for r in rs),
            "chaos_events": statistics.fmean(r["chaos_events_applied"] for r in rs),
        }
    comparisons = []
    for arm, ref, what in COMPARISONS:
        seeds = sorted({s for a, s in usable if a == arm} & {s for a, s in usable if a == ref})
        if not seeds:
            continue
        a = [usable[(arm, s)]["eval_loss"] for s in seeds]
        b = [usable[(ref, s)]["eval_loss"] for s in seeds]
        # the eval set's error of each seed's difference: the same windows for both arms
        se = [
            statistics.stdev(
                x - y
                for x, y in zip(
                    usable[(arm, s)]["window_losses"],
                    usable[(ref, s)]["window_losses"],
                    strict=True,
                )
            )
            / math.sqrt(usable[(arm, s)]["eval_windows"])
            for s in seeds
        ]
        row: dict[str, Any] = {
            "arm": arm,
            "reference": ref,
            "what": what,
            "seeds": seeds,
            "ratio_minus_1": [x / y - 1 for x, y in zip(a, b, strict=True)],
            "eval_set_se_of_mean_diff": math.sqrt(sum(e * e for e in se)) / len(seeds),
        }
        if len(seeds) >= 2:
            row["diff"] = asdict(paired_interval(a, b))
            row["relative"] = asdict(paired_interval(a, b, relative=True))
        comparisons.append(row)
    return {"arms": arms, "comparisons": comparisons}


def tables(summary: dict[str, Any]) -> str:
    lines = [
        "| arm | seeds | eval loss (mean) | sd over seeds | eval-set SE | tokens | merged work "
        "| goodput | merge scale | chaos events | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, a in summary["arms"].items():
        sd = "-" if a["eval_loss_sd"] is None else f"{a['eval_loss_sd']:.4f}"
        lines.append(
            f"| {arm} | {len(a['seeds'])} | {a['eval_loss_mean']:.4f} | {sd} "
            f"| {a['eval_se_mean']:.4f} | {a['tokens']:,} | {a['merged_work_ratio']:.3f} "
            f"| {a['goodput']:.3f} | {a['merge_scale']:.3f} | {a['chaos_events']:.1f} | {a['wall_seconds']:.0f} |"
        )
    lines += [
        "",
        "| arm | vs | seeds | mean loss ratio - 1 | 95% interval | mean diff | 95% interval "
        "| eval-set SE of diff | per seed (ratio - 1) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in summary["comparisons"]:
        per = ", ".join(f"{r:+.2%}" for r in c["ratio_minus_1"])
        rel, diff = c.get("relative"), c.get("diff")
        mean_r = statistics.fmean(c["ratio_minus_1"])
        ci_r = f"[{rel['low']:+.2%}, {rel['high']:+.2%}]" if rel else "n < 2"
        mean_d = f"{diff['mean']:+.4f}" if diff else "-"
        ci_d = f"[{diff['low']:+.4f}, {diff['high']:+.4f}]" if diff else "n < 2"
        lines.append(
            f"| {c['arm']} | {c['reference']} | {len(c['seeds'])} | {mean_r:+.2%} | {ci_r} "
            f"| {mean_d} | {ci_d} | {c['eval_set_se_of_mean_diff']:.4f} | {per} |"
        )
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arms", type=parse_arms, default=list(DEFAULT_ARMS), help="comma list")
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("5"), help="N, A-B, A,B")
    ap.add_argument(
        "--model", default="tiny", help="a GPT preset (tiny, small, base) or hf:PATH (a config)"
    )
    ap.add_argument("--steps", type=int, default=480, help="inner steps per learner slot, N")
    ap.add_argument("--learners", type=int, default=4, help="M (default 4)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per learner step")
    ap.add_argument("-H", dest="h", type=int, default=24, help="DiLoCo arms: H")
    ap.add_argument("--inner-lr", type=float, default=3e-3)
    ap.add_argument("--outer-lr", type=float, default=1.0, help="DiLoCo arms: eta")
    ap.add_argument("--outer-momentum", type=float, default=0.0, help="DiLoCo arms: mu")
    ap.add_argument("--eval-windows", type=int, default=4096, help="final eval windows")
    ap.add_argument("--eval-every", type=float, default=30.0, help="in-run eval period, s")
    ap.add_argument("--cap-seconds", type=float, default=900.0, help="wall cap per run")
    ap.add_argument("--part", type=parse_part, help="i/k: the i-th of k chunks of the runs")
    ap.add_argument("--report", action="store_true", help="no runs: tables of what is in --out")
    ap.add_argument("--list-arms", action="store_true", help="print the arms and exit")
    ap.add_argument("--out", type=Path, help="default runs/quality-<model>-M<M>-N<steps>")
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from ddiloco.learner import hf
    from ddiloco.learner.model import PRESETS

    if hf.is_hf(args.model):
        # a Hugging Face config (bench/configs/, learner/configs/): an absolute path, since
        # the learners and the stored settings must name the same file from any directory
        name = args.model[len(hf.PREFIX) :]
        if name not in hf.SHIPPED:
            args.model = hf.PREFIX + str(Path(name).expanduser().resolve())
        try:
            hf.model_dir(args.model)
        except (FileNotFoundError, ValueError) as e:
            ap.error(f"--model: {e}")
    elif args.model not in PRESETS:
        ap.error(
            f"--model must be a GPT preset ({', '.join(PRESETS)}) or hf:PATH, got {args.model!r}"
        )
    for name in ("steps", "learners", "batch_size", "h"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_windows < 2:
        ap.error(
            f"--eval-windows must be >= 2 (a standard error needs two), got {args.eval_windows}"
        )
    if args.cap_seconds <= 0:
        ap.error("--cap-seconds must be > 0")


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.list_arms:
        for name, spec in ARMS.items():
            print(f"{name:24s} {spec}")
        return 0
    check_args(ap, args)
    model = Path(args.model.removeprefix("hf:")).stem
    out = args.out or Path("runs") / f"quality-{model}-M{args.learners}-N{args.steps}"
    settings = {k: getattr(args, k) for k in SETTINGS}
    stored = out / "settings.json"
    if args.report and stored.exists():
        settings = json.loads(stored.read_text())  # the tables of what is there, as it was run
    elif stored.exists() and json.loads(stored.read_text()) != settings:
        ap.error(f"{out} holds runs of other settings ({stored.read_text()}); use another --out")
    out.mkdir(parents=True, exist_ok=True)
    stored.write_text(json.dumps(settings))
    started = time.time()
    todo = [] if args.report else grid(args.arms, args.seeds, args.part)
    for k, (arm, seed) in enumerate(todo):
        run_dir = out / "runs" / f"{arm}-s{seed}"
        if (run_dir / "result.json").exists():
            continue
        if run_dir.exists():  # an interrupted run: its step logs would be appended to
            shutil.rmtree(run_dir)
        t = time.time()
        r = run_one(arm, seed, args, run_dir / "run")
        (run_dir / "result.json").write_text(json.dumps(r))
        print(
            f"[{time.time() - started:5.0f}s] {k + 1}/{len(todo)} {arm} seed {seed}: eval loss "
            f"{r['eval_loss']:.4f} +- {r['eval_se']:.4f} (in-run {r['eval_loss_in_run']:.4f}), "
            f"tokens {r['tokens']:,}{'' if r['budget_met'] else ' BUDGET NOT MET'}, "
            f"{r['chaos_events_applied']} chaos events ({time.time() - t:.0f}s)",
            flush=True,
        )
    results = load_results(out)
    summary = summarize(results)
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": settings,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_at_end": os.getloadavg(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
        "elapsed_s": round(time.time() - started, 1),
        "runs_not_meeting_budget": [
            f"{a}-s{s}" for (a, s), r in results.items() if not r["budget_met"]
        ],
        "runs_with_stale_final_model": [
            f"{a}-s{s}" for (a, s), r in results.items() if not r["final_model_fresh"]
        ],
    }
    (out / "quality.json").write_text(json.dumps({"meta": meta, **summary}, indent=1))
    print(f"\n{settings}\n\n{tables(summary)}\n")
    for key in ("runs_not_meeting_budget", "runs_with_stale_final_model"):
        if meta[key]:
            print(f"{key}: {', '.join(meta[key])}")
    print(f"{len(results)} runs in {out}; {out / 'quality.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
