"""Prometheus metrics of the synchronizer: instruments observed where things happen, and
gauges read from its status at scrape time.

    curl -s http://127.0.0.1:8470/metrics | grep ddiloco_
    DDILOCO_METRICS=0 ddiloco synchronizer ...      # off: /metrics answers 404

`SyncMetrics` owns one `CollectorRegistry` per synchronizer (never the process-wide default
one: tests run several synchronizers in one process). Its instruments are observed by the
service as events happen: every merge observes each per-fragment histogram exactly once
(merge duration, the round's first contribution to quorum and to publish, the grace window,
contributors), and every merged contribution its staleness; every accepted update its size
and bytes by wire encoding; every fragment served its bytes. `StatusCollector` turns the
`Status` snapshot into gauges and the durable counters (they survive a restart, as the
ledger does). With metrics off the instruments are no-ops (nothing is counted) and
`enabled` is False, which the route turns into a 404. docs/operations.md "Metrics" lists every name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ddiloco.wire.protocol import Status

if TYPE_CHECKING:
    from ddiloco.synchronizer.contribution import Contribution
    from ddiloco.synchronizer.merge import MergeOutcome
    from ddiloco.synchronizer.rounds import Round

SECONDS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
)
ROUND_SECONDS: Final = (
    *(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5),
    *(5.0, 10.0, 30.0, 60.0, 300.0),
)
"""Round times: finer between 0.25 and 2.5 s, where a merge's time sits against tau x step
(bench/sync_ingest.py reads the quantiles from these buckets)."""
CONTRIBUTORS: Final = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
STALENESS: Final = (0, 1, 2, 3, 4, 6, 8, 16, 32)
BYTES: Final = tuple(float(1 << k) for k in range(10, 34, 2))  # 1 KiB .. 8 GiB, x4
ENCODINGS: Final = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
"""Safetensors dtype -> the `encoding` label (codec.ST_DTYPES are the wire dtypes)."""

QUANTIZED_CODES: Final = {"I8": "int8", "U8": "int4"}
"""The safetensors dtype of a quantized update's codes -> its label (wire/encodings.py:
int8 codes are I8, int4 codes packed in U8; their float32 scales do not make it `mixed`)."""


def encoding_of(dtypes: Iterable[str]) -> str:
    """The `encoding` label of a payload from its tensors' safetensors dtypes: `bf16`,
    `fp32`, `fp16`, `int8`, `int4` (codes with their float32 scales), or `mixed`."""
    seen = set(dtypes)
    codes = {QUANTIZED_CODES[d] for d in seen if d in QUANTIZED_CODES}
    if len(codes) == 1 and seen - set(QUANTIZED_CODES) <= {"F32"}:
        return codes.pop()
    names = {ENCODINGS.get(d, d.lower()) for d in seen}
    if len(names) == 1:
        return names.pop()
    return "mixed" if names else "none"


class _Noop:
    """Stands in for every instrument when metrics are off: costs one call, counts nothing."""

    def labels(self, *_: Any, **__: Any) -> _Noop:
        return self

    def observe(self, *_: Any) -> None:
        return None

    def inc(self, *_: Any) -> None:
        return None

    def set(self, *_: Any) -> None:
        return None

    def time(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


NOOP: Final = _Noop()


class SyncMetrics:
    """The synchronizer's instruments and the registry `render` exposes. `status` is called
    at scrape time (`StatusCollector`); `protocols` are the HTTP requests by (scheme,
    version) that app.py's middleware counts (`watch_protocols`)."""

    def __init__(self, status: Callable[[], Status], *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.registry = CollectorRegistry(auto_describe=False)
        self._protocols: Mapping[tuple[str, str], int] = {}
        self._uploads: Mapping[tuple[str, str], int] = {}
        if not enabled:
            self.merge_duration = self.merge_phase = self.round_quorum = NOOP
            self.file_write = NOOP
            self.round_publish = self.round_close = NOOP
            self.round_served = NOOP
            self.grace_window = self.merge_contributors = self.update_staleness = NOOP
            self.update_bytes = self.updates_accepted = self.learner_tokens_merged = NOOP
            self.bytes_received = self.bytes_served = NOOP
            self.checkpoints = NOOP
            return
        r = self.registry
        frag = ["fragment"]
        self.merge_duration: Any = Histogram(
            "ddiloco_merge_duration_seconds",
            "Time to compute one merge of a fragment (merge math and persisting it)",
            frag,
            registry=r,
            buckets=SECONDS,
        )
        self.merge_phase: Any = Histogram(
            "ddiloco_merge_phase_seconds",
            "Each part of ddiloco_merge_duration_seconds: compute (merge math), encode (the "
            "served copy, made while the merge's journal record or fragment file is fsynced), "
            "durable (what that fsync took beyond the encode), install (waiting for the "
            "fragment's lock and swapping the served version in), finish (letting go of what "
            "the merge took)",
            ["phase"],
            registry=r,
            buckets=SECONDS,
        )
        self.file_write: Any = Histogram(
            "ddiloco_fragment_file_write_seconds",
            "Writing one fragment's file (Theta and momentum): by the background writer, or "
            "by a merge (its file would trail more than snapshot_lag merges: raise it, or "
            "give the disk more bandwidth, if these are many)",
            ["by"],
            registry=r,
            buckets=SECONDS,
        )
        for by in ("background", "merge"):
            self.file_write.labels(by)  # both series, at 0, from the start
        self.round_quorum: Any = Histogram(
            "ddiloco_round_quorum_seconds",
            "A merged round's first accepted contribution to its quorum",
            frag,
            registry=r,
            buckets=ROUND_SECONDS,
        )
        self.round_publish: Any = Histogram(
            "ddiloco_round_publish_seconds",
            "A merged round's first accepted contribution to its merged fragment being served",
            frag,
            registry=r,
            buckets=ROUND_SECONDS,
        )
        self.round_served: Any = Histogram(
            "ddiloco_round_served_seconds",
            "A merged round's quorum to its merged fragment being served (grace window, "
            "merge and persisting it)",
            frag,
            registry=r,
            buckets=ROUND_SECONDS,
        )
        self.round_close: Any = Histogram(
            "ddiloco_round_close_served_seconds",
            "A merged round's close (its grace window's end, or every live learner in) to its "
            "merged fragment being served: the synchronizer's own part of quorum to served",
            frag,
            registry=r,
            buckets=ROUND_SECONDS,
        )
        self.grace_window: Any = Histogram(
            "ddiloco_grace_window_seconds",
            "Grace window granted after a merged round's quorum (Eq. 3)",
            frag,
            registry=r,
            buckets=(0.0, *SECONDS),
        )
        self.merge_contributors: Any = Histogram(
            "ddiloco_merge_contributors",
            "Contributions per merge",
            frag,
            registry=r,
            buckets=CONTRIBUTORS,
        )
        self.update_staleness: Any = Histogram(
            "ddiloco_update_staleness",
            "Versions behind the fragment of each merged contribution",
            registry=r,
            buckets=STALENESS,
        )
        self.update_bytes: Any = Histogram(
            "ddiloco_update_bytes", "Body size of each accepted update", registry=r, buckets=BYTES
        )
        self.updates_accepted: Any = Counter(
            "ddiloco_updates_accepted", "Updates accepted (duplicates not counted)", registry=r
        )
        self.learner_tokens_merged: Any = Counter(
            "ddiloco_learner_tokens_merged",
            "Tokens of a learner's merged contributions, averaged over fragments "
            "(they sum to ddiloco_tokens_merged_total)",
            ["learner"],
            registry=r,
        )
        self.bytes_received: Any = Counter(
            "ddiloco_bytes_received",
            "Accepted update bytes in, by wire encoding",
            ["encoding"],
            registry=r,
        )
        self.bytes_served: Any = Counter(
            "ddiloco_bytes_served", "Fragment bytes out, by wire encoding", ["encoding"], registry=r
        )
        self.checkpoints: Any = Counter(
            "ddiloco_checkpoints",
            "Checkpoint attempts (synchronizer/checkpoints.py), by outcome: written or failed",
            ["outcome"],
            registry=r,
        )
        r.register(StatusCollector(status))
        r.register(ProtocolCollector(self))

    def merged(
        self,
        p: int,
        r: Round[Contribution],
        outcome: MergeOutcome,
        t_merge: float,
        now: float,
        fragments: int,
        base: int,
        phases: Mapping[str, float] | None = None,
        served: float | None = None,
    ) -> None:
        """Fragment p's round `r` merged at version `base` (started at `t_merge`, done at
        `now`) and served since `served` (its install, before the merge lets go of its
        inputs; None: `now`): each per-fragment histogram observes it once, so their counts
        are the fragment's merges (`phases`: seconds of each part of the merge, by name); each
        merged contribution its staleness and its tokens, per fragment (every fragment sees
        every token)."""
        if not self.enabled:
            return
        frag = str(p)
        at = now if served is None else served
        started = r.started_at if r.started_at is not None else at
        self.merge_duration.labels(frag).observe(now - t_merge)
        for phase, seconds in (phases or {}).items():
            self.merge_phase.labels(phase).observe(seconds)
        self.round_quorum.labels(frag).observe(max(0.0, (r.quorum_at or started) - started))
        self.round_publish.labels(frag).observe(max(0.0, at - started))
        self.round_served.labels(frag).observe(max(0.0, at - (r.quorum_at or started)))
        self.round_close.labels(frag).observe(max(0.0, at - (r.due_at or t_merge)))
        self.grace_window.labels(frag).observe(r.grace)
        self.merge_contributors.labels(frag).observe(outcome.contributors)
        items = list(r.contributions.items())
        for i in outcome.included:
            learner_id, c = items[i]
            self.update_staleness.observe(base - c.base_version)
            self.learner_tokens_merged.labels(learner_id).inc(c.tokens / max(1, fragments))

    def watch_protocols(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Export these request counts as ddiloco_http_requests_total (app.py's middleware)."""
        self._protocols = counts

    def protocols(self) -> Mapping[tuple[str, str], int]:
        return dict(self._protocols)

    def watch_uploads(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Export the upload port's answers by (scheme, status code) as
        ddiloco_upload_port_requests_total (upload_port.py counts them)."""
        self._uploads = counts

    def uploads(self) -> Mapping[tuple[str, str], int]:
        return dict(self._uploads)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything (blocks: call it off the loop)."""
        if not self.enabled:
            raise RuntimeError("metrics are off (DDILOCO_METRICS=0)")
        return generate_latest(self.registry)


class StatusCollector(Collector):
    """Turns one `Status` snapshot into metric families; no state of its own."""

    def __init__(self, status: Callable[[], Status]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        s = self.status()
        yield GaugeMetricFamily(
            "ddiloco_global_version", "Sum of fragment versions", value=s.global_version
        )
        yield CounterMetricFamily("ddiloco_merges", "Fragment merges", value=s.merges)
        yield CounterMetricFamily(
            "ddiloco_tokens_merged", "Tokens behind merged contributions", value=s.tokens_merged
        )
        yield CounterMetricFamily(
            "ddiloco_contributions_merged", "Contributions merged", value=s.contributions_merged
        )
        yield CounterMetricFamily(
            "ddiloco_contributions_rejected", "Updates refused", value=s.contributions_rejected
        )
        refusals = CounterMetricFamily(
            "ddiloco_refusals", "Requests refused, by reason", labels=["reason"]
        )
        for reason, n in sorted(s.refusals.items()):
            refusals.add_metric([reason], n)
        yield refusals
        yield CounterMetricFamily(
            "ddiloco_merges_refused", "Merges refused as non-finite", value=s.merges_refused
        )
        pending = GaugeMetricFamily(
            "ddiloco_tokens_pending", "Accepted tokens waiting in open rounds", labels=["fragment"]
        )
        waiting = GaugeMetricFamily(
            "ddiloco_contributions_pending",
            "Contributions waiting in each fragment's open round",
            labels=["fragment"],
        )
        for f in s.fragments:
            pending.add_metric([str(f.index)], f.tokens_pending)
            waiting.add_metric([str(f.index)], f.contributors_pending)
        yield pending
        yield waiting
        yield CounterMetricFamily("ddiloco_bytes_up", "Update bytes received", value=s.bytes_up)
        yield CounterMetricFamily("ddiloco_bytes_down", "Fragment bytes served", value=s.bytes_down)
        yield GaugeMetricFamily(
            "ddiloco_mean_contributors", "Mean contributors per merge", value=s.mean_contributors
        )
        if s.goodput is not None:
            yield GaugeMetricFamily(
                "ddiloco_goodput", "Learner compute time / uptime", value=s.goodput
            )
        if s.merged_work_ratio is not None:
            yield GaugeMetricFamily(
                "ddiloco_merged_work_ratio",
                "Tokens merged / tokens computed by all learners (as they report them)",
                value=s.merged_work_ratio,
            )
        if s.progress is not None:  # a token budget is set (budget.py)
            yield GaugeMetricFamily(
                "ddiloco_job_progress_ratio",
                "Tokens merged / the job's token budget (1 once finished)",
                value=s.progress,
            )
        if s.estimated_remaining_seconds is not None:
            yield GaugeMetricFamily(
                "ddiloco_job_remaining_seconds",
                "Time until the token budget is merged, at the recent merged-token rate",
                value=s.estimated_remaining_seconds,
            )
        if s.evaluation is not None:  # an evaluator posted one (evaluations.py)
            ev = s.evaluation
            yield GaugeMetricFamily(
                "ddiloco_eval_loss", "Held-out loss of the global model, latest", value=ev.loss
            )
            yield GaugeMetricFamily(
                "ddiloco_eval_perplexity", "e^ddiloco_eval_loss", value=ev.perplexity
            )
            yield GaugeMetricFamily(
                "ddiloco_eval_global_version",
                "Global version the latest eval loss was measured at",
                value=ev.global_version,
            )
            yield GaugeMetricFamily(
                "ddiloco_eval_timestamp_seconds",
                "When the latest evaluation arrived (Unix time)",
                value=ev.time,
            )
        live = GaugeMetricFamily("ddiloco_learners_live", "Learners heard from recently")
        live.add_metric([], sum(1 for learner in s.learners if learner.alive))
        yield live
        versions = GaugeMetricFamily(
            "ddiloco_fragment_version", "Version of each fragment", labels=["fragment"]
        )
        for f in s.fragments:
            versions.add_metric([str(f.index)], f.version)
        yield versions
        steps = GaugeMetricFamily(
            "ddiloco_learner_step", "Latest local step of each learner", labels=["learner"]
        )
        tokens = GaugeMetricFamily(
            "ddiloco_learner_tokens",
            "Tokens each learner slot reports having computed (all its incarnations)",
            labels=["learner"],
        )
        for learner in s.learners:
            steps.add_metric([learner.learner_id], learner.step)
            tokens.add_metric([learner.learner_id], learner.tokens_computed)
        yield steps
        yield tokens
        for key, value in s.xi.items():
            if value is not None:
                yield GaugeMetricFamily(
                    f"ddiloco_xi_{key}_seconds", f"Moving average of xi_{key}", value=value
                )


class ProtocolCollector(Collector):
    """HTTP requests served, by scheme (http, https) and HTTP version (1.1, 2)."""

    def __init__(self, source: SyncMetrics | Mapping[tuple[str, str], int]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        counts = self.source.protocols() if isinstance(self.source, SyncMetrics) else self.source
        family = CounterMetricFamily(
            "ddiloco_http_requests",
            "HTTP requests served, by scheme and HTTP version",
            labels=["scheme", "version"],
        )
        for (scheme, version), n in sorted(dict(counts).items()):
            family.add_metric([scheme, version], n)
        yield family
        if isinstance(self.source, SyncMetrics):
            uploads = CounterMetricFamily(
                "ddiloco_upload_port_requests",
                "Requests the upload port answered (also counted in ddiloco_http_requests), "
                "by scheme and status code",
                labels=["scheme", "code"],
            )
            for (scheme, code), n in sorted(self.source.uploads().items()):
                uploads.add_metric([scheme, code], n)
            yield uploads


def render(
    status: Callable[[], Status], protocols: Mapping[tuple[str, str], int] | None = None
) -> bytes:
    """The status gauges alone, from a fresh registry (for a `Status` without a service)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(status))
    if protocols is not None:
        registry.register(ProtocolCollector(protocols))
    return generate_latest(registry)
