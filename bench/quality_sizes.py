"""The gap to data-parallel against model size, from quality.py out dirs.

    .venv/bin/python bench/quality.py --arms decoupled_grace_live,dp --seeds 5 --steps 180 \\
        --out runs/size-tiny                       # and --model small / hf:PATH, other --out
    .venv/bin/python bench/quality_sizes.py runs/size-tiny runs/size-small runs/size-llama \\
        --png runs/gap-vs-size.png

Each dir is one model size (its settings.json names the model). For each, the paired
comparison of `--arm` against `--reference` (default: decoupled K = 1 + grace with the live
merge scale against data-parallel) over the seeds both hold, as quality.py computes it: the
mean ratio - 1 with its 95% interval. Printed as a markdown table, ordered by parameters,
with a text plot; `--png` also draws it (log parameters, the interval as an error bar) and
`--json` writes the rows. The parameter count is that of the model built from the stored
settings (the same builder the learners use), so it needs no field in the runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from quality import load_results, summarize  # bench/, beside this file


def parameters(model: str) -> int:
    from ddiloco.learner import hf
    from ddiloco.learner.model import build_model

    m = hf.build_model(model) if hf.is_hf(model) else build_model(model)
    return sum(p.numel() for p in m.parameters())


def size_row(out: Path, arm: str, reference: str) -> dict[str, Any]:
    """One model size: its model, parameters, both arms' mean losses and the paired gap."""
    settings = json.loads((out / "settings.json").read_text())
    summary = summarize(load_results(out))
    comp = next(
        (c for c in summary["comparisons"] if (c["arm"], c["reference"]) == (arm, reference)),
        None,
    )
    if comp is None or "relative" not in comp:
        raise SystemExit(f"{out}: no paired runs of {arm} against {reference} (2 seeds at least)")
    model = settings["model"]
    return {
        "out": str(out),
        "model": Path(model.removeprefix("hf:")).stem if model.startswith("hf:") else model,
        "parameters": parameters(model),
        "tokens": summary["arms"][arm]["tokens"],
        "seeds": comp["seeds"],
        "reference_loss": summary["arms"][reference]["eval_loss_mean"],
        "arm_loss": summary["arms"][arm]["eval_loss_mean"],
        "gap": comp["relative"]["mean"],
        "low": comp["relative"]["low"],
        "high": comp["relative"]["high"],
        "per_seed": comp["ratio_minus_1"],
    }


def table(rows: list[dict[str, Any]], arm: str, reference: str) -> str:
    lines = [
        f"| model | parameters | tokens per run | seeds | {reference} | {arm} | gap (ratio - 1) "
        "| 95% interval | per seed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per = ", ".join(f"{x:+.2%}" for x in r["per_seed"])
        lines.append(
            f"| {r['model']} | {r['parameters']:,} | {r['tokens']:,} | {len(r['seeds'])} "
            f"| {r['reference_loss']:.4f} | {r['arm_loss']:.4f} | {r['gap']:+.2%} "
            f"| [{r['low']:+.2%}, {r['high']:+.2%}] | {per} |"
        )
    return "\n".join(lines)


def text_plot(rows: list[dict[str, Any]], width: int = 48) -> str:
    """Gap (rows) against log parameters (columns): `*` the mean, `-` the interval's span."""
    logs = [math.log10(r["parameters"]) for r in rows]
    lo, hi = min(logs), max(logs)
    lines = []
    for r, x in zip(rows, logs, strict=True):
        col = 0 if hi == lo else round((x - lo) / (hi - lo) * (width - 1))
        lines.append(
            f"{r['gap']:+6.2%} [{r['low']:+6.2%}, {r['high']:+6.2%}] |{' ' * col}*  "
            f"{r['model']} ({r['parameters']:,})"
        )
    lines.append(" " * 26 + "+" + "-" * width + " parameters (log)")
    return "\n".join(lines)


def draw(rows: list[dict[str, Any]], path: Path, arm: str, reference: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["parameters"] for r in rows]
    ys = [100 * r["gap"] for r in rows]
    err = [
        [100 * (r["gap"] - r["low"]) for r in rows],
        [100 * (r["high"] - r["gap"]) for r in rows],
    ]
    ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=4)
    for r, x, y in zip(rows, xs, ys, strict=True):
        ax.annotate(f" {r['model']}", (x, y))
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel(f"eval loss: {arm} / {reference} - 1 (%)")
    ax.set_title("gap to data-parallel at equal tokens (mean, 95% interval over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("outs", nargs="+", type=Path, help="quality.py --out dirs, one per size")
    ap.add_argument("--arm", default="decoupled_grace_live")
    ap.add_argument("--reference", default="dp")
    ap.add_argument("--png", type=Path, help="also draw the plot here")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    missing = [str(o) for o in args.outs if not (o / "settings.json").exists()]
    if missing:
        ap.error(f"not quality.py out dirs (no settings.json): {', '.join(missing)}")
    rows = sorted(
        (size_row(o, args.arm, args.reference) for o in args.outs), key=lambda r: r["parameters"]
    )
    print(table(rows, args.arm, args.reference))
    print()
    print(text_plot(rows))
    if args.png:
        draw(rows, args.png, args.arm, args.reference)
        print(f"\n{args.png}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
