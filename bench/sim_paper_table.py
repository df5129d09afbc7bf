"""The paper's goodput table (Douillard et al. 2026, the goodput table) reproduced by `ddiloco simulate`, side by
side with the paper's numbers, and the largest deviation.

    .venv/bin/python bench/sim_paper_table.py                 # seed 0, 4 simulated days/cell
    .venv/bin/python bench/sim_paper_table.py --seeds 0 1 2   # the spread across seeds
    .venv/bin/python bench/sim_paper_table.py --plot goodput.png

Assumptions (one set for all 30 cells; `ddiloco.simulator.paper` and `config.FailureConfig`):
- every chip fails as an independent Poisson process, MTBI one year; only chips in service
  fail; a failure takes its 16-chip slice out until repaired (exponentiated Weibull: scale
  30 min, shape 0.8, power 2; mean about 50 min, long tail);
- inner step 5 s for every job (weak scaling); a failure is noticed at the end of the step in
  flight, which completes on the surviving slices; failures before that boundary or during
  the reconfiguration that follows are handled by that reconfiguration;
- plain data-parallel: stop, swap a spare slice in, reload, restart: 85 s;
- elastic data-parallel and every Decoupled learner (an elastic job of N/M chips): shrink
  pause 21 s (+2 s re-planning per failure landing in it); repaired slices join the next
  reconfiguration, or after 200 s get their own 30 s regrow pause;
- Decoupled DiLoCo, K = 1: a learner's pause stalls only that learner (no barrier), and the
  merge traffic inside a data centre is hidden by the overlap tau.

The table is goodput only, so it skips the protocol replay that decides the merged-work
ratio (`ddiloco simulate run` reports that one).
"""

from __future__ import annotations

import argparse
import time

from ddiloco.simulator.paper import HORIZON_S, format_table, max_deviation, paper_table


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--horizon-days", type=float, default=HORIZON_S / 86400)
    ap.add_argument("--plot", help="write a PNG of the first seed's table here")
    a = ap.parse_args()
    for i, seed in enumerate(a.seeds):
        t0 = time.perf_counter()
        table = paper_table(horizon_s=a.horizon_days * 86400, seed=seed)
        took = time.perf_counter() - t0
        print(f"seed {seed}, {a.horizon_days:g} simulated days per cell, {took:.1f} s")
        print(format_table(table))
        print()
        if i == 0 and a.plot:
            from ddiloco.simulator.report import plot_paper_table

            print(f"plot: {plot_paper_table(table, a.plot)}")
        dev, row, col = max_deviation(table)
        print(f"SUMMARY seed={seed} max_deviation_points={dev:.2f} cell={row}/{col}")
        print()


if __name__ == "__main__":
    main()
