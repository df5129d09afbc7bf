"""Chaos bench: goodput and quality of Decoupled DiLoCo side by side with data-parallel
baselines, same model, data, seed, batch and wall-clock budget, same chaos schedule.

    .venv/bin/python bench/goodput.py --quick --json /tmp/quick.json       # < 10 min, 2 cores
    .venv/bin/python bench/goodput.py --study headline                      # all five arms
    .venv/bin/python bench/goodput.py --study mixed --seeds 3               # fast + slow half
    .venv/bin/python bench/goodput.py --study rda --learners 8 --seeds 3    # RDA vs plain mean
    .venv/bin/python bench/goodput.py --study scenarios                     # partition, ...

Arms: `sync_dp` (gradients all-reduced every step; a dead or frozen rank stalls everyone),
`elastic_dp` (shrinks at a failure, regrows when the rank is back), `sync_diloco` (K = M),
`decoupled_k1` (K = 1, no grace window), `decoupled_grace` (K = 1 with grace). Suffixes:
`_nochaos` runs the arm without chaos (the quality reference), `_mean` merges by plain
weighted mean instead of RDA. Data-parallel arms run local/dp_run.py, the others
local/launcher.py (`ddiloco local`); both count goodput with local/goodput.py.

Every arm of a group (one scenario, one seed) gets the same schedule and the same number of
pre-warmed spare processes (`--spares`, local/spare.py; 0 restarts killed processes cold).
Eval loss "at equal tokens" is each arm's global-model curve interpolated at the smallest
final token count of its group; "at equal wall time" likewise at the shortest run. Tokens
are tokens of new inner steps (a data-parallel step redone after a rollback counts once).
When a group has `sync_dp_nochaos`, "loss / ref" is each arm's eval loss over that
reference's at the tokens both reached, the quality figure the issue asks for.

It prints one table per group, writes `<out>/results.json`, one plot of eval loss against
time and against tokens per group and a goodput bar chart (`<out>/*.png`), and with
`--json PATH` the `{arm: {goodput, eval_loss_equal_tokens, tokens, ...}}` of the first
group (the whole of `--quick`). Figures and commands of record: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ddiloco.local.chaos import Schedule, make_schedule
from ddiloco.local.dp_run import DPConfig, DPRun
from ddiloco.local.launcher import LocalConfig, LocalRun
from ddiloco.local.report import read_jsonl

BASE_ARMS = ("sync_dp", "elastic_dp", "sync_diloco", "decoupled_k1", "decoupled_grace")
KILL_PAUSE_EVERY = {"kill": 25.0, "pause": 18.0}
"""The bench's kill + pause rates over the whole job: a kill every ~25 s (replacement after a
log-normal delay, median 2 s, capped at 10 s) and a 1-4 s freeze every ~18 s."""
SCENARIOS: dict[str, tuple[str, dict[str, float] | None]] = {
    "kill+pause": ("kill+pause", KILL_PAUSE_EVERY),
    "kill+pause-dense": ("kill+pause", None),  # ddiloco local's default rates: 12 s and 8 s
    "mixed": ("slow", None),
    "straggler": ("straggler", None),
    "partition": ("partition", None),
    "scavenge": ("scavenge", None),
    "sync": ("sync", None),
}
STUDIES: dict[str, tuple[list[str], list[str]]] = {
    "quick": (["kill+pause"], ["sync_dp", "decoupled_grace", "sync_dp_nochaos"]),
    "headline": (["kill+pause"], [*BASE_ARMS, "sync_dp_nochaos"]),
    "mixed": (["mixed"], ["sync_diloco", "decoupled_k1", "decoupled_grace"]),
    "rda": (["none"], ["decoupled_grace", "decoupled_grace_mean"]),
    "scenarios": (
        ["partition", "scavenge", "sync", "straggler", "kill+pause-dense"],
        ["sync_dp", "elastic_dp", "decoupled_grace"],
    ),
}


def run_arm(
    arm: str, schedule: Schedule, args: argparse.Namespace, seed: int, out: Path
) -> dict[str, Any]:
    """Run one arm; return its report plus the curves the comparison needs."""
    base = arm.removesuffix("_nochaos").removesuffix("_mean")
    if base not in BASE_ARMS:
        raise ValueError(f"unknown arm {arm!r}; arms: {', '.join(BASE_ARMS)} (+_nochaos, _mean)")
    if out.exists() and any(out.iterdir()):
        # step logs are appended to: an old run's would be read as this one's
        raise SystemExit(f"{out} holds an earlier run; pass a fresh --out")
    if arm.endswith("_nochaos"):
        schedule = make_schedule("none", learners=args.learners, seconds=args.seconds, seed=seed)
    schedule = Schedule.from_json(schedule.to_json())  # runners consume their copy
    m = args.learners
    # spares only where something dies: elsewhere they would only load the machine
    spares = args.spares if any(e.action in ("kill", "partition") for e in schedule.events) else 0
    common: dict[str, Any] = {  # the same for every arm
        "learners": m,
        "seed": seed,
        "batch_size": args.batch_size,
        "inner_lr": args.inner_lr,
        "max_seconds": args.seconds,
        "chaos": schedule.kind,
        "schedule": schedule,
        "hot_spares": spares,
        "eval_every": args.eval_every,
        "out": out,
    }
    if base.endswith("_dp"):
        run: Any = DPRun(DPConfig(elastic=base == "elastic_dp", **common))
        report = run.run()
        curve = [(t, loss, tokens) for t, loss, _, tokens in report["eval_history"]]
        staleness = 0.0
    else:
        run = LocalRun(
            LocalConfig(
                quorum=m if base == "sync_diloco" else 1,
                grace=base != "decoupled_k1",
                merge="mean" if arm.endswith("_mean") else "rda",
                h=args.h,
                outer_lr=args.outer_lr,
                outer_momentum=args.outer_momentum,
                **common,
            )
        )
        report = run.run()
        want = "mean" if arm.endswith("_mean") else "rda"
        if want not in report["merge_rules"]:  # an arm that ran another arm's code is void
            raise RuntimeError(f"{arm}: synchronizer merged by {report['merge_rules']}, not {want}")
        curve = decoupled_curve(run, report)
        staleness = float(run.status.mean_staleness)
    tokens = int(report["tokens_computed"])
    wall = float(report["wall_seconds"])
    return {
        "arm": arm,
        "goodput": report["goodput"],
        "merged_work_ratio": report["merged_work_ratio"],
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1) if wall else 0.0,
        "bytes_wire": int(report["bytes_up"]) + int(report["bytes_down"]),
        "mean_contributors": report["mean_contributors"],
        "merge_rules": report.get("merge_rules", []),
        "mean_staleness": round(staleness, 3),
        "eval_loss_initial": report["eval_loss_initial"],
        "eval_loss_final": report["eval_loss_final"],
        "restarts": report["learner_restarts"],
        "spares": report.get("spares"),
        "wall_seconds": wall,
        "curve": [(0.0, report["eval_loss_initial"], 0), *curve],
        "out": str(out),
    }


def decoupled_curve(run: LocalRun, report: dict[str, Any]) -> list[tuple[float, float, int]]:
    """(seconds, eval loss, tokens of new steps computed by then) for a `ddiloco local` run."""
    tpb = run.evaluator.task.tokens_per_batch
    ends = sorted(
        r["t"] - run.t0
        for child in run.learners
        for r in read_jsonl(run.learner_log(child.name))
        if "dt" in r and "step" in r and run.t0 <= r["t"] <= run.t_end
    )
    out = []
    for t, loss, _ in report["eval_history"]:
        done = sum(1 for e in ends if e <= t)
        out.append((t, loss, done * tpb))
    return out


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Linear interpolation of (x, y) points sorted by x; clamped at both ends."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return pts[-1][1]


REFERENCE = "sync_dp_nochaos"
"""The quality reference: data-parallel without chaos."""


def compare(group: dict[str, dict[str, Any]]) -> None:
    """Add eval loss at the group's equal tokens and equal wall time to every arm, and,
    when the group has the reference arm, each arm's eval loss over the reference's at the
    tokens both reached (pairwise: the group's equal tokens are the slowest arm's)."""
    tokens = min(a["tokens"] for a in group.values())
    wall = min(max(t for t, _, _ in a["curve"]) for a in group.values())
    ref = group.get(REFERENCE)
    for a in group.values():
        if ref is not None:
            both = min(a["tokens"], ref["tokens"])
            mine = interpolate([(tok, loss) for _, loss, tok in a["curve"]], both)
            theirs = interpolate([(tok, loss) for _, loss, tok in ref["curve"]], both)
            a["reference_tokens"] = both
            a["eval_loss_vs_reference"] = round(mine / theirs, 4)
        a["equal_tokens"] = tokens
        a["equal_wall_s"] = round(wall, 2)
        a["eval_loss_equal_tokens"] = round(
            interpolate([(tok, loss) for _, loss, tok in a["curve"]], tokens), 4
        )
        a["eval_loss_equal_wall"] = round(
            interpolate([(t, loss) for t, loss, _ in a["curve"]], wall), 4
        )


COLUMNS = [
    ("arm", "arm", "{}"),
    ("goodput", "goodput", "{:.3f}"),
    ("merged_work_ratio", "merged work", "{:.3f}"),
    ("eval_loss_equal_tokens", "loss @tokens", "{:.4f}"),
    ("eval_loss_equal_wall", "loss @wall", "{:.4f}"),
    ("tokens", "tokens", "{:,}"),
    ("tokens_per_s", "tok/s", "{:,.0f}"),
    ("bytes_wire", "MB wire", "{}"),
    ("mean_contributors", "contrib/merge", "{:.2f}"),
    ("mean_staleness", "staleness", "{:.2f}"),
    ("eval_loss_vs_reference", "loss / ref", "{:.3f}"),
    ("restarts", "restarts", "{}"),
]


def table(group: dict[str, dict[str, Any]], title: str) -> str:
    """A markdown table of one group."""
    head = "| " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines = [f"**{title}**", "", head, "|" + "---|" * len(COLUMNS)]
    for a in group.values():
        cells = []
        for key, _, fmt in COLUMNS:
            v = a.get(key)
            if key == "bytes_wire":
                v = f"{v / 1e6:.1f}"
            cells.append(fmt.format(v) if v is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    any_arm = next(iter(group.values()))
    lines.append(
        f"\nequal tokens = {any_arm['equal_tokens']:,}; equal wall = {any_arm['equal_wall_s']} s"
    )
    if REFERENCE in group:
        lines.append(
            f"loss / ref: eval loss over {REFERENCE}'s at the tokens both reached "
            "(the smaller final token count of the two)"
        )
    return "\n".join(lines)


def plot(groups: dict[str, dict[str, dict[str, Any]]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, group in groups.items():
        fig, (ax_t, ax_k) = plt.subplots(1, 2, figsize=(11, 4))
        for arm, a in group.items():
            ax_t.plot([t for t, _, _ in a["curve"]], [x for _, x, _ in a["curve"]], label=arm)
            ax_k.plot([k / 1e3 for _, _, k in a["curve"]], [x for _, x, _ in a["curve"]], label=arm)
        ax_t.set(xlabel="seconds", ylabel="eval loss (global model)", title=name)
        ax_k.set(xlabel="thousand tokens of new steps", ylabel="eval loss", title=name)
        ax_t.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"loss-{name.replace('/', '-')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * sum(len(g) for g in groups.values())), 4))
    labels, values = [], []
    for name, group in groups.items():
        for arm, a in group.items():
            labels.append(f"{arm}\n{name}")
            values.append(a["goodput"])
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.set_xticks(range(len(values)), labels, rotation=60, ha="right", fontsize=7)
    ax.set(ylabel="goodput", ylim=(0, 1))
    fig.tight_layout()
    path = out / "goodput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [*paths, path]


def summarize(groups: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Mean and spread over seeds, per scenario and arm."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for name, group in groups.items():
        scenario = name.rsplit("/seed", 1)[0]
        for arm, a in group.items():
            by.setdefault((scenario, arm), []).append(a)
    out: dict[str, dict[str, Any]] = {}
    for (scenario, arm), runs in by.items():
        row: dict[str, Any] = {"seeds": len(runs)}
        for key in ("goodput", "eval_loss_equal_tokens", "eval_loss_equal_wall", "tokens"):
            vals = [float(r[key]) for r in runs]
            row[key] = round(statistics.fmean(vals), 4)
            row[key + "_sd"] = round(statistics.stdev(vals), 4) if len(vals) > 1 else 0.0
        out.setdefault(scenario, {})[arm] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="the 3-arm kill + pause subset")
    ap.add_argument("--study", choices=sorted(STUDIES), default="headline")
    ap.add_argument("--arms", help="comma-separated arms instead of the study's")
    ap.add_argument("--scenarios", help="comma-separated scenarios instead of the study's")
    ap.add_argument("--learners", type=int, default=4, help="M (default 4)")
    ap.add_argument("--seconds", type=float, default=60.0, help="wall budget per arm")
    ap.add_argument("--seeds", type=int, default=1, help="seeds 0..n-1 (default 1)")
    ap.add_argument("--spares", type=int, default=2, help="hot spare processes per arm")
    ap.add_argument("--eval-every", type=float, default=5.0)
    d = LocalConfig
    ap.add_argument(
        "--inner-lr", type=float, default=d.inner_lr, help=f"every arm: AdamW lr ({d.inner_lr})"
    )
    ap.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help=f"every arm: sequences per learner (or rank) step ({d.batch_size})",
    )
    ap.add_argument("-H", dest="h", type=int, default=d.h, help=f"DiLoCo arms: H ({d.h})")
    ap.add_argument(
        "--outer-lr", type=float, default=d.outer_lr, help=f"DiLoCo arms: eta ({d.outer_lr})"
    )
    ap.add_argument(
        "--outer-momentum",
        type=float,
        default=d.outer_momentum,
        help=f"DiLoCo arms: mu ({d.outer_momentum})",
    )
    ap.add_argument("--out", type=Path, help="default runs/bench-<time>")
    ap.add_argument("--json", type=Path, help="write {arm: metrics} of the first group here")
    args = ap.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(name)s %(message)s")
    study = "quick" if args.quick else args.study
    scenarios, arms = STUDIES[study]
    if args.scenarios:
        scenarios = args.scenarios.split(",")
    if args.arms:
        arms = args.arms.split(",")
    out = args.out or Path("runs") / time.strftime(f"bench-{study}-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    for scenario in scenarios:
        kind, every = SCENARIOS.get(scenario, (scenario, None))
        for seed in range(args.seeds):
            schedule = make_schedule(
                kind, learners=args.learners, seconds=args.seconds, seed=seed, every=every
            )
            name = f"{scenario}/seed{seed}"
            group: dict[str, dict[str, Any]] = {}
            for arm in arms:
                t = time.time()
                group[arm] = run_arm(arm, schedule, args, seed, out / scenario / f"{arm}-s{seed}")
                print(
                    f"[{time.time() - started:6.0f}s] {name} {arm}: goodput "
                    f"{group[arm]['goodput']:.3f} loss {group[arm]['eval_loss_final']:.4f} "
                    f"tokens {group[arm]['tokens']:,} ({time.time() - t:.0f}s)",
                    flush=True,
                )
            compare(group)
            groups[name] = group
            print("\n" + table(group, f"{name}, M={args.learners}") + "\n", flush=True)
    elapsed = time.time() - started
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "study": study,
        "learners": args.learners,
        "seconds": args.seconds,
        "spares": args.spares,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "load_average_at_end": os.getloadavg(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
        "elapsed_s": round(elapsed, 1),
    }
    summary = summarize(groups) if args.seeds > 1 else None
    if summary:
        print(json.dumps(summary, indent=1))
    (out / "results.json").write_text(
        json.dumps({"meta": meta, "groups": groups, "summary": summary}, indent=1)
    )
    pngs = plot(groups, out)
    if args.json:
        first = next(iter(groups.values()))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {arm: {k: v for k, v in a.items() if k != "curve"} for arm, a in first.items()},
                indent=1,
            )
        )
    print(
        f"done in {elapsed:.0f}s; results {out / 'results.json'}; plots {', '.join(map(str, pngs))}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
