"""Is the synchronizer on the critical path? Shards S and update encoding against its capacity.

    from ddiloco.simulator.syncer import SyncerConfig, fit, load
    load(SyncerConfig(), params=12e9, learners=8, H=24, step_s=1.0, fragments=24, tau=2,
         encoding="int4", shards=2, quorum=1)        # -> SyncerLoad(mean_utilisation, round_s, ...)
    fit(SyncerConfig(), params=12e9, learners=8, H=24, step_s=1.0, fragments=24, tau=2)
                                           # -> the fewest shards and the most precise encoding

A shard ingests at most `shard_gbps[encoding]` GB/s of update bytes (wire bytes, as
bench/sync_ingest.py measures them on one process); a fragment lives on one shard, so one
round of a fragment (up to M contributions of params/P values) is ingested by one shard, and
shards add capacity only across fragments. Two conditions keep the synchronizer off the
learners' critical path:

- mean load: every learner sends the whole model once per H steps; the S shards together
  must carry M x params x bytes-per-value / (H x step) with utilisation under `max_util`;
- one round: the merge waits for the quorum's K contributions (stragglers the grace window
  admits are merged too, but no learner waits on them), so ingesting K contributions of
  params/P values on the fragment's shard must take under `round_fraction` of the overlap
  budget tau x step (the rest is the network's and the merge's); at most tau fragments are
  in flight, so a shard holding several of them at once must ingest all of theirs in that
  time. Shards add capacity here only while fragments in flight outnumber them.

Bytes per value: bf16 2; int8 and int4 1 and 1/2 plus one float32 scale per block
(wire/quant.py, DEFAULT_BLOCK values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

from ddiloco.wire.quant import DEFAULT_BLOCK

ENCODINGS: Final = ("bf16", "int8", "int4")
"""Most precise first: `fit` prefers the first that fits."""
BITS: Final[dict[str, int]] = {"bf16": 16, "int8": 8, "int4": 4}


def bytes_per_value(encoding: str, block: int = DEFAULT_BLOCK) -> float:
    if encoding not in BITS:
        raise ValueError(f"unknown encoding {encoding!r}; expected one of {list(BITS)}")
    scale = 0.0 if encoding == "bf16" else 4.0 / block
    return BITS[encoding] / 8 + scale


@dataclass(frozen=True, kw_only=True)
class SyncerConfig:
    shard_gbps: dict[str, float] = field(
        default_factory=lambda: {"bf16": 1.282, "int8": 0.703, "int4": 0.284}
    )
    """Update bytes one shard ingests per second, GB/s, by encoding (bench/sync_ingest.py,
    one shard). The default is this project's measurement on a 2-core machine (bench/
    RESULTS.md "WAN (simulated)", "a round summed as it arrives"), the three encodings
    side by side in one run (HTTP/1.1 into the upload port, the learners' path; M = 16
    clients on the same cores, 64M parameters, state on disk, the default `cpu_slots`):
    bf16 1.282 GB/s, int8 0.703, int4 0.284 of wire bytes. Within one run the figures move
    by +-10%, across machines more. Measure on the target machine and pass --shard-gbps."""
    max_shards: int = 64
    round_fraction: float = 0.25
    """Share of tau x step a round's ingest may take (the issue's goal for the merge path)."""
    max_util: float = 0.8
    """Highest mean utilisation of the shards that still leaves room for bursts."""

    def __post_init__(self) -> None:
        for enc, gbps in self.shard_gbps.items():
            if enc not in BITS or not gbps > 0:
                raise ValueError(f"SyncerConfig.shard_gbps: {enc}={gbps} (want {list(BITS)} > 0)")
        if self.max_shards < 1 or not 0 < self.round_fraction <= 1 or not 0 < self.max_util <= 1:
            raise ValueError("SyncerConfig: max_shards >= 1, round_fraction and max_util in (0, 1]")


@dataclass(frozen=True)
class SyncerLoad:
    encoding: str
    shards: int
    mean_gbps: float
    """Update bytes per second into all shards together, GB/s."""
    mean_utilisation: float
    round_s: float
    """Seconds one shard needs to ingest the fragments in flight on it."""
    round_budget_s: float
    fits: bool


def load(
    cfg: SyncerConfig,
    *,
    params: float,
    learners: int,
    H: int,
    step_s: float,
    fragments: int,
    tau: int,
    encoding: str,
    shards: int,
    quorum: int = 1,
) -> SyncerLoad:
    bpv = bytes_per_value(encoding)
    cap = cfg.shard_gbps.get(encoding)
    if cap is None:
        raise ValueError(f"no measured shard capacity for {encoding!r}")
    shards = max(1, min(shards, fragments))  # a shard without a fragment does nothing
    mean = learners * params * bpv / (H * step_s) / 1e9
    util = mean / (shards * cap)
    # fragments in flight at once (tau of them), spread over the shards: the busiest holds
    in_flight = min(tau, fragments)
    per_shard = math.ceil(in_flight / shards)
    round_bytes = min(quorum, learners) * params / fragments * bpv * per_shard
    round_s = round_bytes / (cap * 1e9)
    budget = cfg.round_fraction * tau * step_s
    return SyncerLoad(
        encoding, shards, mean, util, round_s, budget, util <= cfg.max_util and round_s <= budget
    )


def fit(
    cfg: SyncerConfig,
    *,
    params: float,
    learners: int,
    H: int,
    step_s: float,
    fragments: int,
    tau: int,
    quorum: int = 1,
    encodings: tuple[str, ...] = ENCODINGS,
) -> SyncerLoad | None:
    """The fewest shards that keep the synchronizer off the critical path, with the most
    precise encoding at that count; None if no count up to `max_shards` does."""
    for s in range(1, cfg.max_shards + 1):
        for enc in encodings:
            if enc not in cfg.shard_gbps:
                continue
            got = load(
                cfg, params=params, learners=learners, H=H, step_s=step_s,
                fragments=fragments, tau=tau, encoding=enc, shards=s, quorum=quorum,
            )  # fmt: skip
            if got.fits:
                return got
    return None


def parse_capacity(text: str) -> dict[str, float]:
    """`bf16=0.9,int8=0.8,int4=0.7` -> {"bf16": 0.9, ...} (GB/s per shard)."""
    out: dict[str, float] = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        enc, sep, value = part.partition("=")
        if not sep or enc not in BITS:
            raise ValueError(
                f"--shard-gbps wants ENCODING=GB/s with ENCODING in {list(BITS)}: {part!r}"
            )
        out[enc] = float(value)
    return out
