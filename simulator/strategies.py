"""The four training methods on one failing fleet: plain DP, elastic DP, synchronous DiLoCo
and Decoupled DiLoCo.

    from ddiloco.simulator.strategies import simulate
    r = simulate("decoupled", RunConfig(chips=1_200_000, learners=8), FailureConfig())
    r.goodput, r.merged_work_ratio, r.uptime

- `dp`: one non-elastic job on all N chips: every failure stops it for a restart.
- `elastic_dp`: one elastic job on all N chips: shrink on failure, regrow after repair.
- `decoupled`: M learners of N/M chips, each an elastic job (Douillard et al. 2026). With
  quorum K < M nobody waits for anybody: goodput is the chip-weighted mean of the learners'.
  Which of the computed steps reach a merge is decided by replaying the synchronizer's and
  the learners' rules on the learners' steps (`protocol.py`): a learner paused by a
  reconfiguration misses rounds, but its update, late by a version or two, merges into the
  next round (max_staleness), and rebase adoption keeps its steps; the merged-work ratio
  counts what is still lost (updates older than max_staleness, work not handed over by the
  end). Its tokens are the chips behind each step (weak scaling).
- `diloco`: the same learners under a barrier every H steps (K = M): a learner that is
  down holds everyone at the next merge.

Goodput follows the paper's failure model: chip-seconds spent on steps that completed, over
chip-seconds allocated (every chip of the fleet, for the whole horizon).

Tests: `tests/unit/test_sim_strategies.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from ddiloco.simulator.config import FailureConfig, RunConfig
from ddiloco.simulator.engine import EventLoop
from ddiloco.simulator.failures import Job
from ddiloco.simulator.protocol import (
    Incarnation,
    Learner,
    ProtocolConfig,
    ProtocolResult,
    run_protocol,
)

STRATEGIES: Final[tuple[str, ...]] = ("dp", "elastic_dp", "diloco", "decoupled")
FLEET_SAMPLE: Final[int] = 4
"""Fragments the protocol replay follows in a fleet run (see protocol.py `sample`)."""


@dataclass
class SimResult:
    """What one simulated run produced (all fractions in [0, 1])."""

    strategy: str
    chips: int
    learners: int
    quorum: int
    horizon_s: float
    goodput: float
    uptime: float
    merged_work_ratio: float
    failures: int
    pauses: int
    events: int
    learner_goodput: list[float] = field(default_factory=list)
    protocol: ProtocolResult | None = None
    """What the protocol replay found (Decoupled DiLoCo only)."""

    @property
    def effective_goodput(self) -> float:
        """Goodput that also reached a merge."""
        return self.goodput * self.merged_work_ratio

    def wall_to_tokens_s(self, tokens: float, tokens_per_chip_s: float) -> float:
        """Wall seconds to merge `tokens` at this effective goodput."""
        return tokens / (self.chips * tokens_per_chip_s * max(self.effective_goodput, 1e-12))


def run_jobs(
    sizes: list[int], fail: FailureConfig, horizon: float, seed: int, *, elastic: bool
) -> tuple[list[Job], int]:
    """Run one job per entry of `sizes` (chips) on one event loop, to `horizon`."""
    loop = EventLoop()
    rng = np.random.default_rng(seed)
    jobs = [Job(loop, n, fail, rng, elastic=elastic) for n in sizes]
    for job in jobs:
        job.start()
    loop.run(until=horizon)
    for job in jobs:
        job.finish(horizon)
    return jobs, loop.processed


def split_chips(chips: int, learners: int) -> list[int]:
    base, extra = divmod(chips, learners)
    return [base + (i < extra) for i in range(learners)]


def coverage(jobs: list[Job], at_least: int, horizon: float) -> float:
    """Fraction of [0, horizon] during which at least `at_least` jobs were computing."""
    starts = np.concatenate([np.array([s for s, _, _ in j.run_intervals]) for j in jobs])
    ends = np.concatenate([np.array([e for _, e, _ in j.run_intervals]) for j in jobs])
    if starts.size == 0:
        return 0.0
    times = np.concatenate([starts, ends])
    delta = np.concatenate([np.ones_like(starts), -np.ones_like(ends)])
    order = np.lexsort((delta, times))  # at equal times, ends (-1) before starts
    times, delta = times[order], delta[order]
    count = np.cumsum(delta)
    spans = np.diff(np.append(times, horizon))
    return float(spans[count >= at_least].sum() / horizon)


def _intervals(job: Job) -> np.ndarray:
    return np.array(job.run_intervals, dtype=float).reshape(-1, 3)


def learner_timelines(jobs: list[Job]) -> list[Learner]:
    """Each job as one learner process for the protocol replay: a step completes every
    step_s inside its computing intervals, with the chips then computing as its tokens.
    An elastic job keeps its state (and heartbeats) through its reconfigurations."""
    out = []
    for j, job in enumerate(jobs):
        iv = _intervals(job)
        n = np.rint((iv[:, 1] - iv[:, 0]) / job.step_s).astype(int)
        first = np.repeat(np.cumsum(n) - n, n)
        k = np.arange(int(n.sum())) - first + 1
        times = np.repeat(iv[:, 0], n) + k * job.step_s
        tokens = np.repeat(iv[:, 2], n)
        out.append(Learner(f"learner-{j}", job.step_s, [Incarnation(0.0, times, tokens)]))
    return out


def merged_work(
    jobs: list[Job],
    *,
    quorum: int,
    H: int,
    fragments: int,
    tau: int,
    horizon: float,
    sample: int | None = FLEET_SAMPLE,
) -> ProtocolResult:
    """Replay the protocol on the jobs' steps (merge traffic inside a data centre: no delays)."""
    cfg = ProtocolConfig(fragments=fragments, H=H, quorum=quorum, tau=tau, sample=sample)
    return run_protocol(learner_timelines(jobs), cfg, horizon)


