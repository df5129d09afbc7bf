"""The HTML page of a `ddiloco local` report: one self-contained file next to report.png.

    ddiloco local ...                      # writes <out>/report.html at the end of every run
    ddiloco local report runs/local-x      # rebuilds report.html (and report.png) from report.json
    write_html(report, Path("runs/local-x/report.html"))

Sections: the headline numbers (goodput, merged-work ratio, eval loss, tokens, merges, chaos
events), eval and training loss over time, the learner timeline (incarnations, kills, pauses,
and when each learner's contributions were merged), goodput and merged work over time, and
bandwidth (bytes up and down over time, and per token). The charts are inline SVG (local/svg.py):
no script, no stylesheet or font from the network, so the file opens anywhere, offline. Every
string that comes from the run (learner ids, paths, config values) is HTML-escaped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddiloco.local.svg import Frame, esc, line_chart, num, ticks

COLORS = {"compute": "#2a9d8f", "wait": "#e9c46a", "dead": "#e63946", "paused": "#8d99ae"}
"""The timeline's colors, the same as report.png's (local/plot.py)."""
PALETTE = ["#264653", "#e76f51", "#2a9d8f", "#8338ec", "#f4a261", "#3a86ff", "#6a994e", "#bc4749"]
MIB = 1024 * 1024

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;
max-width:1080px;color:#1d2d35;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#5c6b73}.stats{display:flex;flex-wrap:wrap;gap:10px;margin-top:14px}
.stat{border:1px solid #d8dee2;border-radius:6px;padding:8px 12px;min-width:140px}
.stat .label{font-size:12px;color:#5c6b73}.stat .value{font-size:20px;font-weight:600}
table{border-collapse:collapse;font-size:13px}td,th{padding:3px 10px;border-bottom:1px solid #eee;
text-align:right}td:first-child,th:first-child{text-align:left}
.legend{display:flex;flex-wrap:wrap;gap:14px;font-size:12px;margin:4px 0 0 60px}
.sw{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-2px}
svg text{font:11px system-ui,sans-serif;fill:#3d4b52}.none{color:#8d99ae;font-style:italic}
"""


def _events(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in report.get("chaos_applied") or [] if isinstance(e, dict)]


def timeline(report: dict[str, Any]) -> str:
    """One row per learner: computing / waiting / dead / paused, its incarnations' starts,
    its kills, and ticks where its contributions were merged."""
    learners = report.get("learners") or []
    wall = float(report.get("wall_seconds") or 0.0)
    row_h, top, left, width = 34, 8, 110, 1000
    frame = Frame(wall, 0, 1, height=top + row_h * len(learners) + 40)
    frame.L = left

    def x(v: float) -> float:
        return frame.x(min(max(float(v), 0.0), wall))

    body = []
    for i, learner in enumerate(learners):
        y = top + i * row_h + 8
        lid = esc(learner.get("id", "?"))
        body.append(
            f'<text x="{left - 8}" y="{y + 13}" text-anchor="end">{lid}</text>'
            f'<rect x="{x(0)}" y="{y}" width="{x(wall) - x(0)}" height="18" fill="{COLORS["wait"]}"/>'
        )
        tl = learner.get("timeline") or {}
        for kind in ("compute", "dead", "paused"):
            for a, b in tl.get(kind, []):
                body.append(
                    f'<rect x="{x(a)}" y="{y}" width="{max(0.5, x(b) - x(a))}" height="18" '
                    f'fill="{COLORS[kind]}"><title>{lid} {kind} {a}-{b} s</title></rect>'
                )
        for n, t in enumerate(learner.get("start_times", [])):
            if t >= 0:
                body.append(
                    f'<line x1="{x(t)}" x2="{x(t)}" y1="{y - 4}" y2="{y + 22}" stroke="#1d2d35" '
                    f'stroke-width="2"><title>{lid} incarnation {n + 1} started at {t} s</title></line>'
                )
        for t in learner.get("kill_times", []):
            body.append(
                f'<path d="M{x(t) - 5},{y + 26} l5,-8 l5,8 z" fill="{COLORS["dead"]}">'
                f"<title>{lid} killed at {t} s</title></path>"
            )
        for t, n in learner.get("merged_at", []):
            body.append(
                f'<rect x="{x(t) - 0.75}" y="{y - 6}" width="1.5" height="{min(6, 2 + 2 * n)}" '
                f'fill="#264653"><title>{n} contribution(s) of {lid} merged by {t} s</title></rect>'
            )
    bottom = top + row_h * len(learners) + 4
    for v in ticks(0, wall, 10):
        body.append(f'<text x="{x(v)}" y="{bottom + 14}" text-anchor="middle">{esc(num(v))}</text>')
    body.append(
        f'<text x="{(width + left) / 2}" y="{bottom + 32}" text-anchor="middle">'
        "seconds since the learners started</text>"
    )
    legend = [
        f'<span><i class="sw" style="background:{c}"></i>{k}</span>'
        for k, c in (
            ("computing", COLORS["compute"]),
            ("waiting / starting", COLORS["wait"]),
            ("dead", COLORS["dead"]),
            ("paused", COLORS["paused"]),
        )
    ]
    legend += [
        '<span><i class="sw" style="background:#1d2d35;width:3px"></i>incarnation starts</span>',
        "<span>&#9650; kill</span>",
        '<span><i class="sw" style="background:#264653;width:2px;height:6px"></i>'
        "contributions merged (per status sample)</span>",
    ]
    return (
        frame.svg("".join(body), "learner timeline")
        + f'<div class="legend">{"".join(legend)}</div>'
    )


