"""`ddiloco local --learner-metrics`: where each process serves /metrics, and its last scrape.

    ports = assign_ports(["l0", "l1"])             # a free loopback port per learner slot
    index = write_index(out, sync_url, ports)      # <out>/metrics.json: every /metrics URL
    save(out, "l0", scrape(index["learners"]["l0"]))   # <out>/metrics/l0.prom

The synchronizer serves /metrics on its own port (public, no token); each learner slot gets a
port of its own that its replacements reuse (they take the slot's argv, local/spare.py).
metrics.json is written once the synchronizer is healthy, so a Prometheus, `ddiloco status`
or a test can find every endpoint while the run goes; at the end the launcher saves each
learner's last scrape (before it stops them) and the synchronizer's (after their last
updates merged) under <out>/metrics/.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ddiloco.local.processes import free_port

log = logging.getLogger(__name__)

INDEX = "metrics.json"
SCRAPES = "metrics"


def assign_ports(learner_ids: Iterable[str]) -> dict[str, int]:
    """A distinct free loopback port for each learner slot."""
    ports: dict[str, int] = {}
    for lid in learner_ids:
        port = free_port()
        while port in ports.values():
            port = free_port()
        ports[lid] = port
    return ports


def learner_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/metrics"


def write_index(
    out: Path, sync_url: str, ports: dict[str, int], shard_urls: list[str] | None = None
) -> dict[str, Any]:
    """<out>/metrics.json: the synchronizer's and every learner's /metrics URL (with shards,
    `synchronizer` is shard 0's and `synchronizer_shards` lists every shard's in order)."""
    index: dict[str, Any] = {
        "synchronizer": f"{sync_url}/metrics",
        "learners": {lid: learner_url(port) for lid, port in ports.items()},
    }
    if shard_urls and len(shard_urls) > 1:
        index["synchronizer_shards"] = [f"{u}/metrics" for u in shard_urls]
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return index


def scrape(url: str, timeout: float = 3.0) -> str | None:
    """One plain-HTTP scrape (a learner's); None if nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode()
    except OSError as e:
        log.info("No metrics from %s: %s", url, e)
        return None


def save(out: Path, name: str, text: str | None) -> None:
    """<out>/metrics/<name>.prom, if there is a scrape to save."""
    if text is None:
        return
    d = out / SCRAPES
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.prom").write_text(text)
