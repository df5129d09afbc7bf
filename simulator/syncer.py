"""Is the synchronizer on the critical path? Shards S and update encoding against its capacity.

    from ddiloco.simulator.syncer import SyncerConfig, fit, load
    load(SyncerConfig(), params=12e9, learners=8, H=24, step_s=1.0, fragments=24, tau=2,
         encoding="int4", shards=2, quorum=1)        # -> SyncerLoad(mean_utilisation, round_s, ...)
    fit(SyncerConfig(), params=12e9, learners=8, H=24, step_s=1.0, fragments=24, tau=2)
                                           # -> the fewest shards and the most precise encoding
    fit(SyncerConfig(download_encoding="int4-delta"), ...)   # learners download int4 deltas

A shard does three things on the same cores: it ingests updates (at most `shard_gbps[encoding]`
GB/s of update wire bytes when it does nothing else, as bench/sync_ingest.py measures it on
one process), serves every merge to every learner (at most `out_gbps` GB/s of served bytes),
and encodes each merge once for serving (`encode_gvps`, for the quantized download
encodings). Its busy share is the sum of the three rates over their capacities (a
time-sharing model: `SyncerConfig.out_gbps` says what it was fitted to). A fragment lives on
one shard, so one round of a fragment (up to M contributions of params/P values) is ingested
by one shard, and shards add capacity only across fragments. Two conditions keep the
synchronizer off the learners' critical path:

- mean load: every learner sends the whole model once per H steps and adopts every merge
  (about one per fragment per H steps: M downloads of each); the busiest shard (it holds
  ceil(P/S) of the P fragments) must stay under `max_util`:
  in / shard_gbps + out / out_gbps + encoded values / encode_gvps;
- one round: the merge waits for the quorum's K contributions (stragglers the grace window
  admits are merged too, but no learner waits on them), so ingesting K contributions of
  params/P values on the fragment's shard must take under `round_fraction` of the overlap
  budget tau x step (the rest is the network's and the merge's); at most tau fragments are
  in flight, so a shard holding several of them at once must ingest all of theirs in that
  time. The shard ingests them at the capacity the downloads and encodes leave it:
  shard_gbps x (1 - serve share), the serve share at its mean (the same steady state the
  capacities were fitted in; learners adopt at their own hand-over times, so downloads
  spread over the window rather than arriving in one burst). Shards add capacity here only
  while fragments in flight outnumber them, or by taking downloads off the round's shard. A
  shard whose serve share reaches 1 ingests nothing: it never fits.

Bytes per value up: bf16 2; int8 and int4 1 and 1/2 plus one float32 scale per block
(wire/quant.py, DEFAULT_BLOCK values). Down (`broadcast_encoding`, wire/broadcast.py): float32
4, bfloat16 2, int8 and int8-delta 1 and int4-delta 1/2 plus the block scales; a learner that
missed a version downloads a delta encoding's whole fragment in float32, which the model
leaves out (every learner adopts every merge).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

from ddiloco.wire.protocol import BROADCAST_ENCODINGS
from ddiloco.wire.quant import DEFAULT_BLOCK

ENCODINGS: Final = ("bf16", "int8", "int4")
"""Most precise first: `fit` prefers the first that fits."""
BITS: Final[dict[str, int]] = {"bf16": 16, "int8": 8, "int4": 4}
DOWNLOAD_ENCODINGS: Final[tuple[str, ...]] = BROADCAST_ENCODINGS
"""The synchronizer's `broadcast_encoding`s (wire/protocol.py), by the product's names."""
DOWNLOAD_BITS: Final[dict[str, int]] = {
    "float32": 32,
    "bfloat16": 16,
    "int8": 8,
    "int8-delta": 8,
    "int4-delta": 4,
}


def bytes_per_value(encoding: str, block: int = DEFAULT_BLOCK) -> float:
    """Update wire bytes per parameter in `encoding` (bf16, int8, int4)."""
    if encoding not in BITS:
        raise ValueError(f"unknown encoding {encoding!r}; expected one of {list(BITS)}")
    scale = 0.0 if encoding == "bf16" else 4.0 / block
    return BITS[encoding] / 8 + scale


def download_bytes_per_value(encoding: str, block: int = DEFAULT_BLOCK) -> float:
    """Served bytes per parameter in broadcast `encoding` (float32, bfloat16, int8,
    int8-delta, int4-delta): the quantized ones carry a float32 scale per block."""
    if encoding not in DOWNLOAD_BITS:
        raise ValueError(
            f"unknown download encoding {encoding!r}; expected one of {list(DOWNLOAD_BITS)}"
        )
    scale = 0.0 if encoding in ("float32", "bfloat16") else 4.0 / block
    return DOWNLOAD_BITS[encoding] / 8 + scale


ROUND_TRIP_S1: Final[dict[str, tuple[float, float]]] = {
    "bf16": (0.453, 0.928),
    "int8": (0.230, 0.925),
    "int4": (0.117, 0.781),
}
"""Measured round trip of one shard, (in, out) GB/s by update encoding, bfloat16 downloads
(bench/RESULTS.md "WAN (simulated)": bench/sync_ingest.py --arms rt-up, M = 16 clients each
downloading every version, 64M parameters, P = 4, state on disk, 2 cores): what `out_gbps`
is fitted to."""


@dataclass(frozen=True, kw_only=True)
class SyncerConfig:
    shard_gbps: dict[str, float] = field(
        default_factory=lambda: {"bf16": 1.282, "int8": 0.703, "int4": 0.284}
    )
    """Update bytes one shard ingests per second when it serves nothing, GB/s, by encoding
    (bench/sync_ingest.py, one shard). The default is this project's measurement on a
    2-core machine (bench/RESULTS.md "WAN (simulated)", "a round summed as it arrives"), the
    three encodings side by side in one run (HTTP/1.1 into the upload port, the learners'
    path; M = 16 clients on the same cores, 64M parameters, state on disk, the default
    `cpu_slots`): bf16 1.282 GB/s, int8 0.703, int4 0.284 of wire bytes. Within one run the
    figures move by +-10%, across machines more. Measure on the target machine and pass
    --shard-gbps."""
    out_gbps: float = 1.38
    """Served bytes one shard sends per second when it ingests nothing, GB/s. Fitted to the
    measured round trip (`ROUND_TRIP_S1`) with the time-sharing model, busy share = in /
    shard_gbps[update encoding] + out / out_gbps = 1 for a saturated shard, so out_gbps =
    out / (1 - in / shard_gbps): 0.928 / (1 - 0.453 / 1.282) = 1.43 (bf16 up), 0.925 /
    (1 - 0.230 / 0.703) = 1.37 (int8), 0.781 / (1 - 0.117 / 0.284) = 1.33 (int4); their mean,
    1.38, predicts each measured in-rate from its out-rate within 8% and each out-rate from
    its in-rate within 4%. One figure serves every download encoding's bytes: every one is
    encoded once per merge into a buffer the upload port `sendmsg`s from
    (synchronizer/served_versions.py, upload_port.py), float32 and bfloat16 alike (0.33-0.36
    CPU s per GB out measured for both); what a quantized encoding costs more is its encode,
    once per merge (`encode_gvps`). Measure the round trip on the target machine
    (bench/sync_ingest.py --arms rt-up) and pass --shard-out-gbps."""
    download_encoding: str = "bfloat16"
    """What every learner downloads of every merge: the synchronizer's `broadcast_encoding`
    (its default, bfloat16)."""
    encode_gvps: dict[str, float] = field(
        default_factory=lambda: {"int8": 0.094, "int8-delta": 0.165, "int4-delta": 0.134}
    )
    """Parameters per second (G) one shard encodes for serving in a quantized download
    encoding, once per merge: values per CPU second of `served_versions.encode` of a 16M-value
    fragment (bench/delta_encode.py --params 16e6 --encoding int8-delta,int4-delta: 0.097 and
    0.119 CPU s; int8, timed the same way: 0.17 CPU s) on the 2-core machine the capacities
    above come from, counted as wall time of the shard (conservative: it splits between
    threads). float32 and bfloat16 encodes (a conversion copy, 0.01-0.02 s per 16M values)
    are inside the fitted capacities; an encoding missing here costs nothing extra."""
    max_shards: int = 64
    round_fraction: float = 0.25
    """Share of tau x step a round's ingest may take (the issue's goal for the merge path)."""
    max_util: float = 0.8
    """Highest mean utilisation of the shards that still leaves room for bursts."""

    def __post_init__(self) -> None:
        for enc, gbps in self.shard_gbps.items():
            if enc not in BITS or not gbps > 0:
                raise ValueError(f"SyncerConfig.shard_gbps: {enc}={gbps} (want {list(BITS)} > 0)")
        if not self.out_gbps > 0 or math.isinf(self.out_gbps):
            raise ValueError(f"SyncerConfig.out_gbps must be a finite number > 0: {self.out_gbps}")
        download_bytes_per_value(self.download_encoding)
        for enc, gvps in self.encode_gvps.items():
            if enc not in DOWNLOAD_BITS or not gvps > 0:
                raise ValueError(
                    f"SyncerConfig.encode_gvps: {enc}={gvps} (want {list(DOWNLOAD_BITS)} > 0)"
                )
        if self.max_shards < 1 or not 0 < self.round_fraction <= 1 or not 0 < self.max_util <= 1:
            raise ValueError("SyncerConfig: max_shards >= 1, round_fraction and max_util in (0, 1]")


@dataclass(frozen=True)
class SyncerLoad:
    encoding: str
    shards: int
    mean_gbps: float
    """Update bytes per second into all shards together, GB/s."""
    mean_utilisation: float
    """The busiest shard's busy share: ingest, downloads and encodes."""
    round_s: float
    """Seconds one shard needs to ingest the fragments in flight on it (inf: never)."""
    round_budget_s: float
    fits: bool
    out_gbps: float = 0.0
    """Served bytes per second out of all shards together, GB/s."""
    serve_share: float = 0.0
    """The busiest shard's share spent serving merges: downloads and their encodes."""


