"""A synchronizer's `Status` (GET /v1/status) as rich tables: `ddiloco status` and `ddiloco local`.

    view = StatusView()
    view.update(status)                    # each new sample; tokens/s comes from two of them
    console.print(view.render(status, title="my-job"))

What it shows, all read from the one status answer:

* a summary line: the token budget's progress and the time left (a job with a budget),
  goodput, merged-work ratio (tokens merged / tokens the learner slots report
  having computed, the synchronizer's own figure), global version and merges, mean
  contributors and staleness, refusals by reason,
  bytes up and down;
* fragments: index, merge rule, version, contributions and tokens pending in the open round,
  tokens merged;
* learners: id, state, incarnation, step, tokens/s, share of the merged contributions, loss,
  seconds since it was last heard from.

State is what the synchronizer can tell: `alive` (heard from recently) or `dead`; it cannot tell
a learner that finished its budget from one that died. `ddiloco local` knows its processes and
passes its own states (up, paused, done, dead) and columns (restarts) in. Tokens/s is the change
of the learner's reported tokens over the change of its reported uptime between two samples
that differ (both come from its heartbeats, so their ratio does not jitter with the sampling);
before a second sample, tokens per compute second (tokens_total / compute_seconds).
No torch here: the status CLI stays quick to start.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ddiloco.wire.protocol import LearnerStatus, Status


@dataclass
class _Seen:
    incarnation: int
    tokens: int
    uptime: float
    rate: float | None = None
    """Tokens per second between the last two samples that differed."""


class StatusView:
    """Renders statuses and remembers each learner's last sample (for tokens/s)."""

    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}

    def update(self, status: Status) -> None:
        """Take a new sample: a learner whose reported uptime moved gets a fresh tokens/s."""
        for ls in status.learners:
            prev = self._seen.get(ls.learner_id)
            if prev is None or prev.incarnation != ls.incarnation:
                self._seen[ls.learner_id] = _Seen(
                    ls.incarnation, ls.tokens_total, ls.uptime_seconds
                )
                continue
            du, dt = ls.uptime_seconds - prev.uptime, ls.tokens_total - prev.tokens
            if du > 0 and dt >= 0:
                prev.rate, prev.tokens, prev.uptime = dt / du, ls.tokens_total, ls.uptime_seconds
            elif du < 0 or dt < 0:  # a restored record: start over from here
                self._seen[ls.learner_id] = _Seen(
                    ls.incarnation, ls.tokens_total, ls.uptime_seconds
                )

    def tokens_per_second(self, ls: LearnerStatus) -> float | None:
        seen = self._seen.get(ls.learner_id)
        if seen is not None and seen.incarnation == ls.incarnation and seen.rate is not None:
            return seen.rate
        return ls.tokens_total / ls.compute_seconds if ls.compute_seconds > 0 else None

    def render(
        self,
        status: Status,
        *,
        title: str = "",
        caption: str | None = None,
        states: Mapping[str, str] | None = None,
        extra: Mapping[str, Mapping[str, str]] | None = None,
        learners: Sequence[str] = (),
    ) -> Group:
        """Summary, fragments and learners. `states` overrides a learner's state, `extra` adds
        columns (name -> learner id -> cell), `learners` are ids to show even before they
        joined (shown as `-`)."""
        parts: list[Text | Table] = []
        if title:
            parts.append(Text(title, style="bold"))
        parts.append(Text(summary_line(status)))
        if status.fragments:
            parts.append(fragments_table(status))
        parts.append(self.learners_table(status, states=states, extra=extra, learners=learners))
        if caption:
            parts.append(Text(caption))
        return Group(*parts)

    def learners_table(
        self,
        status: Status,
        *,
        states: Mapping[str, str] | None = None,
        extra: Mapping[str, Mapping[str, str]] | None = None,
        learners: Sequence[str] = (),
    ) -> Table:
        extra = extra or {}
        t = Table(title="learners", title_justify="left")
        t.add_column("learner")
        t.add_column("state")
        for col in ("inc", "step", "tokens/s", "share", "loss", "seen", *extra):
            t.add_column(col, justify="right")
        by_id = {ls.learner_id: ls for ls in status.learners}
        ids = list(dict.fromkeys([*learners, *by_id]))
        shares = contribution_shares(status)
        for lid in ids:
            ls = by_id.get(lid)
            state = (states or {}).get(lid) or (
                "-" if ls is None else "alive" if ls.alive else "dead"
            )
            cells = [lid, state]
            if ls is None:
                cells += ["-"] * 6
            else:
                cells += [
                    str(ls.incarnation),
                    str(ls.step),
                    _num(self.tokens_per_second(ls), "{:,.0f}"),
                    _num(shares.get(lid), "{:.1%}"),
                    _num(ls.loss, "{:.3f}"),
                    "never" if ls.last_seen_s < 0 else f"{ls.last_seen_s:.1f}s",
                ]
            cells += [extra[col].get(lid, "") for col in extra]
            t.add_row(*cells)
        return t


