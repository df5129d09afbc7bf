"""Inputs, settings and result of the protocol replay (`protocol.py`).

    Incarnation(join, times, tokens=None, end=None)   # one learner process and its steps
    Learner(id, step_s, incarnations, silent=[])      # a learner slot
    ProtocolConfig(fragments=4, H=24, ...)            # defaults: the synchronizer's, the learner's
    ProtocolResult                                     # where every computed token went

The synchronizer's defaults are read from `SyncSettings` and the learner's rules
(fragment offsets, the H/2 request threshold) mirror learner/fragments.py and
learner/diloco.py; `tests/unit/test_sim_protocol.py` checks that they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.rounds import GracePolicy


def _service_default(name: str) -> Any:
    """The synchronizer's default for setting `name` (one source for both)."""
    return SyncSettings.model_fields[name].default


@dataclass
class Incarnation:
    """One learner process: joined at `join`, completed steps at `times` (sorted, seconds),
    `tokens[i]` behind step i (1 each if None), killed at `end` (None: ran to the end)."""

    join: float
    times: np.ndarray
    tokens: np.ndarray | None = None
    end: float | None = None
    cum: np.ndarray = field(init=False, repr=False)
    """cum[k]: tokens of the first k steps."""
    at: list[float] = field(init=False, repr=False)
    """`times` as a list (bisect on it is faster than numpy for one value)."""

    def __post_init__(self) -> None:
        self.times = np.asarray(self.times, dtype=float)
        tok = np.ones(len(self.times)) if self.tokens is None else np.asarray(self.tokens, float)
        if len(tok) != len(self.times):
            raise ValueError(f"{len(tok)} token counts for {len(self.times)} steps")
        self.cum = np.concatenate([[0.0], np.cumsum(tok)])
        self.at = self.times.tolist()


@dataclass
class Learner:
    """One learner slot: its processes in time order, the step time its heartbeats report,
    and the stretches (start, end) in which it was frozen (no heartbeat)."""

    id: str
    step_s: float
    incarnations: list[Incarnation]
    silent: list[tuple[float, float]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class ProtocolConfig:
    """The job's protocol settings; defaults are the synchronizer's and the learner's."""

    fragments: int = 4
    H: int = 24
    quorum: int = _service_default("quorum")
    grace: bool = _service_default("grace")
    tau: int = _service_default("tau")
    max_staleness: int = _service_default("max_staleness")
    liveness_s: float = _service_default("liveness_s")
    ema_alpha: float = _service_default("ema_alpha")
    adoption: Literal["rebase", "overwrite"] = "rebase"
    sync_s: float = 0.0
    """Merge duration (xi_sync): a new version is published this long after its round."""
    up_s: float = 0.0
    """Hand-over to the synchronizer."""
    down_s: float = 0.0
    """Publication to the learner having the merged copy."""
    drain_s: float = 0.0
    """After the horizon (learners stop): merges in this window still count."""
    sample: int | None = None
    """Replay only this many fragments (None: all)."""

    def __post_init__(self) -> None:
        if not 1 <= self.fragments <= self.H:
            raise ValueError(f"ProtocolConfig.fragments must be in 1..H, got {self.fragments}")
        if self.adoption not in ("rebase", "overwrite"):
            raise ValueError(f"ProtocolConfig.adoption: rebase or overwrite, not {self.adoption}")

    def grace_policy(self) -> GracePolicy:
        return GracePolicy(
            enabled=self.grace,
            gamma=_service_default("grace_gamma"),
            cap_steps=_service_default("grace_cap_steps"),
            default_s=_service_default("grace_default_s"),
            tau=self.tau,
        )

    def offset(self, p: int) -> int:
        """Step of p's first hand-over (learner/fragments.py Schedule.offset, or H)."""
        return (p * self.H) // self.fragments or self.H

    @property
    def min_request_steps(self) -> int:
        """Steps that must stand behind p before a round's request is answered."""
        return max(1, self.H // 2)

    def replayed(self) -> list[int]:
        n = self.fragments if self.sample is None else max(1, min(self.sample, self.fragments))
        return sorted({(i * self.fragments) // n for i in range(n)})


@dataclass
class ProtocolResult:
    """Work in tokens x replayed fragments, and counts of updates and merges."""

    computed: float = 0.0
    merged: float = 0.0
    refused: float = 0.0
    dropped: float = 0.0
    unsent: float = 0.0
    waiting: float = 0.0
    handed_over: int = 0
    fresh_updates: int = 0
    late_updates: int = 0
    refused_updates: int = 0
    merges: int = 0
    contributions: int = 0
    staleness_sum: int = 0

    @property
    def merged_work_ratio(self) -> float:
        return self.merged / self.computed if self.computed else 0.0

    @property
    def mean_staleness(self) -> float:
        return self.staleness_sum / self.contributions if self.contributions else 0.0