def serve_share(cfg: SyncerConfig, out_gbps: float, encoded_gvps: float = 0.0) -> float:
    """Share of a shard's time spent serving `out_gbps` of downloads and encoding
    `encoded_gvps` (G parameters a second) of merges in `cfg.download_encoding`."""
    gvps = cfg.encode_gvps.get(cfg.download_encoding)
    return out_gbps / cfg.out_gbps + (encoded_gvps / gvps if gvps else 0.0)


def ingest_left(cfg: SyncerConfig, encoding: str, share: float) -> float:
    """Update GB/s a shard still ingests in `encoding` while `share` of its time serves
    merges (the time-sharing model); 0 once serving takes it whole."""
    return cfg.shard_gbps[encoding] * max(0.0, 1.0 - share)


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
    busiest = math.ceil(fragments / shards) / fragments  # its share of the fragments
    period = H * step_s  # every fragment is handed over, merged and adopted once per period
    mean = learners * params * bpv / period / 1e9
    out = learners * params * download_bytes_per_value(cfg.download_encoding) / period / 1e9
    serve = serve_share(cfg, busiest * out, busiest * params / period / 1e9)
    util = busiest * mean / cap + serve
    # fragments in flight at once (tau of them), spread over the shards: the busiest holds
    in_flight = min(tau, fragments)
    per_shard = math.ceil(in_flight / shards)
    round_bytes = min(quorum, learners) * params / fragments * bpv * per_shard
    left = ingest_left(cfg, encoding, serve) * 1e9
    round_s = round_bytes / left if left > 0 else math.inf
    budget = cfg.round_fraction * tau * step_s
    fits = util <= cfg.max_util and round_s <= budget
    return SyncerLoad(encoding, shards, mean, util, round_s, budget, fits, out, serve)


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


def parse_capacity(
    text: str,
    flag: str = "--shard-gbps",
    names: tuple[str, ...] = ENCODINGS,
    unit: str = "GB/s",
) -> dict[str, float]:
    """`bf16=0.9,int8=0.8,int4=0.7` -> {"bf16": 0.9, ...} (GB/s per shard); the same form for
    `--shard-encode-gvps int8-delta=0.2` with `names` the download encodings."""
    out: dict[str, float] = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        enc, sep, value = part.partition("=")
        enc = enc.strip()
        if not sep or enc not in names:
            raise ValueError(
                f"{flag} wants ENCODING={unit} with ENCODING in {list(names)}: {part!r}"
            )
        try:
            out[enc] = float(value)
        except ValueError:
            raise ValueError(f"{flag}: {enc}={value.strip()!r} is not a number") from None
    return out
