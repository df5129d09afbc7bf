"""Hot spares under kill chaos: `ddiloco local --chaos kill` with and without hot spares.

    .venv/bin/python bench/hot_spares.py --seconds 60 --learners 3 --seed 1 --json /tmp/hs.json
    .venv/bin/python bench/hot_spares.py --arms 0,1,2       # spares per arm (0: none)

Every arm runs the same seed, schedule, learners and duration, one after the other in this one
invocation; they differ only in `hot_spares` (with `spare_takeover` immediate, as `ddiloco
local` runs by default). Per arm it prints the goodput (local/report.py) and, for every kill,
the time from the SIGKILL to the slot's new incarnation's first inner step and to its first
hand-over of a fragment (learner step logs). A hand-over is an upload queued to the
synchronizer; the answer `accepted` follows it within the upload's round trip on loopback
(milliseconds: bench/RESULTS.md, "HTTP/2 upload"), so the hand-over time is the time to the
slot's first accepted update to that precision. Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from ddiloco.local.launcher import LocalConfig, LocalRun
from ddiloco.local.report import read_jsonl


def takeovers(run: LocalRun) -> list[dict[str, Any]]:
    """For each kill: seconds to the slot's next first step and first hand-over."""
    out = []
    for child in run.learners:
        records = read_jsonl(run.learner_log(child.name))
        for t_kill in child.kills:
            start = next(
                (r["t"] for r in records if r.get("event") == "start" and r["t"] > t_kill), None
            )
            if start is None:
                continue
            step = next((r["t"] for r in records if "dt" in r and r["t"] - r["dt"] >= start), None)
            handover = next(
                (r["t"] for r in records if r.get("event") == "handover" and r["t"] > start),
                None,
            )
            hot = any(
                e.get("hot_spare") and e["target"] == child.name and e["action"] == "kill"
                for e in run.applied
                if abs(e["applied_at"] - (t_kill - run.t0)) < 0.5
            )
            out.append(
                {
                    "slot": child.name,
                    "at": round(t_kill - run.t0, 2),
                    "hot_spare": hot,
                    "to_first_step": round(step - t_kill, 2) if step else None,
                    "to_first_handover": round(handover - t_kill, 2) if handover else None,
                }
            )
    return sorted(out, key=lambda r: r["at"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--learners", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--arms", default="0,1", help="hot spares per arm, comma-separated")
    ap.add_argument("--out", type=Path, default=Path("runs") / time.strftime("hot-spares-%H%M%S"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = {}
    for spares in [int(x) for x in args.arms.split(",")]:
        run = LocalRun(
            LocalConfig(
                learners=args.learners,
                max_seconds=args.seconds,
                chaos="kill",
                seed=args.seed,
                hot_spares=spares,
                spare_takeover="immediate",
                out=args.out / f"spares-{spares}",
            )
        )
        report = run.run()
        kills = takeovers(run)
        handovers = [k["to_first_handover"] for k in kills if k["to_first_handover"]]
        results[f"spares_{spares}"] = {
            "goodput": report["goodput"],
            "merged_work_ratio": report["merged_work_ratio"],
            "eval_loss_final": report["eval_loss_final"],
            "restarts": report["learner_restarts"],
            "spares": report["spares"],
            "kills": kills,
            "median_to_first_handover": statistics.median(handovers) if handovers else None,
        }
        print(f"\n== hot spares {spares}: goodput {report['goodput']:.3f}")
        for k in kills:
            print(
                f"  kill {k['slot']} at {k['at']:6.1f}s  hot spare {'yes' if k['hot_spare'] else 'no ':3}"
                f"  first step +{k['to_first_step']}s  first hand-over +{k['to_first_handover']}s"
            )
    print(
        json.dumps(
            {
                k: {x: v[x] for x in ("goodput", "median_to_first_handover")}
                for k, v in results.items()
            }
        )
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