def _stat(key: str, label: str, value: str) -> str:
    return (
        f'<div class="stat" id="stat-{key}"><div class="label">{esc(label)}</div>'
        f'<div class="value">{esc(value)}</div></div>'
    )


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], table_id: str) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table id="{table_id}"><tr>{head}</tr>{body}</table>'


def _per_token(n: int, tokens: int) -> str:
    return f"{n / tokens:,.1f}" if tokens else "-"


def render(report: dict[str, Any], *, title: str = "ddiloco local report") -> str:
    """The page, as a string."""
    c = report.get("config") or {}
    wall = float(report.get("wall_seconds") or 0.0)
    events = _events(report)
    learners = report.get("learners") or []
    rows = report.get("timeseries") or []
    initial, final = report.get("eval_loss_initial"), report.get("eval_loss_final")
    tokens, merged = report.get("tokens_computed", 0), report.get("tokens_merged", 0)
    up, down = report.get("bytes_up", 0), report.get("bytes_down", 0)
    loss_text = (
        f"{initial:.3f} -> {final:.3f}" if initial is not None and final is not None else "-"
    )
    stats = [
        _stat("goodput", "goodput", f"{report.get('goodput', 0.0):.3f}"),
        _stat("merged-work", "merged-work ratio", f"{report.get('merged_work_ratio', 0.0):.3f}"),
        _stat("eval-loss", "eval loss (initial -> final)", loss_text),
        _stat("tokens", "tokens computed / merged", f"{tokens:,} / {merged:,}"),
        _stat(
            "merges",
            "merges (global version)",
            f"{report.get('merges', 0)} ({report.get('global_version', 0)})",
        ),
        _stat(
            "contributors",
            "mean contributors per merge",
            f"{report.get('mean_contributors', 0.0):.2f}",
        ),
        _stat("merge-scale", "mean merge scale", f"{report.get('mean_merge_scale', 1.0):.3f}"),
        _stat("chaos", "chaos events", str(len(events))),
        _stat("restarts", "learner restarts", str(report.get("learner_restarts", 0))),
        _stat("uptime", "system uptime", f"{report.get('system_uptime', 0.0):.3f}"),
        _stat("bytes", "bytes up / down", f"{up:,} / {down:,}"),
        _stat("wall", "wall seconds", f"{wall:.1f}"),
    ]
    hist = report.get("eval_history") or []
    eval_pts = ([(0.0, initial)] if initial is not None else []) + [(h[0], h[1]) for h in hist]
    loss_series = [("eval loss (global model)", "#1d2d35", eval_pts, 2.5)]
    for i, learner in enumerate(learners):
        pts = learner.get("train_loss") or []
        if pts:
            color = PALETTE[(i + 1) % len(PALETTE)]
            loss_series.append((f"training loss {learner.get('id', '?')}", color, pts, 1.0))
    progress = [
        ("goodput", "#2a9d8f", [(r["t"], r["goodput"]) for r in rows], 2.0),
        ("merged-work ratio", "#264653", [(r["t"], r["merged_work_ratio"]) for r in rows], 2.0),
    ]
    bandwidth = [
        (
            "MiB up (learners -> synchronizer)",
            "#e76f51",
            [(r["t"], r["bytes_up"] / MIB) for r in rows],
            2.0,
        ),
        (
            "MiB down (synchronizer -> learners)",
            "#3a86ff",
            [(r["t"], r["bytes_down"] / MIB) for r in rows],
            2.0,
        ),
    ]
    per_token = [
        ("bytes up per token computed", "#e76f51",
         [(r["t"], r["bytes_up"] / r["tokens_computed"]) for r in rows if r["tokens_computed"]], 2.0),
        ("bytes down per token computed", "#3a86ff",
         [(r["t"], r["bytes_down"] / r["tokens_computed"]) for r in rows if r["tokens_computed"]], 2.0),
    ]  # fmt: skip
    learner_rows = [
        (
            x.get("id", "?"),
            x.get("steps", 0),
            f"{x.get('tokens', 0):,}",
            x.get("contributions", 0),
            x.get("restarts", 0),
            f"{x.get('goodput', 0.0):.3f}",
            x.get("compute_seconds", 0.0),
            x.get("wait_seconds", 0.0),
            x.get("dead_seconds", 0.0),
            x.get("paused_seconds", 0.0),
        )
        for x in learners
    ]
    event_rows = [
        (e.get("applied_at", ""), e.get("action", ""), e.get("target", ""), e.get("delay", ""),
         "yes" if e.get("hot_spare") else "")
        for e in events
    ]  # fmt: skip
    config_line = (
        f"M={c.get('learners')} K={c.get('quorum')} H={c.get('H')} P={c.get('P')} "
        f"grace={c.get('grace')} merge={c.get('merge')} scale={c.get('merge_scale', '-')} "
        f"S={report.get('sync_shards', 1)} updates={c.get('update_encoding', '-')} "
        f"chaos={c.get('chaos')} model={c.get('model_entry') or c.get('model')}"
    )
    fragment_rows = [
        (f.get("index"), f.get("shard", 0), f.get("merge", ""), f.get("version", 0))
        for f in report.get("fragments") or []
    ]
    sections = [
        f"<h1>{esc(title)}</h1>",
        f'<div class="sub">{esc(config_line)}</div>',
        f'<div class="stats" id="headline">{"".join(stats)}</div>',
        '<section id="loss"><h2>Loss</h2>',
        line_chart(loss_series, x_max=wall, y_label="loss", events=events),
        "</section>",
        '<section id="timeline"><h2>Learner timeline</h2>',
        timeline(report) if learners else '<p class="none">no learners</p>',
        _table(
            [
                "learner",
                "steps",
                "tokens",
                "contributions",
                "restarts",
                "goodput",
                "compute s",
                "wait s",
                "dead s",
                "paused s",
            ],
            learner_rows,
            "learners",
        ),
        "</section>",
        '<section id="goodput"><h2>Goodput and merged work over time</h2>',
        line_chart(progress, x_max=wall, y_label="share", events=events, y_range=(0.0, 1.0)),
        "</section>",
        '<section id="bandwidth"><h2>Bandwidth</h2>',
        _table(
            ["", "total bytes", "per token computed", "per token merged"],
            [
                ("up (updates)", f"{up:,}", _per_token(up, tokens), _per_token(up, merged)),
                (
                    "down (fragments)",
                    f"{down:,}",
                    _per_token(down, tokens),
                    _per_token(down, merged),
                ),
            ],
            "bytes",
        ),
        line_chart(bandwidth, x_max=wall, y_label="MiB, cumulative"),
        line_chart(per_token, x_max=wall, y_label="bytes per token"),
        "</section>",
        f'<section id="fragments"><h2>Synchronizer: {report.get("sync_shards", 1)} shard(s), '
        f"{report.get('sync_restarts', 0)} restart(s)</h2>",
        _table(["fragment", "shard", "merge", "final version"], fragment_rows, "fragment-table")
        if fragment_rows
        else '<p class="none">not recorded in this run</p>',
        "</section>",
        '<section id="chaos"><h2>Chaos events</h2>',
        _table(["at s", "action", "target", "back after s", "hot spare"], event_rows, "events")
        if event_rows
        else '<p class="none">none</p>',
        "</section>",
        '<section id="config"><h2>Config</h2>',
        _table(
            ["setting", "value"], sorted((k, json.dumps(v)) for k, v in c.items()), "config-table"
        ),
        "</section>",
    ]
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
        + "\n".join(sections)
        + f'<p class="sub">written by ddiloco local at {esc(generated)}</p></body></html>\n'
    )


