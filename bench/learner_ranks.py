"""Tokens/s of one N-rank learner against N separate 1-rank learners, same hardware, one run.

    .venv/bin/python bench/learner_ranks.py --ranks 2 --seconds 40 --json /tmp/ranks.json
    .venv/bin/python bench/learner_ranks.py --ranks 2 --model small --rounds 3 --arms group,separate,single

Arms, each against its own fresh `ddiloco synchronizer` process on loopback, the same model,
per-rank batch, H, P and `--threads` per rank (1 by default, so N ranks fit N cores):

- `group`: one learner, `ddiloco learner --nproc-per-node N` (N ranks in lockstep, DDP over
  gloo on CPU; one join, one set of counters with the tokens of all ranks);
- `separate`: N learners of 1 rank each (N learner slots of one job), started together;
- `single`: one 1-rank learner (what one rank does alone on this machine; not by default).

Arms run one after the other, alternating for `--rounds` rounds (group, separate, group,
separate, ...) so drift of the machine falls on both. Each arm trains for `--seconds`; its
tokens/s is counted over the window where every learner of the arm is past its first
`--skip-s` seconds of steps and none has stopped: the tokens of the inner steps finished in
that window (step logs, `--log-path`; tokens per step from each learner's "stop" record,
which counts all ranks) over its length. The ratio printed is group / separate (1.0: a rank
of a group trains as fast as a learner of its own; below: the all-reduce's cost). When
`ddiloco learner` has no `--nproc-per-node` yet, the group arm is skipped, and said so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ddiloco.learner.sync_client import SyncClient
from ddiloco.local.processes import Child, ddiloco_command, env_with, free_port, terminate_all
from ddiloco.local.report import read_jsonl

TOKEN = "bench-ranks"


def has_nproc() -> bool:
    """Whether this `ddiloco learner` takes `--nproc-per-node`."""
    out = subprocess.run(
        ddiloco_command("learner", "--help"), capture_output=True, text=True, check=False
    )
    return "--nproc-per-node" in out.stdout


def step_times(records: list[dict[str, Any]]) -> list[float]:
    return [r["t"] for r in records if "step" in r and "dt" in r and "event" not in r]


def run_arm(name: str, learners: int, nproc: int, out: Path, args: argparse.Namespace) -> dict:
    """`learners` learner processes of `nproc` ranks each, for `args.seconds`; the figures."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sync = Child(
        "synchronizer",
        ddiloco_command("synchronizer", "--port", str(port), "--state-dir", str(out / "state")),
        env_with(DDILOCO_TOKEN=TOKEN),
        out / "sync.log",
    )
    children = []
    try:
        sync.start()
        probe, deadline = SyncClient(url, TOKEN, timeout=2), time.monotonic() + 60
        while not probe.healthy():
            if not sync.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the synchronizer did not come up ({out})")
            time.sleep(0.1)
        for i in range(learners):
            argv = ddiloco_command(
                "learner",
                "--sync-url",
                url,
                "--learner-id",
                f"l{i}",
                "--learner-index",
                str(i),
                "--num-learners",
                str(learners),
                "--model",
                args.model,
                "--batch-size",
                str(args.batch_size),
                "-H",
                str(args.h),
                "-P",
                str(args.fragments),
                "--threads",
                str(args.threads),
                "--max-seconds",
                str(args.seconds),
                "--log-every",
                "0",
                "--log-path",
                str(out / f"l{i}.jsonl"),
                *(["--nproc-per-node", str(nproc)] if nproc > 1 else []),
            )
            env = env_with(DDILOCO_TOKEN=TOKEN, OMP_NUM_THREADS=str(args.threads))
            children.append(Child(f"l{i}", argv, env, out / f"l{i}.log"))
        for c in children:
            c.start()
        for c in children:
            assert c.proc is not None
            code = c.proc.wait(timeout=args.seconds + 180)
            if code != 0:
                last = c.log_path.read_text().strip().splitlines()[-1:]
                raise RuntimeError(f"{name}: {c.name} exited {code} ({c.log_path}): {last}")
    finally:
        terminate_all([*children, sync])
    logs = [read_jsonl(out / f"l{i}.jsonl") for i in range(learners)]
    stops = [next(r for r in log if r.get("event") == "stop") for log in logs]
    times = [step_times(log) for log in logs]
    lo = max(ts[0] for ts in times) + args.skip_s
    hi = min(ts[-1] for ts in times)
    if hi <= lo:
        raise RuntimeError(f"{name}: no common steady window; run longer than --seconds")
    per_step = [s["tokens"] // s["steps"] for s in stops]
    tokens = sum(k * sum(lo < t <= hi for t in ts) for k, ts in zip(per_step, times, strict=True))
    return {
        "arm": name,
        "learners": learners,
        "ranks_per_learner": nproc,
        "ranks": learners * nproc,
        "window_s": hi - lo,
        "tokens_per_s": tokens / (hi - lo),
        "tokens_per_step": per_step,
        "steps": [s["steps"] for s in stops],
        "mean_step_s": [s["compute_seconds"] / s["steps"] for s in stops],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2, help="N")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("-H", "--h", type=int, default=24)
    ap.add_argument("-P", "--fragments", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--seconds", type=float, default=40.0, help="training time per arm")
    ap.add_argument("--skip-s", type=float, default=5.0, help="warm-up left out of the window")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", default="group,separate")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="ranks-"))
    n = args.ranks
    shapes = {"group": (1, n), "separate": (n, 1), "single": (1, 1)}
    arms = args.arms.split(",")
    unknown = set(arms) - set(shapes)
    if unknown:
        raise SystemExit(f"learner_ranks: unknown arm(s) {sorted(unknown)}: {sorted(shapes)}")
    note = None
    if "group" in arms and not has_nproc():
        arms.remove("group")
        note = "`ddiloco learner` has no --nproc-per-node yet: the group arm was skipped"
        print(note)
    t0 = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for a in list(arms):
            learners, nproc = shapes[a]
            try:
                res = run_arm(a, learners, nproc, out / f"round{r}-{a}", args)
            except RuntimeError as e:
                if a != "group":
                    raise
                note = f"the group arm failed, skipped from here on: {e}"
                print(note, flush=True)
                arms.remove(a)
                del runs[a]
                continue
            runs[a].append(res)
            print(
                f"  round {r} {a:9}: {res['learners']} learner(s) x {res['ranks_per_learner']} "
                f"rank(s): {res['tokens_per_s']:9,.0f} tokens/s over {res['window_s']:.1f} s, "
                f"tokens/step {res['tokens_per_step']}, steps {res['steps']}",
                flush=True,
            )
    summary: dict[str, Any] = {"note": note, "ranks": n, "model": args.model, "runs": runs}
    print(f"\n{args.model}, batch {args.batch_size} per rank, {args.threads} thread(s) per rank")
    for a in arms:
        tps = [x["tokens_per_s"] for x in runs[a]]
        summary[a] = statistics.fmean(tps)
        print(
            f"  {a:9} {summary[a]:9,.0f} tokens/s  (rounds: {', '.join(f'{x:,.0f}' for x in tps)})"
        )
    if "group" in arms and "separate" in arms:
        summary["ratio"] = summary["group"] / summary["separate"]
        print(f"  {n}-rank learner / {n} separate learners = {summary['ratio']:.3f}")
    print(f"wall {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
