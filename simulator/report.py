"""Tables and PNG plots of simulator results (matplotlib, no display needed).

    ddiloco simulate paper-table --plot goodput.png
    ddiloco simulate run --chips 1200000 --learners 8 --plot learners.png

`format_runs` prints several strategies' results side by side; `plot_paper_table` draws our
goodput against the paper's for every row; `plot_learners` draws each learner's goodput.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddiloco.simulator.paper import COLUMNS, PAPER, ROW_LABELS, ROWS, Table
from ddiloco.simulator.strategies import SimResult


def run_summary(r: SimResult, extra: dict[str, float] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "strategy": r.strategy,
        "chips": r.chips,
        "learners": r.learners,
        "quorum": r.quorum,
        "goodput": round(r.goodput, 4),
        "uptime": round(r.uptime, 4),
        "merged_work_ratio": round(r.merged_work_ratio, 4),
        "effective_goodput": round(r.effective_goodput, 4),
        "failures": r.failures,
        "pauses": r.pauses,
        "simulated_days": round(r.horizon_s / 86400, 3),
    }
    if r.protocol is not None:
        out["merges"] = r.protocol.merges
        out["late_updates"] = r.protocol.late_updates
        out["refused_updates"] = r.protocol.refused_updates
    out.update(extra or {})
    return out


FRACTIONS = ("goodput", "uptime", "merged_work_ratio", "effective_goodput")


def format_runs(rows: list[dict[str, Any]]) -> str:
    keys = [k for r in rows for k in r if k != "strategy"]
    keys = list(dict.fromkeys(keys))
    width = max(len(k) for k in keys) + 2
    lines = [f"{'':<{width}}" + "".join(f"{r['strategy']:>14}" for r in rows)]
    for k in keys:
        cells = []
        for r in rows:
            v = r.get(k, "-")
            if isinstance(v, float):
                cells.append(f"{v:>14.1%}" if k in FRACTIONS else f"{v:>14.4g}")
            else:
                cells.append(f"{v!s:>14}")
        lines.append(f"{k:<{width}}" + "".join(cells))
    return "\n".join(lines)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_paper_table(table: Table, path: str | Path) -> Path:
    """Goodput against fleet size, ours (solid) and the paper's (dashed), one colour per row."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = list(COLUMNS.values())
    for i, row in enumerate(ROWS):
        colour = f"C{i}"
        ax.plot(
            x, [table[row][c] * 100 for c in COLUMNS], "-o", color=colour, label=ROW_LABELS[row]
        )
        ax.plot(x, [PAPER[row][c] * 100 for c in COLUMNS], "--x", color=colour, alpha=0.6)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(x, list(COLUMNS))
    ax.set_xlabel("chips (MTBI one year per chip)")
    ax.set_ylabel("goodput %")
    ax.set_title("goodput: simulated (solid) vs paper (dashed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_learners(results: list[SimResult], path: str | Path) -> Path:
    """Per-learner goodput of each simulated strategy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(results):
        xs = [
            i + (k + 0.5) / max(len(r.learner_goodput), 1) - 0.5
            for k in range(len(r.learner_goodput))
        ]
        ax.bar(
            xs,
            [g * 100 for g in r.learner_goodput],
            width=0.9 / max(len(r.learner_goodput), 1),
            color=f"C{i}",
        )
    ax.set_xticks(range(len(results)), [r.strategy for r in results])
    ax.set_ylabel("goodput % per learner (or job)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