def write_html(report: dict[str, Any] | str | Path, out: str | Path) -> Path:
    """Write the page for a report (a dict or a report.json path); returns its path."""
    if not isinstance(report, dict):
        report = json.loads(Path(report).read_text())
    out = Path(out)
    name = out.parent.name or "run"
    out.write_text(render(report, title=f"ddiloco local report: {name}"), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    """`ddiloco local report OUT_DIR`: rebuild report.html and report.png of a finished run."""
    ap = argparse.ArgumentParser(
        prog="ddiloco local report",
        description="Rebuild report.html and report.png from a finished run's report.json.",
    )
    ap.add_argument("out_dir", type=Path, help="the run's directory (holds report.json)")
    ap.add_argument("--no-png", action="store_true", help="only report.html")
    args = ap.parse_args(argv)
    path = args.out_dir / "report.json"
    try:
        report = json.loads(path.read_text())
        if not isinstance(report, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        sys.stderr.write(f"ddiloco local report: error: cannot read {path}: {e}\n")
        return 2
    try:
        page = write_html(report, args.out_dir / "report.html")
        written = [str(page)]
        if not args.no_png:
            from ddiloco.local.plot import plot_report

            written.append(str(plot_report(report, args.out_dir / "report.png")))
    except (KeyError, TypeError, ValueError) as e:
        sys.stderr.write(
            f"ddiloco local report: error: {path} is not a ddiloco local report ({e!r})\n"
        )
        return 2
    sys.stdout.write("wrote " + "  ".join(written) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
