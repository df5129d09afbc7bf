"""Calibration check: replay real `ddiloco local` runs in the simulator and compare the
simulated goodput with the measured one (target: within 5 points on the no-chaos, kill and
slow runs).

    .venv/bin/python bench/sim_calibrate.py /tmp/ddiloco-reports/*.json
    .venv/bin/python bench/sim_calibrate.py --constants-from none.json none.json kill.json slow.json

By default each report's own machine overheads (start-up, restart, per-step hand-over gap)
are measured from it; --constants-from measures them once, on one run, and uses them for
all (a stricter test: the other runs are then predicted, not replayed with their own
constants); a source run without restarts cannot tell the restart overhead, which is then
still measured on each report. The replay never reads the measured compute seconds (`simulator/calibrate.py`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddiloco.simulator.calibrate import calibrate, format_calibration, measure_constants


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--constants-from", type=Path, help="measure overheads on this report only")
    a = ap.parse_args()
    constants = None
    if a.constants_from:
        constants = measure_constants(json.loads(a.constants_from.read_text()))
        print(f"constants from {a.constants_from.name}: {constants}")
    results = [calibrate(p, constants) for p in a.reports]
    print(format_calibration(results))
    worst = max((r.get("deviation_points", 0.0) for r in results), default=0.0)
    print(f"SUMMARY reports={len(results)} max_deviation_points={worst:.2f}")


if __name__ == "__main__":
    main()
