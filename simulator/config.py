"""Every knob of `ddiloco simulate`, with units, the paper's symbols and validation.

    from ddiloco.simulator.config import FailureConfig, RunConfig
    fail = FailureConfig(chip_mtbi_s=365 * 86400.0, slice_chips=16)
    run = RunConfig(chips=1_200_000, learners=8)

`FailureConfig` holds the paper's failure model and the pauses it causes;
`RunConfig` one scenario (fleet size, M, K, P, H, tau, horizon, seed). Defaults are the
assumptions under which `ddiloco simulate paper-table` reproduces the paper's goodput
table; they are global physical constants, not per-cell fits (see `paper.py`).
Every field is checked in `__post_init__`; a bad value raises ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Final

YEAR_S: Final[float] = 365.0 * 86400.0


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be > 0, got {value!r}")


def _non_negative(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value >= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RepairConfig:
    """Time for failed hardware to come back: an exponentiated Weibull distribution.

    Sample: scale_s * (-ln(1 - U**(1/alpha)))**(1/shape), U uniform on (0, 1). With
    shape < 1 and alpha > 1 it has a soft floor (few repairs are instant) and a long tail
    (a few take most of a day), as hardware swaps do.
    """

    scale_s: float = 1800.0
    """Weibull scale, seconds."""
    shape: float = 0.8
    """Weibull shape k (< 1: heavy tail)."""
    alpha: float = 2.0
    """Exponentiation power (> 1: fewer very short repairs)."""

    def __post_init__(self) -> None:
        _positive(self, "scale_s", "shape", "alpha")


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    """The failure model (Douillard et al. 2026) and what a failure costs each kind of job.

    Each chip fails as an independent Poisson process (mean time between interruptions
    `chip_mtbi_s`). A failure takes its whole slice (`slice_chips` chips) out of service
    until the repair completes. A synchronous job notices the failure when the step in
    flight fails to complete: that step is lost.
    """

    chip_mtbi_s: float = YEAR_S
    """Mean time between interruptions of one chip, seconds (paper: one year)."""
    slice_chips: int = 16
    """Chips taken out of service by one chip failure (a host group / slice)."""
    repair: RepairConfig = field(default_factory=RepairConfig)
    """Time until a failed slice is back in the pool."""
    step_s: float = 5.0
    """Inner step time xi_step of a full-size job, seconds (a step lost per failure)."""
    step_cv: float = 0.0
    """Per-slice step-time spread (coefficient of variation). A lock-step job waits for its
    slowest slice every step: its step lasts about step_s * (1 + step_cv * sqrt(2 ln n))
    for n slices, and the waiting counts against goodput. 0 in the paper table."""
    restart_s: float = 85.0
    """Non-elastic data-parallel: stop, swap a spare slice in, reload, restart; seconds."""
    shrink_s: float = 21.0
    """Elastic job (elastic DP, or one learner): pause to drop a failed slice, seconds."""
    regrow_s: float = 30.0
    """Elastic job: pause to add repaired slices back, seconds."""
    replan_s: float = 2.0
    """Elastic job: a failure during a reconfiguration changes the target mesh and adds
    this much re-planning to the pause. Seconds."""
    regrow_batch_s: float = 200.0
    """Elastic job: repaired slices wait at most this long to ride along with the next
    reconfiguration; if none comes, a dedicated regrow pause runs. Seconds."""

    def __post_init__(self) -> None:
        _positive(self, "chip_mtbi_s", "slice_chips", "step_s")
        _non_negative(
            self, "step_cv", "restart_s", "shrink_s", "regrow_s", "replan_s", "regrow_batch_s"
        )


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One scenario: a fleet, how it is split into learners, and how long to simulate."""

    chips: int = 1_200_000
    """Accelerators in the fleet, N."""
    learners: int = 8
    """Learner slots M (1 with strategy dp / elastic_dp)."""
    quorum: int = 1
    """Minimum quorum K, 1 <= K <= M (K = M: synchronous DiLoCo)."""
    fragments: int = 24
    """Fragments P."""
    H: int = 24
    """Inner steps between two merges of the same fragment."""
    tau: int = 2
    """Overlap: steps a learner trains between handing over a fragment and getting it back."""
    horizon_s: float = 4 * 86400.0
    """Simulated wall time, seconds."""
    seed: int = 0
    """Seed of every random draw."""

    def __post_init__(self) -> None:
        _positive(self, "chips", "learners", "quorum", "fragments", "H", "tau", "horizon_s")
        if self.quorum > self.learners:
            raise ValueError(
                f"RunConfig.quorum must be <= learners ({self.learners}), got {self.quorum}"
            )
        if self.chips < self.learners:
            raise ValueError(f"RunConfig.chips must be >= learners, got {self.chips}")
        if self.fragments > self.H:
            raise ValueError(
                f"RunConfig.fragments must be <= H ({self.H}), got {self.fragments}: "
                "the learner hands over at most one fragment per step"
            )


@dataclass(frozen=True, kw_only=True)
class NetworkConfig:
    """Model size, wire precision and the links between sites (one learner per site)."""

    params: float = 12e9
    """Trainable parameters of the model."""
    grad_bits: int = 16
    """Data-parallel gradient all-reduce precision, bits per value (bf16)."""
    up_bits: int = 16
    """Decoupled DiLoCo: learner -> synchronizer fragment precision (bf16; 4 = int4)."""
    down_bits: int = 16
    """Decoupled DiLoCo: synchronizer -> learner merged fragment precision."""
    link_gbps: tuple[float, ...] = (2.0, 3.0, 4.0, 5.0)
    """Wide-area link of each site to the others, Gbit/s (one entry per site)."""
    latency_s: float = 0.035
    """One-way wide-area latency between sites, seconds."""
    ranks_per_site: int = 1
    """Data-parallel ranks (and Decoupled learners) per site. The all-reduce is one flat
    ring over all ranks, a site's ranks next to each other, so each link between sites
    carries 2(R-1)/R of the gradient per direction and every one of the ring's 2(R-1) steps
    waits for a chunk to cross it (R = sites x ranks_per_site)."""
    ring_step_latencies: float = 1.0
    """One-way latencies each step of the all-reduce ring waits: 1 for a collective that
    streams each chunk on as it arrives; 2 where every message first waits for the
    receiver's ready notice (gloo's TCP pairs: measured 2.0-2.1 per step, 4 ranks over a
    shaped link of 40 and 80 ms round trip, bench/wan_study.py --probe)."""
    dp_overlap: bool = True
    """Whether data-parallel's all-reduce overlaps its compute (bucketed backward: the step
    lasts max(compute, all-reduce)); False: it follows the compute (compute + all-reduce),
    as in a loop that all-reduces the whole gradient after backward."""

    def __post_init__(self) -> None:
        _positive(self, "params", "grad_bits", "up_bits", "down_bits", "ranks_per_site")
        _non_negative(self, "ring_step_latencies")
        _non_negative(self, "latency_s")
        if not self.link_gbps or min(self.link_gbps) <= 0:
            raise ValueError(f"NetworkConfig.link_gbps must be positive, got {self.link_gbps}")

    @property
    def sites(self) -> int:
        return len(self.link_gbps)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config as a plain dict (for reports and JSON)."""
    return asdict(cfg)
