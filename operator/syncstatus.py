"""Read a synchronizer's status endpoint for the job status (global version, goodput, ...).

    reader = StatusReader(get_settings())
    answer = reader.read(job, token)        # dict from GET {url}/v1/status, or None

The URL comes from `status_url_template` (config.py): the in-cluster Service by default,
anything reachable in tests and development. A job with synchronizer.shards > 1 has one URL
per shard (`shard_url_template`); every shard must answer, and `combine` makes the job's one
answer of theirs (`ddiloco.wire.job_status.merge_statuses`). HTTP/1.1 is enough here (the
synchronizer serves both it and h2c). A synchronizer that does not answer is normal (starting, restarting, or a
fake pod in tests): the caller keeps the last numbers.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import ssl
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Final

import pydantic

from ddiloco.operator import api as ddapi
from ddiloco.operator.config import OperatorSettings

log = logging.getLogger(__name__)


MAX_STATUS_BYTES: Final = 4 << 20
"""The most of a status answer the operator reads (a synchronizer at the CRD's limits answers
well under 1 MiB); a longer one is refused unread past this, as no answer."""


class StatusTooLarge(ValueError):
    """A status answer longer than MAX_STATUS_BYTES."""


class StatusReader:
    """Reads GET {url}/v1/status of each job's synchronizer, at most every poll interval.

    The synchronizer may be unreachable (starting, restarting, or fake in tests): then the
    last answer stands, the job keeps its last numbers, and one line is logged per change.
    """

    def __init__(self, settings: OperatorSettings) -> None:
        self.settings = settings
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sync-status")
        self._last: dict[str, tuple[float, dict[str, Any] | None]] = {}
        self._lock = threading.Lock()

    def url(self, job: ddapi.DecoupledDiLoCoJob) -> str:
        """The ClusterIP Service's URL (the synchronizer, or shard 0 of several): where hot
        spares' assignments go (spares.py), as a spare polls the first of its URLs."""
        scheme = "https" if job.spec.synchronizer.tls.enabled else "http"
        return self.settings.status_url_template.format(
            name=job.name, namespace=job.namespace, scheme=scheme
        )

    def urls(self, job: ddapi.DecoupledDiLoCoJob) -> list[str]:
        """Every shard's status URL, in shard order (one: `url`)."""
        shards = job.spec.synchronizer.shards
        if shards == 1:
            return [self.url(job)]
        scheme = "https" if job.spec.synchronizer.tls.enabled else "http"
        return [
            self.settings.shard_url_template.format(
                name=job.name, namespace=job.namespace, scheme=scheme, shard=i
            )
            for i in range(shards)
        ]

    def read(
        self,
        job: ddapi.DecoupledDiLoCoJob,
        token: str | None,
        context: ssl.SSLContext | None = None,
    ) -> dict[str, Any] | None:
        """`context`: for an https URL, the job's trust (and client certificate, certs.py)."""
        key = job.uid
        with self._lock:
            at, last = self._last.get(key, (0.0, None))
        if time.monotonic() - at < self.settings.status_poll_seconds or token is None:
            return last
        futures = [self._pool.submit(self._get, u, token, context) for u in self.urls(job)]
        answer: dict[str, Any] | None = None
        try:  # DNS lookups are not covered by socket timeouts; bound the whole call here
            deadline = time.monotonic() + self.settings.http_timeout_seconds + 1
            answers = [f.result(max(0.0, deadline - time.monotonic())) for f in futures]
            answer = combine(answers)
        except (FutureTimeout, OSError, ValueError) as e:
            answer = None
            if last is not None or at == 0.0:
                log.info(
                    "Synchronizer status of %s/%s is unavailable: %s",
                    job.namespace,
                    job.name,
                    type(e).__name__,
                )
        with self._lock:
            self._last[key] = (time.monotonic(), answer)
        return answer

    def _get(self, url: str, token: str, context: ssl.SSLContext | None = None) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{url.rstrip('/')}/v1/status",
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
        )
        timeout = self.settings.http_timeout_seconds
        https = url.startswith("https://")
        with urllib.request.urlopen(
            req, timeout=timeout, context=context if https else None
        ) as resp:
            data = resp.read(MAX_STATUS_BYTES + 1)
        if len(data) > MAX_STATUS_BYTES:
            raise StatusTooLarge(f"the status answer exceeds {MAX_STATUS_BYTES} bytes")
        body = json.loads(data)
        if not isinstance(body, dict):
            raise ValueError("status is not a JSON object")
        return body

    def forget(self, uid: str) -> None:
        with self._lock:
            self._last.pop(uid, None)


