"""The paper's goodput table (Douillard et al. 2026), reproduced by the simulator.

    ddiloco simulate paper-table            # ours next to the paper's, and the max deviation
    ddiloco simulate paper-table --json     # {"dp": {"150k": 0.72, ...}, "elastic_dp": ...}
    .venv/bin/python bench/sim_paper_table.py

Rows: plain data-parallel, elastic data-parallel, Decoupled DiLoCo with M = 2, 4, 8, 16
learners (K = 1); columns: 150k to 2.4M chips; chip MTBI one year.

Assumptions (the defaults of `config.FailureConfig`; one set for all 30 cells, chosen to be
physically sensible, not fitted per cell):
- Each chip fails as an independent Poisson process, mean time between interruptions one
  year (1.2M chips: a failure every 26 s). Only chips in service fail.
- A failure takes its slice of 16 chips out of service. Failed slices come back after an
  exponentiated-Weibull repair time (scale 30 min, shape 0.8, power 2: mean ~50 min,
  long tail). Chips of a slice out for repair still count as allocated.
- Inner step time 5 s for every job (weak scaling: a learner on N/M chips has N/M of the
  batch). A failure is noticed at the end of the step in flight, which completes on the
  surviving slices (an elastic job loses the failed slice's share of it); failures that land
  before that boundary or during the reconfiguration that follows are handled by it.
- Plain data-parallel stops, swaps a spare slice in, reloads and restarts: 85 s.
- Elastic data-parallel, and each Decoupled learner (itself an elastic job): 21 s pause to
  shrink, +2 s of re-planning per further failure during it; repaired slices ride along
  with the next reconfiguration, or after 200 s get a dedicated 30 s regrow pause (adding
  slices means loading the model onto new hosts, slower than dropping some).
- Decoupled DiLoCo with K = 1: learners never wait for each other or for the synchronizer
  (Douillard et al. 2026), so a learner's failure pauses that learner only; merge traffic
  inside a data centre is hidden by the overlap tau.
- 4 simulated days per cell (2.4M chips: ~26k failures), seed 0.

What follows from them, and is not put in: M learners on N chips behave like an elastic job
on N/M chips (the paper's rule of thumb), and no global downtime once M >= 2.
"""

from __future__ import annotations

from typing import Final

from ddiloco.simulator.config import FailureConfig, RunConfig
from ddiloco.simulator.strategies import simulate

COLUMNS: Final[dict[str, int]] = {
    "150k": 150_000,
    "300k": 300_000,
    "600k": 600_000,
    "1.2M": 1_200_000,
    "2.4M": 2_400_000,
}

# row -> (strategy, learners M)
ROWS: Final[dict[str, tuple[str, int]]] = {
    "dp": ("dp", 1),
    "elastic_dp": ("elastic_dp", 1),
    "m2": ("decoupled", 2),
    "m4": ("decoupled", 4),
    "m8": ("decoupled", 8),
    "m16": ("decoupled", 16),
}

ROW_LABELS: Final[dict[str, str]] = {
    "dp": "data-parallel, no elasticity",
    "elastic_dp": "data-parallel, elastic",
    "m2": "Decoupled, M = 2",
    "m4": "Decoupled, M = 4",
    "m8": "Decoupled, M = 8",
    "m16": "Decoupled, M = 16",
}

# the paper's goodput table, goodput with a chip MTBI of one year.
PAPER: Final[dict[str, dict[str, float]]] = {
    "dp": {"150k": 0.72, "300k": 0.57, "600k": 0.38, "1.2M": 0.27, "2.4M": 0.18},
    "elastic_dp": {"150k": 0.88, "300k": 0.80, "600k": 0.69, "1.2M": 0.58, "2.4M": 0.40},
    "m2": {"150k": 0.94, "300k": 0.88, "600k": 0.80, "1.2M": 0.70, "2.4M": 0.54},
    "m4": {"150k": 0.96, "300k": 0.93, "600k": 0.89, "1.2M": 0.82, "2.4M": 0.73},
    "m8": {"150k": 0.98, "300k": 0.96, "600k": 0.94, "1.2M": 0.88, "2.4M": 0.80},
    "m16": {"150k": 0.99, "300k": 0.98, "600k": 0.96, "1.2M": 0.93, "2.4M": 0.86},
}

HORIZON_S: Final[float] = 4 * 86400.0

Table = dict[str, dict[str, float]]


def paper_table(
    fail: FailureConfig | None = None, *, horizon_s: float = HORIZON_S, seed: int = 0
) -> Table:
    """Goodput of every (row, column) cell of the paper's table, as fractions."""
    fail = fail or FailureConfig()
    table: Table = {}
    for row, (strategy, learners) in ROWS.items():
        table[row] = {}
        for col, chips in COLUMNS.items():
            run = RunConfig(
                chips=chips, learners=learners, quorum=1, horizon_s=horizon_s, seed=seed
            )
            table[row][col] = simulate(strategy, run, fail, replay=False).goodput
    return table


def max_deviation(table: Table) -> tuple[float, str, str]:
    """Largest |ours - paper| in goodput points, and the cell where it occurs."""
    worst = (0.0, "", "")
    for row, cols in PAPER.items():
        for col, ref in cols.items():
            dev = abs(table[row][col] - ref) * 100
            if dev > worst[0]:
                worst = (dev, row, col)
    return worst


def format_table(table: Table) -> str:
    """Ours next to the paper's, one row per method, and the max deviation."""
    head = f"{'goodput % (ours / paper)':<30}" + "".join(f"{c:>13}" for c in COLUMNS)
    lines = [head, "-" * len(head)]
    for row in ROWS:
        cells = "".join(
            f"{table[row][c] * 100:>7.1f} / {PAPER[row][c] * 100:<3.0f}" for c in COLUMNS
        )
        lines.append(f"{ROW_LABELS[row]:<30}{cells}")
    dev, row, col = max_deviation(table)
    lines.append("")
    lines.append(f"max deviation: {dev:.2f} points ({ROW_LABELS[row]}, {col} chips)")
    return "\n".join(lines)
