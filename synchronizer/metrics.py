"""Prometheus metrics of the synchronizer, read from its status at scrape time.

curl -s http://127.0.0.1:8470/metrics | grep ddiloco_
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ddiloco.synchronizer.protocol import Status


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
        for f in s.fragments:
            pending.add_metric([str(f.index)], f.tokens_pending)
        yield pending
        yield CounterMetricFamily("ddiloco_bytes_up", "Update bytes received", value=s.bytes_up)
        yield CounterMetricFamily("ddiloco_bytes_down", "Fragment bytes served", value=s.bytes_down)
        yield GaugeMetricFamily(
            "ddiloco_mean_contributors", "Mean contributors per merge", value=s.mean_contributors
        )
        if s.goodput is not None:
            yield GaugeMetricFamily(
                "ddiloco_goodput", "Learner compute time / uptime", value=s.goodput
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
        for learner in s.learners:
            steps.add_metric([learner.learner_id], learner.step)
        yield steps
        for key, value in s.xi.items():
            if value is not None:
                yield GaugeMetricFamily(
                    f"ddiloco_xi_{key}_seconds", f"Moving average of xi_{key}", value=value
                )


class ProtocolCollector(Collector):
    """HTTP requests served, by scheme (http, https) and HTTP version (1.1, 2)."""

    def __init__(self, counts: Mapping[tuple[str, str], int]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "ddiloco_http_requests",
            "HTTP requests served, by scheme and HTTP version",
            labels=["scheme", "version"],
        )
        for (scheme, version), n in sorted(self.counts.items()):
            family.add_metric([scheme, version], n)
        yield family


def render(
    status: Callable[[], Status], protocols: Mapping[tuple[str, str], int] | None = None
) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(status))
    if protocols is not None:
        registry.register(ProtocolCollector(protocols))
    return generate_latest(registry)