def barrier_rounds(jobs: list[Job], H: int, horizon: float, sync_s: float = 0.0) -> float:
    """Chip-seconds of useful work when every learner must finish each block of H steps
    before anyone starts the next (synchronous DiLoCo). A learner's own failures and
    pauses happen in wall time; the barrier only adds waiting."""
    curves = []
    for job in jobs:
        iv = _intervals(job)
        dur = iv[:, 1] - iv[:, 0]
        curves.append((iv[:, 0], iv[:, 1], np.cumsum(dur), np.cumsum(dur * iv[:, 2]), iv[:, 2]))

    def run_time(c: tuple[np.ndarray, ...], t: float) -> tuple[float, float]:
        """(computing seconds, chip-seconds) of a learner in [0, t]."""
        s, e, cum, cumc, chips = c
        i = int(np.searchsorted(s, t, side="right")) - 1
        if i < 0:
            return 0.0, 0.0
        before, beforec = (cum[i - 1], cumc[i - 1]) if i > 0 else (0.0, 0.0)
        inside = min(t, e[i]) - s[i]
        return before + inside, beforec + inside * chips[i]

    def when(c: tuple[np.ndarray, ...], x: float) -> float:
        s, _, cum, _, _ = c
        i = int(np.searchsorted(cum, x, side="left"))
        if i >= len(cum):
            return float("inf")
        before = cum[i - 1] if i > 0 else 0.0
        return float(s[i] + (x - before))

    block = H * jobs[0].step_s
    t, used = 0.0, 0.0
    while True:
        starts = [run_time(c, t) for c in curves]
        finish = [when(c, r + block) for c, (r, _) in zip(curves, starts, strict=True)]
        if max(finish) > horizon:
            break
        for c, (_, chip_s), f in zip(curves, starts, finish, strict=True):
            used += run_time(c, f)[1] - chip_s
        t = max(finish) + sync_s
    return used


def simulate(
    strategy: str, run: RunConfig, fail: FailureConfig, *, replay: bool = True
) -> SimResult:
    """Simulate `strategy` on the fleet of `run` under the failures of `fail`. With
    `replay=False` Decoupled DiLoCo skips the protocol replay (goodput only; the merged-work
    ratio reads nan)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    single = strategy in ("dp", "elastic_dp")
    learners = 1 if single else run.learners
    jobs, events = run_jobs(
        split_chips(run.chips, learners),
        fail,
        run.horizon_s,
        run.seed,
        elastic=strategy != "dp",
    )
    allocated = run.chips * run.horizon_s
    computed = sum(j.good_chip_s for j in jobs)
    quorum = learners if strategy == "diloco" else min(run.quorum, learners)
    merged, protocol = 1.0, None
    if strategy == "diloco":
        computed = barrier_rounds(jobs, run.H, run.horizon_s)
    elif strategy == "decoupled" and not replay:
        merged = math.nan
    elif strategy == "decoupled":
        protocol = merged_work(
            jobs,
            quorum=quorum,
            H=run.H,
            fragments=run.fragments,
            tau=run.tau,
            horizon=run.horizon_s,
        )
        merged = protocol.merged_work_ratio
    return SimResult(
        strategy=strategy,
        chips=run.chips,
        learners=learners,
        quorum=quorum,
        horizon_s=run.horizon_s,
        goodput=computed / allocated,
        uptime=coverage(jobs, quorum if strategy == "decoupled" else learners, run.horizon_s),
        merged_work_ratio=merged,
        failures=sum(j.failures for j in jobs),
        pauses=sum(j.pauses for j in jobs),
        events=events,
        learner_goodput=[j.goodput() for j in jobs],
        protocol=protocol,
    )
