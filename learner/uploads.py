"""Where a learner's fragment uploads go: each shard's upload port, or its main URL.

    upload_overrides("", 2)                                  # [None, None]: from the joins
    upload_overrides("http://r:9001,http://r:9002", 2)       # a relay per shard
    with_port("https://sync-0.sync.ns.svc:8470", 8471)       # "https://sync-0.sync.ns.svc:8471"

A synchronizer with an upload port (synchronizer/upload_port.py) names it at join; the learner posts
updates to the host it reached the shard by, on that port, over HTTP/1.1 (the port speaks
nothing else), and everything else to the main URL. When the port cannot be reached at all
(a proxy, a firewall or a port-forward that passes only the main port), uploads go to the
main URL for `UPLOAD_FALLBACK_S` and then try the upload port again, unless the main URL
cannot be reached either: that is an outage, retried with backoff to the upload port
(learner/streaming.py). An update the port turns away (a 503, or a connection reset before
any answer: the port at its connection caps) goes to the main URL at once, and the next
update tries the port again.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import urlsplit, urlunsplit

UPLOAD_FALLBACK_S: Final = 300.0
"""How long uploads stay on the main URL after the upload port could not be reached."""


def upload_overrides(value: str, shards: int) -> list[str | None]:
    """`LearnerConfig.upload_url` as one entry per shard (None: decided at join)."""
    value = value.strip()
    if value in ("", "off"):
        return [None] * shards
    urls = [u.strip().rstrip("/") for u in value.split(",")]
    if len(urls) != shards or not all(urls):
        raise ValueError(
            f"DDILOCO_UPLOAD_URL lists {len(urls)} URLs for {shards} synchronizer shards: "
            "give one per shard, in shard order (or leave it empty)"
        )
    return list(urls)


def with_port(url: str, port: int) -> str:
    """`url` with its port replaced (IPv6 literals keep their brackets)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{port}"
    if parts.username:  # never used by learners; kept rather than silently dropped
        netloc = f"{parts.username}@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
