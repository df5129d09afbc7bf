"""The inner learning-rate schedule: warm-up over the slot's steps, decay over the job's budget.

    lr = learning_rate(cfg, slot_step=120, progress=0.4)      # progress in [0, 1] or None

Warm-up is linear over the first `warmup_steps` of the *slot* (`DecoupledDiLoCo.slot_step`:
a replacement resumes where its slot was, it does not warm up again). Decay follows the
*job*: `progress` is the fraction of the budget done, so every learner of the job is at the
same point of the decay whatever its speed or when it joined (`budget_progress`):

- `constant`: the peak rate after warm-up, for jobs without a budget;
- `cosine`: from the peak down to `min_lr_ratio` of it, half a cosine over the budget;
- `wsd` (warm-up, stable, decay): the peak until the last `decay_fraction` of the budget,
  then linearly down to `min_lr_ratio` of it.

The budget a decay runs over is the job's merged tokens against its total
(`JoinResponse.total_tokens`, heard again on every heartbeat), else the learner's own
`max_steps` or `max_tokens`. A decaying schedule with none of those has nothing to decay
over and is refused at join (`ScheduleError`).
"""

from __future__ import annotations

import math

from ddiloco.cli.errors import UsageError
from ddiloco.learner.config import LearnerConfig

__all__ = ["ScheduleError", "budget_progress", "check", "decay_factor", "learning_rate"]


class ScheduleError(UsageError):
    """A decaying schedule without a budget to decay over (the learner exits 2 with it)."""


def budget_progress(
    cfg: LearnerConfig,
    *,
    job_total_tokens: int,
    job_tokens_merged: int,
    steps: int,
    tokens: int,
) -> float | None:
    """The fraction of the budget done, in [0, 1]: the job's merged tokens over its total
    when the job has a budget, else this process's steps over `max_steps`, else its tokens
    over `max_tokens`; None when there is no budget at all."""
    if job_total_tokens > 0:
        return min(1.0, max(0, job_tokens_merged) / job_total_tokens)
    if cfg.max_steps:
        return min(1.0, steps / cfg.max_steps)
    if cfg.max_tokens:
        return min(1.0, tokens / cfg.max_tokens)
    return None


def check(cfg: LearnerConfig, job_total_tokens: int) -> None:
    """Refuse a decaying schedule that has no budget to decay over."""
    if cfg.lr_schedule != "constant" and not (
        job_total_tokens > 0 or cfg.max_steps or cfg.max_tokens
    ):
        raise ScheduleError(
            f"lr_schedule {cfg.lr_schedule} decays over a budget and this job has none: set the "
            "job's token budget (the synchronizer's DDILOCO_TOTAL_TOKENS, spec.training."
            "totalTokens) or the learner's max_steps / max_tokens, or use lr_schedule constant"
        )


def decay_factor(cfg: LearnerConfig, progress: float | None) -> float:
    """The multiplier of the peak rate at `progress` of the budget (1 before any decay)."""
    if cfg.lr_schedule == "constant" or progress is None:
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.lr_schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    start = 1.0 - cfg.decay_fraction  # wsd
    if progress <= start:
        return 1.0
    return 1.0 - (1.0 - floor) * min(1.0, (progress - start) / cfg.decay_fraction)


def learning_rate(cfg: LearnerConfig, slot_step: int, progress: float | None) -> float:
    """The inner rate for the step at `slot_step` of the slot and `progress` of the budget."""
    warm = min(1.0, (slot_step + 1) / cfg.warmup_steps)
    return cfg.inner_lr * warm * decay_factor(cfg, progress)
