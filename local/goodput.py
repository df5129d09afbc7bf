"""Goodput accounting (the definition every figure uses), shared by `ddiloco local` and the baselines.

    spans = new_step_spans(records)                       # [(start, end)] of new inner steps
    busy = busy_seconds(spans, held=(t0, t1), idle=pauses)
    goodput(busy_by_slot, held_by_slot)                   # sum(busy) / sum(held)

A slot's busy time is the part of its step spans that lies inside the time it held its
allocation and outside the times it was frozen: a SIGSTOP almost always lands inside a step,
and that step's wall-clock duration then includes the pause, which is idle time, not work.
Steps recomputed after a rollback count once: a record `{"event": "start", "resume_step":
s}` (a data-parallel group restarted from its checkpoint at step s) drops every earlier
step numbered above s, because that work is done again. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

Span = tuple[float, float]


def new_step_spans(records: Iterable[dict[str, Any]]) -> list[Span]:
    """(start, end) of every step record (`t` = end, `dt` = duration) that was not redone
    after a rollback, in log order."""
    kept: list[tuple[int, Span]] = []
    for r in records:
        if r.get("event") == "start" and "resume_step" in r:
            resume = int(r["resume_step"])
            kept = [(step, span) for step, span in kept if step <= resume]
        elif "dt" in r and "step" in r:
            kept.append((int(r["step"]), (r["t"] - r["dt"], r["t"])))
    return [span for _, span in kept]


def union(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint spans covering the same time as `spans`."""
    out: list[Span] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap(a: Span, spans: Sequence[Span]) -> float:
    """Seconds of `a` covered by the disjoint `spans`."""
    return sum(max(0.0, min(a[1], b) - max(a[0], s)) for s, b in spans)


def busy_seconds(spans: Iterable[Span], held: Span, idle: Iterable[Span] = ()) -> float:
    """Seconds of `spans` inside `held` and outside every `idle` span."""
    work = union(spans)
    frozen = union(idle)
    total = 0.0
    for a, b in work:
        a, b = max(a, held[0]), min(b, held[1])
        if b > a:
            total += (b - a) - overlap((a, b), frozen)
    return total


def goodput(busy: Sequence[float], held: Sequence[float]) -> float:
    """sum(busy) / sum(held) over the slots; 0 when nothing was held."""
    total = sum(held)
    if len(busy) != len(held):
        raise ValueError(f"busy and held must pair up: {len(busy)} != {len(held)}")
    return sum(busy) / total if total > 0 else 0.0
