"""The wide-area case: a 12B-parameter model over four sites with 2-5 Gbps links.
Predicted speed-up of Decoupled DiLoCo over synchronous data-parallel, and bandwidth per
site, next to the paper's "more than 20x" and "0.84 vs 198 Gbps" (eight data centres).

    .venv/bin/python bench/sim_wide_area.py
    .venv/bin/python bench/sim_wide_area.py --step-s 2 --link-gbps 2,2,2,2

Assumptions (`ddiloco.simulator.network`): one learner per site; inner step compute 5 s
(the same step as the paper-table simulation); data-parallel all-reduces bf16 gradients
every step with a bandwidth-optimal ring over the sites, bottlenecked by the slowest link,
overlapping the whole step (generous to the baseline); Decoupled DiLoCo ships every
fragment up and the merged copy down once per H steps in the background (P = H = 24,
tau = 2), bf16 both ways unless --up-bits says otherwise; latency 35 ms one way.
The sensitivity table below shows how the speed-up moves with the step time and the links.
"""

from __future__ import annotations

import argparse

from ddiloco.simulator.cli import format_wide_area, wide_area_figures
from ddiloco.simulator.config import NetworkConfig
from ddiloco.simulator.network import wide_area


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--step-s", type=float, default=5.0)
    ap.add_argument("--link-gbps", default="2,3,4,5")
    ap.add_argument("--up-bits", type=int, default=16)
    a = ap.parse_args()
    links = tuple(float(x) for x in a.link_gbps.split(","))
    net = NetworkConfig(link_gbps=links, up_bits=a.up_bits)
    print(format_wide_area(wide_area_figures(net, a.step_s, 24, 24, 2)))
    print()
    print("speed-up over synchronous DP by step time (rows) and links (columns):")
    link_sets = {"2-5 Gbps": (2.0, 3.0, 4.0, 5.0), "all 2": (2.0,) * 4, "all 5": (5.0,) * 4}
    print(f"{'step s':>8}" + "".join(f"{k:>12}" for k in link_sets))
    for step in (1.0, 2.0, 5.0, 10.0):
        cells = []
        for ls in link_sets.values():
            f = wide_area(NetworkConfig(link_gbps=ls), step_s=step, fragments=24, H=24, tau=2)
            mark = "*" if f["slowest_link_utilisation"] > 1 else " "
            cells.append(f"{f['speedup']:>10.1f}x{mark}")
        print(f"{step:>8g}" + "".join(cells))
    print(
        "* the slowest link cannot carry Decoupled's bf16 stream at this step time: merges"
        " fall behind (use --up-bits 4 or a larger H)"
    )


if __name__ == "__main__":
    main()
