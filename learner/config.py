"""Learner knobs, in torchtitan's style: keyword-only fields, a docstring under each.

Every field can come from the environment (`DDILOCO_<FIELD>` upper-cased, as the operator
sets them in learner pods) and be overridden by `ddiloco learner` flags. No torch here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal


@dataclass(kw_only=True)
class LearnerConfig:
    # --- identity and synchronizer ---
    sync_url: str = "http://127.0.0.1:8470"
    """Base URL of the synchronizer (h2c)."""
    token: str = field(default="", repr=False)
    """Per-job bearer token (a Secret in Kubernetes); never logged."""
    learner_id: str = "learner-0"
    """Stable id of this learner slot; a replacement with the same id takes its place."""
    learner_index: int = 0
    """Index of this learner among `num_learners`: picks its data shard."""
    num_learners: int = 1
    """M, the number of learner slots (for data sharding only)."""

    # --- model and data ---
    model: str = "tiny"
    """Model preset (learner/model.py PRESETS)."""
    model_entry: str | None = None
    """`module:function` returning a Task: bring your own model and data."""
    data: str | None = None
    """Corpus: None = the Python standard library's sources; a text file, folder or uint16 .bin."""
    batch_size: int = 8
    """Sequences per inner step."""
    seed: int = 0
    """Seed of the initial model (identical on every learner) and of this learner's batches."""

    # --- inner optimizer (AdamW) ---
    inner_lr: float = 3e-3
    """Peak inner learning rate."""
    weight_decay: float = 0.1
    warmup_steps: int = 20
    """Linear warm-up of the inner learning rate, in inner steps."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this (0 disables)."""

    # --- Decoupled DiLoCo (algorithm.md §3-§4) ---
    h: int = 24
    """H: inner steps between two hand-overs of the same fragment."""
    num_fragments: int = 4
    """P: fragments the parameters are split into; one falls due every H/P steps."""
    tau: int = 2
    """tau: overlap steps; the learner never waits for a merged fragment."""
    adoption: Literal["overwrite", "rebase"] = "rebase"
    """What a learner does with a merged fragment that arrives. `overwrite` (the paper):
    theta_p <- Theta_p, dropping the steps it took on p since its last hand-over. `rebase`:
    theta_p <- Theta_p + (theta_p - theta_p at its last hand-over), keeping those steps (they
    go out with its next hand-over), so no step taken during the overlap tau is lost."""
    mix_alpha: float = 0.0
    """alpha, with `overwrite` only: theta <- alpha*theta_local + (1-alpha)*Theta on arrival
    (Streaming DiLoCo); 0 overwrites."""
    wire_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Precision of uploaded deltas."""
    upload_http2: bool = False
    """Send fragment uploads over HTTP/2 (h2c) instead of HTTP/1.1 on the same port. Control
    calls (long-poll heartbeats, downloads) always use HTTP/2. uvicorn's zttp advertises a fixed
    64 KiB receive window, which halves bulk upload throughput against HTTP/1.1 on the same
    server (bench/http2_upload.py: 0.11 vs 0.23 GB/s for 64 MiB on the 2-core machine)."""

    # --- budget and runtime ---
    max_steps: int = 0
    """Stop after this many inner steps (0: no step limit)."""
    max_seconds: float = 0.0
    """Stop after this many seconds of training (0: no time limit)."""
    max_tokens: int = 0
    """Stop after this many tokens of inner steps (0: no token limit)."""
    device: str = "auto"
    """`auto` picks cuda when present (bf16 autocast), else cpu."""
    threads: int = 1
    """torch intra-op threads on CPU."""
    slow_factor: float = 1.0
    """Chaos: each inner step takes this many times longer (a slower accelerator)."""
    poll_s: float = 0.5
    """Heartbeats are long polls: the synchronizer answers at once when a fragment merged
    or a round opened, else after this long (so also the longest heartbeat period)."""
    log_path: str | None = None
    """Append one JSON line per step and per fragment event here."""
    log_every: int = 50
    """Print a step line every this many steps."""

    def __post_init__(self) -> None:
        checks = {
            "num_learners": self.num_learners >= 1,
            "learner_index": 0 <= self.learner_index < self.num_learners,
            "batch_size": self.batch_size >= 1,
            "h": self.h >= 1,
            "num_fragments": 1 <= self.num_fragments <= self.h,
            "tau": self.tau >= 1,
            "mix_alpha": 0.0 <= self.mix_alpha < 1.0,
            "inner_lr": self.inner_lr > 0,
            "slow_factor": self.slow_factor >= 1.0,
            "max_steps": self.max_steps >= 0,
            "max_seconds": self.max_seconds >= 0,
            "max_tokens": self.max_tokens >= 0,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            k = bad[0]
            raise ValueError(f"invalid learner config: {k}={getattr(self, k)!r}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> LearnerConfig:
        """Fields from `DDILOCO_*` variables (`DDILOCO_H`, `DDILOCO_P` for num_fragments,
        `DDILOCO_MODEL`...), then `overrides` (None values ignored)."""
        env = os.environ if environ is None else environ
        alias = {"num_fragments": "P", "h": "H", "tau": "TAU"}
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"DDILOCO_{alias.get(f.name, f.name).upper()}")
            if raw is None or raw == "":
                continue
            kind = type(f.default) if f.default is not None else str
            if kind is bool:
                values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            else:
                values[f.name] = kind(raw) if kind in (int, float) else raw
        values |= {k: v for k, v in overrides.items() if v is not None}
        return cls(**values)