def contribution_shares(status: Status) -> dict[str, float]:
    """Each learner's share of the merged work: of the tokens merged when the status carries
    them per learner, else of the merged contributions."""
    merged: dict[str, int] = {}
    for ls in status.learners:  # a per-learner tokens_merged, where the synchronizer has one
        value = getattr(ls, "tokens_merged", None)
        if isinstance(value, int):
            merged[ls.learner_id] = value
    if len(merged) == len(status.learners) and sum(merged.values()) > 0:
        total = sum(merged.values())
        return {k: v / total for k, v in merged.items()}
    total_c = sum(ls.contributions for ls in status.learners)
    if total_c <= 0:
        return {}
    return {ls.learner_id: ls.contributions / total_c for ls in status.learners}


def summary_line(status: Status) -> str:
    live = sum(ls.alive for ls in status.learners)
    refusals = ", ".join(f"{k} {v}" for k, v in sorted(status.refusals.items()) if v) or "none"
    parts = [
        f"goodput {_num(status.goodput, '{:.3f}')}",
        f"merged work {_num(status.merged_work_ratio, '{:.3f}')}",
        f"global version {status.global_version} ({status.merges} merges)",
        f"contributors/merge {status.mean_contributors:.2f}",
        f"staleness {status.mean_staleness:.2f}",
        f"learners {live}/{len(status.learners)} alive",
        f"refusals {refusals}",
        f"bytes up {_bytes(status.bytes_up)} down {_bytes(status.bytes_down)}",
    ]
    if budget := budget_text(status):
        parts.insert(0, budget)
    if not status.initialized:
        parts.insert(0, "not initialized yet")
    return "  ".join(parts)


def budget_text(status: Status) -> str:
    """The job's token budget: progress and the time left ("" without a budget)."""
    total = status.total_tokens
    if total <= 0:
        return ""
    if status.finished:
        return f"budget reached: {status.tokens_merged:,} of {total:,} tokens merged (finished)"
    progress = status.progress or 0.0
    left = status.estimated_remaining_seconds
    return f"budget {progress:.1%} of {total:,} tokens, {_duration(left)} left"


def _duration(seconds: float | None) -> str:
    """`~1h02m`, `~3m05s`, `~12s`, or `?` before a rate is known."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = round(seconds)
    if s >= 3600:
        return f"~{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"~{s // 60}m{s % 60:02d}s"
    return f"~{s}s"


def fragments_table(status: Status) -> Table:
    t = Table(title="fragments", title_justify="left")
    sharded = status.shards > 1  # which shard owns each (synchronizer/shards.py)
    t.add_column("fragment", justify="right")
    if sharded:
        t.add_column("shard", justify="right")
    t.add_column("merge")
    for col in ("version", "pending", "pending tokens", "tokens merged"):
        t.add_column(col, justify="right")
    for f in status.fragments:
        t.add_row(
            str(f.index),
            *([str(f.shard)] if sharded else []),
            f.merge,
            str(f.version),
            str(f.contributors_pending),
            f"{f.tokens_pending:,}",
            f"{f.tokens_merged:,}",
        )
    return t


def _num(value: float | None, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return fmt.format(value)


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