def combine(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One job-wide answer from every shard's (in shard order), by
    `ddiloco.wire.job_status.merge_statuses`. One answer is returned as it is; answers
    that are not whole synchronizer Status objects (a stub's) give shard 0's."""
    if len(answers) == 1:
        return answers[0]
    from ddiloco.wire.job_status import merge_statuses
    from ddiloco.wire.protocol import Status

    try:
        statuses = [Status.model_validate(a) for a in answers]
    except pydantic.ValidationError:
        return answers[0]
    return dict(merge_statuses(statuses).model_dump(mode="json"))


# Fields of a synchronizer's GET /v1/status that the job status carries (status.py), each
# checked against the synchronizer's own model (protocol.Status: finite numbers only).
# `learners` only feeds `derived`, which reads each record's numbers with care of its own.
CHECKED_FIELDS: Final = (
    "global_version",
    "merges",
    "tokens_merged",
    "goodput",
    "total_tokens",
    "progress",
    "estimated_remaining_seconds",
    "finished",
    "evaluation",
)


@functools.cache
def _field_adapter(name: str) -> pydantic.TypeAdapter[Any]:
    from ddiloco.wire.protocol import Status

    annotation = Status.model_fields[name].annotation
    return pydantic.TypeAdapter(
        annotation, config=pydantic.ConfigDict(strict=True, allow_inf_nan=False)
    )


def checked(answer: dict[str, Any] | None) -> tuple[dict[str, Any] | None, list[str]]:
    """The parts of a synchronizer's status answer the job status uses, each as
    `protocol.Status` types it (a non-negative integer, a finite number; `learners` a list
    of objects), and the names of those that were not: dropped, for a condition that says
    so (one NaN would make the apiserver refuse the whole status write). None stays None
    (no answer)."""
    if answer is None:
        return None, []
    out: dict[str, Any] = {}
    bad: list[str] = []
    for name in CHECKED_FIELDS:
        if name not in answer or answer[name] is None:
            continue
        try:
            value = _field_adapter(name).validate_python(answer[name])
        except pydantic.ValidationError:
            bad.append(name)
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            bad.append(name)
            continue
        out[name] = value
    learners = answer.get("learners")
    if isinstance(learners, list):
        out["learners"] = [x for x in learners if isinstance(x, dict)]
    elif learners is not None:
        bad.append("learners")
    return out, bad


def derived(answer: dict[str, Any] | None) -> dict[str, Any]:
    """The job status's numbers that a /v1/status answer implies but does not carry:
    `merged_work_ratio` (tokens merged over the sum of the learners' tokens_total, at most
    1, rounded to 3 digits so that the status does not change with every token) and
    `live_learners` (learners alive). Missing or malformed parts give nothing.

        derived({"tokens_merged": 50, "learners": [{"alive": True, "tokens_total": 100}]})
        # {"merged_work_ratio": 0.5, "live_learners": 1}
    """
    out: dict[str, Any] = {}
    learners = (answer or {}).get("learners")
    if not isinstance(learners, list):
        return out
    learners = [x for x in learners if isinstance(x, dict)]
    out["live_learners"] = sum(1 for x in learners if x.get("alive") is True)
    trained = sum(
        x["tokens_total"]
        for x in learners
        if isinstance(x.get("tokens_total"), int | float)
        and math.isfinite(x["tokens_total"])
        and x["tokens_total"] > 0
    )
    merged = (answer or {}).get("tokens_merged")
    if (
        0 < trained < math.inf
        and isinstance(merged, int | float)
        and math.isfinite(merged)
        and merged >= 0
    ):
        out["merged_work_ratio"] = round(min(1.0, merged / trained), 3)
    return out
