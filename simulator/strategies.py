"""The four training methods on one failing fleet: plain DP, elastic DP, synchronous DiLoCo
and Decoupled DiLoCo.

    from ddiloco.simulator.strategies import simulate
    r = simulate("decoupled", RunConfig(chips=1_200_000, learners=8), FailureConfig())
    r.goodput, r.merged_work_ratio, r.uptime

- `dp`: one non-elastic job on all N chips: every failure stops it for a restart.
- `elastic_dp`: one elastic job on all N chips: shrink on failure, regrow after repair.
- `decoupled`: M learners of N/M chips, each an elastic job (algorithm.md §9). With
  quorum K < M nobody waits for anybody: goodput is the chip-weighted mean of the learners'.
  A learner that is down while >= K others keep merging misses those rounds and, when it
  comes back, overwrites the fragments it missed with the merged copies: its work on them
  since its last contribution is lost (algorithm.md §4) - the merged-work ratio counts it.
- `diloco`: the same learners under a barrier every H steps (K = M): a learner that is
  down holds everyone at the next merge.

Goodput follows algorithm.md §9: chip-seconds spent on steps that completed, over
chip-seconds allocated (every chip of the fleet, for the whole horizon).

Tests: `tests/unit/test_sim_strategies.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

import numpy as np

from ddiloco.simulator.config import FailureConfig, RunConfig
from ddiloco.simulator.engine import EventLoop
from ddiloco.simulator.failures import Job

STRATEGIES: Final[tuple[str, ...]] = ("dp", "elastic_dp", "diloco", "decoupled")


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


def running_at(iv: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Whether a job with computing intervals `iv` (rows start, end, chips) computes at each
    of `times`."""
    i = np.searchsorted(iv[:, 0], times, side="right") - 1
    ok = i >= 0
    return ok & (iv[np.maximum(i, 0), 1] >= times)


def lost_to_missed_rounds(jobs: list[Job], quorum: int, H: int, grace_s: float) -> float:
    """Chip-seconds of computed work overwritten because its learner missed merges."""
    return lost_from_intervals(
        [_intervals(j) for j in jobs], [j.step_s for j in jobs], quorum, H, grace_s
    )


def lost_from_intervals(
    ivs: list[np.ndarray], step_s: list[float], quorum: int, H: int, grace_s: float
) -> float:
    """Work (chip-seconds) lost to missed merges, from each learner's computing intervals.

    For every gap between two stretches of computing, if at least `quorum` other learners
    were computing at its middle, the rounds due in the gap closed without this learner;
    it loses its work on those fragments since its last contribution, about the gap's
    length (at most H steps), less what the grace window lets it still deliver."""
    lost = 0.0
    for j, iv in enumerate(ivs):
        if len(iv) < 2:
            continue
        gap = iv[1:, 0] - iv[:-1, 1]
        mid = iv[:-1, 1] + gap / 2
        others = sum(
            (running_at(o, mid).astype(int) for k, o in enumerate(ivs) if k != j),
            np.zeros(len(mid), dtype=int),
        )
        hit = (gap > grace_s) & (others >= quorum)
        span = np.minimum(gap - grace_s, H * step_s[j])
        lost += float((span * iv[:-1, 2])[hit].sum())
    return lost


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


def simulate(strategy: str, run: RunConfig, fail: FailureConfig) -> SimResult:
    """Simulate `strategy` on the fleet of `run` under the failures of `fail`."""
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
    merged = 1.0
    if strategy == "diloco":
        computed = barrier_rounds(jobs, run.H, run.horizon_s)
    elif strategy == "decoupled" and learners > 1:
        lost = lost_to_missed_rounds(jobs, quorum, run.H, grace_s=fail.step_s)
        merged = max(0.0, 1.0 - lost / max(computed, 1e-12))
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
    )
