"""The run over time: what `ddiloco local` samples while it trains, and the series it reports.

    sampler = StatusSampler(run.client(timeout=5.0), t0=run.t0, evaluator=ev, sinks=[tb])
    sampler.start()                  # GET /v1/status every second, in a thread
    sampler.stop(); sampler.sample_once(final_status, at=run.t_end)
    sampler.samples                  # [{"t": 3.0, "version": 12, "tokens_merged": ..., ...}]
    rows = timeseries(sampler.samples, records, t0=..., tokens_per_step=..., held=..., idle=...)

A sample is the synchronizer's own count (versions, tokens merged, bytes, per-learner
contributions and last training loss); `timeseries` puts next to each one the goodput and the
merged-work ratio *as the report defines them* (local/report.py, local/goodput.py) up to that
moment, from the learners' step logs, so the last row is the report's headline figure. Sinks
(local/tensorboard.py) see every evaluation of the global model and every sample as it
happens, and the finished report at the end.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from ddiloco.learner.sync_client import SyncClient, SyncRefused, SyncUnavailable
from ddiloco.local.goodput import Span, new_step_spans, overlap, union

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Where the run's numbers go while it runs (times are seconds since the run's t0)."""

    def start(self, t0: float, initial_loss: float | None) -> None: ...
    def eval(self, t: float, loss: float, version: int) -> None: ...
    def sample(self, sample: dict[str, Any]) -> None: ...
    def finish(self, report: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class StatusSampler:
    """Polls the synchronizer's status every `every_s` seconds; a synchronizer that is away
    (chaos `sync`) leaves a gap, not an error. Also forwards the evaluator's new
    measurements to the sinks, so that every sink call comes from this one thread."""

    def __init__(
        self,
        client: SyncClient,
        *,
        t0: float,
        evaluator: Any = None,
        sinks: Sequence[Sink] = (),
        every_s: float = 1.0,
    ) -> None:
        self.client = client
        self.t0 = t0
        self.evaluator = evaluator
        self.sinks = list(sinks)
        self.every_s = every_s
        self.samples: list[dict[str, Any]] = []
        self._evals_seen = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        initial = evaluator.initial_loss if evaluator is not None else None
        self._each("start", t0, initial)

    def _each(self, method: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as e:  # a sink must never stop the run
                log.warning(
                    "%s sink failed in %s (%s); it is off now", type(sink).__name__, method, e
                )
                self.sinks.remove(sink)

    def _forward_evals(self) -> None:
        history = self.evaluator.history if self.evaluator is not None else []
        new = history[self._evals_seen :]  # the evaluator may append meanwhile
        self._evals_seen += len(new)
        for t, loss, version in new:
            self._each("eval", t - self.t0, loss, version)

    def sample_once(self, status: Any = None, *, at: float | None = None) -> dict[str, Any] | None:
        """One sample now (or of a status already fetched, dated `at`); None while the
        synchronizer is away."""
        with self._lock:
            self._forward_evals()
            if status is None:
                try:
                    status = self.client.status()
                except (SyncUnavailable, SyncRefused) as e:
                    log.debug("Status sample skipped: %s", e)
                    return None
            now = time.time() if at is None else at
            sample = {
                "t": round(now - self.t0, 3),
                "version": status.global_version,
                "merges": status.merges,
                "tokens_merged": status.tokens_merged,
                "bytes_up": status.bytes_up,
                "bytes_down": status.bytes_down,
                "contributions": {x.learner_id: x.contributions for x in status.learners},
                "loss": {x.learner_id: x.loss for x in status.learners if x.loss is not None},
                "step": {x.learner_id: x.step for x in status.learners},
            }
            self.samples.append(sample)
            self._each("sample", sample)
            return sample

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample_once()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ddiloco-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def finish(self, report: dict[str, Any]) -> None:
        """Hand the finished report to the sinks and close them."""
        self._each("finish", report)
        self._each("close")
        self.client.close()


class BusyClock:
    """A slot's busy seconds (local/goodput.busy_seconds) up to any moment, in O(log n)."""

    def __init__(self, spans: Sequence[Span], held: Span, idle: Sequence[Span] = ()) -> None:
        self.held = held
        self.frozen = union(idle)
        self.work = [(max(a, held[0]), min(b, held[1])) for a, b in union(spans)]
        self.work = [(a, b) for a, b in self.work if b > a]
        self.starts = [a for a, _ in self.work]
        self.before = [0.0]  # busy seconds of all spans before span i
        for a, b in self.work:
            self.before.append(self.before[-1] + (b - a) - overlap((a, b), self.frozen))

    def until(self, t: float) -> float:
        i = bisect.bisect_right(self.starts, t)  # spans starting at or before t
        if i == 0:
            return 0.0
        a, b = self.work[i - 1]
        b = min(b, t)
        return self.before[i - 1] + (b - a) - overlap((a, b), self.frozen)


def timeseries(
    samples: Sequence[dict[str, Any]],
    records: dict[str, list[dict[str, Any]]],
    *,
    t0: float,
    t1: float,
    tokens_per_step: int,
    held: dict[str, Span],
    idle: dict[str, Sequence[Span]],
) -> list[dict[str, Any]]:
    """One row per sample: its counts, plus tokens computed, merged-work ratio and goodput
    up to that moment. `records`: each learner's step log; `held` and `idle`: each slot's
    held span and its paused spans (absolute times, as local/report.py computes them)."""
    step_ends = sorted(
        r["t"] for recs in records.values() for r in recs if "dt" in r and "step" in r
    )
    clocks = {
        lid: BusyClock(new_step_spans(recs), held[lid], idle.get(lid, ()))
        for lid, recs in records.items()
    }
    rows = []
    for k, s in enumerate(samples):
        last = k == len(samples) - 1
        at = min(t0 + s["t"], t1)
        # the last row counts every step the report counts (those logged on the way out too)
        computed = tokens_per_step * (
            len(step_ends) if last else bisect.bisect_right(step_ends, at)
        )
        busy = sum(c.until(at) for c in clocks.values())
        held_s = sum(max(0.0, min(at, b) - a) for a, b in held.values())
        rows.append(
            {
                "t": round(at - t0, 3),
                "version": s["version"],
                "merges": s["merges"],
                "tokens_merged": s["tokens_merged"],
                "tokens_computed": computed,
                "merged_work_ratio": round(s["tokens_merged"] / computed, 4) if computed else 0.0,
                "goodput": round(busy / held_s, 4) if held_s > 0 else 0.0,
                "bytes_up": s["bytes_up"],
                "bytes_down": s["bytes_down"],
            }
        )
    return rows


def merged_at(samples: Sequence[dict[str, Any]], lid: str) -> list[tuple[float, int]]:
    """When a learner's contributions were merged: (t, how many since the previous sample)."""
    out, before = [], 0
    for s in samples:
        n = s["contributions"].get(lid, before)
        if n > before:
            out.append((s["t"], n - before))
        before = max(before, n)
    return out


def thin(points: Sequence[tuple[float, float]], most: int = 300) -> list[tuple[float, float]]:
    """At most `most` points: the means of consecutive runs of points (a smoothed curve)."""
    if len(points) <= most:
        return [(round(t, 3), round(v, 5)) for t, v in points]
    size = len(points) / most
    out = []
    for i in range(most):
        chunk = points[int(i * size) : int((i + 1) * size)] or points[-1:]
        out.append(
            (
                round(sum(p[0] for p in chunk) / len(chunk), 3),
                round(sum(p[1] for p in chunk) / len(chunk), 5),
            )
        )
    return out
