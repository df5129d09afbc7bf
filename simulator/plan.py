"""`ddiloco simulate --plan`: search M, K, P, H for a fleet and rank the configurations.

    ddiloco simulate --plan --chips 600000 --link-gbps 10 --top 5
    ddiloco simulate --plan --chips 600000 --link-gbps 10 --json

For each learner count M the fleet's failures are simulated once (learners are elastic
jobs of N/M chips, `failures.Job`); every (K, H) is then scored on the same runs:
goodput (a barrier when K = M, none otherwise), merged-work ratio (the protocol replayed on
the learners' steps, `strategies.merged_work`, following PLAN_SAMPLE fragments with
P = min(--fragments, H)), and per-site traffic for every P (`network.decoupled_traffic`). Configurations whose mean traffic or peak (a fragment's
round trip within tau steps) exceeds the slowest link are dropped. Each configuration is
given the most precise update encoding (bf16, then int8, then int4: the upload's bits on the
links, and the synchronizer's measured per-shard capacity, `syncer.py`: its ingest, and the
round trip of every learner downloading every merge in `--download-encoding`) that fits both
the links and the synchronizer, with the fewest synchronizer shards S that keep the
synchronizer off the critical path; a configuration no encoding and no S up to
`SyncerConfig.max_shards` serves is dropped. Ranking: effective goodput (goodput x merged-work
ratio), then the more precise encoding (quality is not simulated: the paper finds int4 within
0.1% of bf16, this project has not measured it yet), then fewer shards, lower peak bandwidth,
smaller H, smaller K. Larger H and smaller K trade quality the simulator cannot see either
(Douillard et al. 2026).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Final

from ddiloco.simulator.config import FailureConfig, NetworkConfig, RunConfig
from ddiloco.simulator.network import decoupled_traffic
from ddiloco.simulator.strategies import barrier_rounds, merged_work, run_jobs, split_chips
from ddiloco.simulator.syncer import BITS, ENCODINGS, SyncerConfig, fit

PLAN_SAMPLE: Final[int] = 1
"""Fragments the protocol replay follows per (M, K, H): the search replays dozens."""


@dataclass(frozen=True)
class Candidate:
    learners: int
    quorum: int
    fragments: int
    H: int
    goodput: float
    merged_work_ratio: float
    effective_goodput: float
    mean_gbps: float
    peak_gbps: float
    encoding: str = "bf16"
    """Learner -> synchronizer update encoding (downloads: `SyncerConfig.download_encoding`)."""
    shards: int = 1
    """Synchronizer shards S that keep it off the critical path (`syncer.fit`)."""
    sync_utilisation: float = 0.0
    """Mean utilisation of those shards."""


def search(
    run: RunConfig,
    fail: FailureConfig,
    net: NetworkConfig,
    *,
    learners: tuple[int, ...] = (2, 4, 8, 16),
    fragments: tuple[int, ...] = (4, 12, 24, 48),
    hs: tuple[int, ...] = (12, 24, 48, 96),
    syncer: SyncerConfig | None = None,
    encodings: tuple[str, ...] = ENCODINGS,
) -> list[Candidate]:
    """Every feasible configuration, best first."""
    syncer = syncer or SyncerConfig()
    out: list[Candidate] = []
    link = min(net.link_gbps)
    for m in learners:
        if m > run.chips:
            continue
        jobs, _ = run_jobs(split_chips(run.chips, m), fail, run.horizon_s, run.seed, elastic=True)
        allocated = run.chips * run.horizon_s
        free = sum(j.good_chip_s for j in jobs)
        for k in sorted({1, max(1, m // 2), m}):
            for h in hs:
                computed = barrier_rounds(jobs, h, run.horizon_s) if k == m else free
                merged = 1.0
                if k < m:
                    merged = merged_work(
                        jobs,
                        quorum=k,
                        H=h,
                        fragments=min(run.fragments, h),
                        tau=run.tau,
                        horizon=run.horizon_s,
                        sample=PLAN_SAMPLE,
                    ).merged_work_ratio
                for p in fragments:
                    if p > h:
                        continue  # at most one fragment due per step
                    good = computed / allocated
                    for enc in encodings:
                        t = decoupled_traffic(
                            replace(net, up_bits=BITS[enc]), fail.step_s, p, h, run.tau
                        )
                        mean = max(t.up_mean_gbps, t.down_mean_gbps)
                        if mean > link or t.peak_gbps > link:
                            continue
                        sync = fit(
                            syncer, params=net.params, learners=m, H=h, step_s=fail.step_s,
                            fragments=p, tau=run.tau, quorum=k, encodings=(enc,),
                        )  # fmt: skip
                        if sync is None:
                            continue
                        cand = Candidate(
                            m, k, p, h, good, merged, good * merged, mean, t.peak_gbps,
                            enc, sync.shards, sync.mean_utilisation,
                        )  # fmt: skip
                        out.append(cand)
                        break  # the most precise encoding that fits is this config's
    # Quality is not simulated: among equals prefer less bandwidth, then fresher merges
    # (smaller H), then the paper's K = 1.
    precision = {e: i for i, e in enumerate(ENCODINGS)}
    out.sort(
        key=lambda c: (
            -round(c.effective_goodput, 3),
            precision[c.encoding],
            c.shards,
            c.peak_gbps,
            c.H,
            c.quorum,
        )
    )
    return out


def format_plan(cands: list[Candidate], top: int) -> str:
    head = (
        f"{'M':>3} {'K':>3} {'P':>3} {'H':>3} {'goodput':>8} {'merged':>7} "
        f"{'effective':>9} {'mean Gb/s':>9} {'peak Gb/s':>9} {'up':>4} {'S':>3} {'sync':>5}"
    )
    lines = [head]
    for c in cands[:top]:
        lines.append(
            f"{c.learners:>3} {c.quorum:>3} {c.fragments:>3} {c.H:>3} {c.goodput:>8.1%} "
            f"{c.merged_work_ratio:>7.1%} {c.effective_goodput:>9.1%} {c.mean_gbps:>9.2f} "
            f"{c.peak_gbps:>9.2f} {c.encoding:>4} {c.shards:>3} {c.sync_utilisation:>5.0%}"
        )
    if not cands:
        lines.append(
            "no configuration fits the links and the synchronizer; raise --link-gbps, "
            "--shard-gbps or --shard-out-gbps"
        )
    return "\n".join(lines)


def as_json(cands: list[Candidate], top: int) -> list[dict[str, float]]:
    return [asdict(c) for c in cands[:top]]
