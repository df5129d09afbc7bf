"""Inline SVG charts for the HTML report (local/report_html.py): no script, no library.

    frame = Frame(x_max=60.0, y_lo=2.0, y_hi=5.5)     # data -> pixels, axes and grid
    line_chart([("eval loss", "#264653", [(0, 5.4), (30, 2.6)], 2.0)], x_max=60, y_label="loss")
    esc('<learner "a">')                                # every string from a run goes through it

The charts scale to the page's width (a viewBox); values from a run are escaped, colours and
numbers are ours.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

EVENT_COLORS = {"kill": "#e63946", "kill_sync": "#9d0208", "pause": "#8d99ae"}
"""Vertical lines of chaos events, by action."""


def esc(value: Any) -> str:
    """Text or attribute value from the run, escaped for HTML (quotes included)."""
    return html.escape(str(value), quote=True)


def num(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:,.0f}"


def ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


class Frame:
    """A chart's coordinate frame: data (x, y) to SVG pixels, with axes and grid."""

    W, H, L, R, T, B = 1000, 250, 60, 16, 12, 34

    def __init__(self, x_max: float, y_lo: float, y_hi: float, height: int = 250) -> None:
        self.H = height
        if y_hi <= y_lo:
            y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
        pad = 0.05 * (y_hi - y_lo)
        self.x_max, self.y_lo, self.y_hi = max(x_max, 1e-9), y_lo - pad, y_hi + pad

    def x(self, v: float) -> float:
        v = min(max(v, 0.0), self.x_max)  # the last evaluation comes just after the budget
        return round(self.L + (self.W - self.L - self.R) * v / self.x_max, 1)

    def y(self, v: float) -> float:
        span = self.y_hi - self.y_lo
        return round(self.T + (self.H - self.T - self.B) * (self.y_hi - v) / span, 1)

    def axes(self, y_label: str, x_label: str = "seconds since the learners started") -> str:
        parts = []
        for v in ticks(self.y_lo, self.y_hi):
            y = self.y(v)
            parts.append(
                f'<line x1="{self.L}" x2="{self.W - self.R}" y1="{y}" y2="{y}" stroke="#eee"/>'
                f'<text x="{self.L - 6}" y="{y + 4}" text-anchor="end">{esc(num(v))}</text>'
            )
        for v in ticks(0, self.x_max, 10):
            x = self.x(v)
            parts.append(
                f'<text x="{x}" y="{self.H - self.B + 15}" text-anchor="middle">{esc(num(v))}</text>'
            )
        bottom = self.H - self.B
        parts.append(
            f'<line x1="{self.L}" x2="{self.W - self.R}" y1="{bottom}" y2="{bottom}" stroke="#888"/>'
            f'<line x1="{self.L}" x2="{self.L}" y1="{self.T}" y2="{bottom}" stroke="#888"/>'
            f'<text x="{(self.W + self.L) / 2}" y="{self.H - 4}" text-anchor="middle">{esc(x_label)}</text>'
            f'<text transform="translate(14 {(self.H - self.B) / 2}) rotate(-90)" '
            f'text-anchor="middle">{esc(y_label)}</text>'
        )
        return "".join(parts)

    def svg(self, body: str, label: str) -> str:
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{esc(label)}" '
            f'viewBox="0 0 {self.W} {self.H}" width="100%">{body}</svg>'
        )


def vlines(frame: Frame, events: Sequence[dict[str, Any]]) -> str:
    out = []
    for e in events:
        action = str(e.get("action", ""))
        x = frame.x(float(e.get("applied_at", e.get("at", 0.0))))
        color = EVENT_COLORS.get(action, "#adb5bd")
        out.append(
            f'<line x1="{x}" x2="{x}" y1="{frame.T}" y2="{frame.H - frame.B}" stroke="{color}" '
            f'stroke-dasharray="3 3"><title>{esc(action)} {esc(e.get("target", ""))} at '
            f"{esc(e.get('applied_at', ''))} s</title></line>"
        )
    return "".join(out)


def line_chart(
    series: Sequence[tuple[str, str, Sequence[Sequence[float]], float]],
    *,
    x_max: float,
    y_label: str,
    events: Sequence[dict[str, Any]] = (),
    y_range: tuple[float, float] | None = None,
) -> str:
    """An SVG line chart and its legend. series: (label, color, [(x, y)], stroke width)."""
    ys = [p[1] for _, _, pts, _ in series for p in pts if math.isfinite(p[1])]
    if not ys:
        return '<p class="none">not recorded in this run</p>'
    lo, hi = y_range or (min(ys), max(ys))
    frame = Frame(x_max, lo, hi)
    body = [frame.axes(y_label), vlines(frame, events)]
    legend = []
    for label, color, pts, width in reversed(series):  # the first series is drawn on top
        coords = " ".join(f"{frame.x(p[0])},{frame.y(p[1])}" for p in pts if math.isfinite(p[1]))
        body.append(
            f'<polyline fill="none" stroke="{color}" stroke-width="{width}" points="{coords}">'
            f"<title>{esc(label)}</title></polyline>"
        )
        if len(pts) == 1:
            body.append(
                f'<circle cx="{frame.x(pts[0][0])}" cy="{frame.y(pts[0][1])}" r="3" fill="{color}"/>'
            )
        legend.insert(0, f'<span><i class="sw" style="background:{color}"></i>{esc(label)}</span>')
    if events:
        legend.append(
            '<span><i class="sw" style="background:#e63946"></i>chaos event (grey: a pause)</span>'
        )
    return frame.svg("".join(body), y_label) + f'<div class="legend">{"".join(legend)}</div>'
