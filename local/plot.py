"""The PNG of a `ddiloco local` report: eval loss over time, and a per-learner timeline.

python -c "from ddiloco.local.plot import plot_report; plot_report('runs/x/report.json', 'x.png')"
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the headless backend

COLORS = {"compute": "#2a9d8f", "wait": "#e9c46a", "dead": "#e63946", "paused": "#8d99ae"}


def plot_report(report: dict[str, Any] | str | Path, out: str | Path) -> Path:
    if not isinstance(report, dict):
        report = json.loads(Path(report).read_text())
    wall = report["wall_seconds"]
    fig, (ax_loss, ax_tl) = plt.subplots(
        2,
        1,
        figsize=(10, 3.2 + 0.35 * len(report["learners"])),
        gridspec_kw={"height_ratios": [3, 2]},
    )
    hist = report["eval_history"]
    xs = [0.0] + [h[0] for h in hist]
    ys = [report["eval_loss_initial"]] + [h[1] for h in hist]
    ax_loss.plot(xs, ys, marker="o", ms=3, color="#264653")
    ax_loss.set_xlim(0, wall)
    ax_loss.set_ylabel("eval loss (global model)")
    c = report["config"]
    ax_loss.set_title(
        f"ddiloco local: M={c['learners']} K={c['quorum']} grace={c['grace']} merge={c['merge']} "
        f"chaos={c['chaos']} | goodput {report['goodput']:.2f} | merged work {report['merged_work_ratio']:.2f}"
    )
    for kill in report.get("chaos_applied", []):
        ax_loss.axvline(
            kill["applied_at"],
            color=COLORS["dead"] if "kill" in kill["action"] else COLORS["paused"],
            lw=0.8,
            alpha=0.6,
        )
    for row, learner in enumerate(report["learners"]):
        ax_tl.broken_barh([(0, wall)], (row - 0.4, 0.8), color=COLORS["wait"])
        for kind in ("compute", "dead", "paused"):
            spans = [(a, b - a) for a, b in learner["timeline"][kind]]
            ax_tl.broken_barh(spans, (row - 0.4, 0.8), color=COLORS[kind])
    ax_tl.set_yticks(range(len(report["learners"])), [x["id"] for x in report["learners"]])
    ax_tl.set_xlim(0, wall)
    ax_tl.set_xlabel("seconds since the learners started")
    handles = [plt.Rectangle((0, 0), 1, 1, color=v) for v in COLORS.values()]
    labels = ["computing", "waiting / starting", "dead", "paused"]
    ax_tl.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, frameon=False
    )
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
