"""Prometheus metrics of one learner, served on its own port by prometheus_client.

    DDILOCO_METRICS_PORT=9400 ddiloco learner ...       # or --metrics-port 9400
    curl -s http://127.0.0.1:9400/metrics | grep ddiloco_learner_

Off unless a port is set (the operator sets 9400 in learner pods, port name "metrics";
`ddiloco local --learner-metrics` gives each learner a free one). In a data-parallel group
only rank 0 serves: it holds the group's account (diloco.py) and its tokens are the
group's. Every series carries the label `learner` (the learner id). The instruments live in
a registry of their own, never the process-wide default one. Without a port they are
no-ops, so the training loop pays one call per instrument and nothing else.

    m = LearnerMetrics("l0", enabled=True)
    m.serve(9400, "0.0.0.0")                 # a daemon thread; m.close() stops it
    m.step(seconds=0.05, tokens=512, tokens_per_second=10240.0, loss=3.2)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

STEP_SECONDS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LAG_STEPS: Final = (0, 1, 2, 4, 8, 16, 32)
RESULTS: Final = ("accepted", "duplicate", "refused", "error")
"""`result` of ddiloco_learner_uploads_total: answered accepted, duplicate (the synchronizer
already had it), refused (4xx: its work is lost), or error (no definitive answer: re-sent)."""


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


NOOP: Final = _Noop()


class LearnerMetrics:
    """The learner's instruments (docs/operations.md "Metrics" lists them); no-ops when not
    `enabled`."""

    def __init__(self, learner_id: str, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.registry = CollectorRegistry(auto_describe=False)
        self.server: Any = None
        self.thread: threading.Thread | None = None
        self.port: int | None = None
        if not enabled:
            self.step_duration = self.tokens_per_second = self.tokens = NOOP
            self.sync_wait = self.handovers = self.adoption_lag = NOOP
            self.queue_depth = self.loss = self._uploads = NOOP
            return
        r, lid = self.registry, [learner_id]
        label = ["learner"]
        self.step_duration: Any = Histogram(
            "ddiloco_learner_step_duration_seconds",
            "One inner step: forward, backward, optimizer (and the wrapper's hook)",
            label,
            registry=r,
            buckets=STEP_SECONDS,
        ).labels(*lid)
        self.tokens_per_second: Any = Gauge(
            "ddiloco_learner_tokens_per_second",
            "Recent training throughput, all ranks of the group",
            label,
            registry=r,
        ).labels(*lid)
        self.tokens: Any = Counter(
            "ddiloco_learner_tokens", "Tokens trained (all ranks)", label, registry=r
        ).labels(*lid)
        self.sync_wait: Any = Counter(
            "ddiloco_learner_sync_wait_seconds",
            "Time the inner loop spent blocked on synchronization: the wrapper's hand-overs, "
            "fold-ins and the group's plan between steps; never the network (should be ~0)",
            label,
            registry=r,
        ).labels(*lid)
        self.handovers: Any = Counter(
            "ddiloco_learner_handovers", "Fragments handed to the uploader", label, registry=r
        ).labels(*lid)
        self.adoption_lag: Any = Histogram(
            "ddiloco_learner_adoption_lag_steps",
            "Inner steps completed between a merged fragment's arrival and its adoption "
            "(0: adopted at the end of the step it arrived in)",
            label,
            registry=r,
            buckets=LAG_STEPS,
        ).labels(*lid)
        self.queue_depth: Any = Gauge(
            "ddiloco_learner_upload_queue_depth",
            "Updates waiting to be sent (the one in flight included)",
            label,
            registry=r,
        ).labels(*lid)
        self.loss: Any = Gauge(
            "ddiloco_learner_loss", "Last inner training loss", label, registry=r
        ).labels(*lid)
        self._uploads: Any = Counter(
            "ddiloco_learner_uploads",
            "Upload attempts, by result",
            ["learner", "result"],
            registry=r,
        )
        for result in RESULTS:  # every result present from the start, at 0
            self._uploads.labels(learner_id, result)
        self._learner_id = learner_id

    def step(self, *, seconds: float, tokens: int, tokens_per_second: float, loss: float | None):
        """One inner step, as the optimizer hook accounted it."""
        self.step_duration.observe(seconds)
        self.tokens.inc(tokens)
        self.tokens_per_second.set(tokens_per_second)
        if loss is not None:
            self.loss.set(loss)

    def upload(self, result: str) -> None:
        """One upload attempt's result (`RESULTS`)."""
        if self.enabled:
            self._uploads.labels(self._learner_id, result).inc()

    def queue(self, depth: Callable[[], int]) -> None:
        """Read the upload queue's depth at scrape time."""
        if self.enabled:
            self.queue_depth.set_function(lambda: float(depth()))

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve /metrics on `host:port` in a daemon thread (prometheus_client's server). A
        port that cannot be bound is logged, not fatal: training matters more."""
        if not self.enabled or self.server is not None:
            return
        try:
            self.server, self.thread = start_http_server(port, host, registry=self.registry)
        except OSError as e:
            log.warning("Learner metrics not served: cannot bind %s:%d (%s)", host, port, e)
            return
        self.port = int(self.server.server_address[1])
        log.info("Serving learner metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
