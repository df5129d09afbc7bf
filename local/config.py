"""`ddiloco local`'s settings: one LocalConfig per run (local/launcher.py runs it).

    cfg = LocalConfig(learners=3, max_seconds=60, chaos="kill", seed=1)
    cfg = LocalConfig(max_steps=360, chaos="kill+pause", chaos_unit="steps")   # equal tokens
    LocalConfig(quorum=5, learners=4)   # ValueError: quorum must be in 1..learners (4), got 5

Every field is a knob of the CLI (local/cli.py) or of a bench; `__post_init__` refuses
settings that cannot run, with one line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ddiloco.local.chaos import Schedule
from ddiloco.wire.protocol import BROADCAST_ENCODINGS


@dataclass(kw_only=True)
class LocalConfig:
    learners: int = 4
    """M, learner processes."""
    quorum: int = 1
    """K, minimum contributors per merge."""
    grace: bool = True
    """Adaptive grace window after the quorum."""
    merge: str = "rda"
    merge_scale: str = "live"
    """SyncSettings.merge_scale: `live` averages each merge over the whole live set;
    `contributors` over those in the merge."""
    """rda or mean for non-embedding fragments."""
    model: str = "tiny"
    """A preset (tiny, small, base, gpt2) or hf:PATH (a local Hugging Face config)."""
    model_entry: str | None = None
    init_from: str | None = None
    """A model directory the job starts from (a `ddiloco export`, a Hugging Face snapshot;
    learner/weights.py): every learner's `--init-from`, and the evaluator's initial model."""
    data: str | None = None
    """Text, JSONL or Parquet files or a folder, or a uint16 .bin (None: stdlib sources)."""
    tokenizer: str | None = None
    """A local tokenizer for `data` (None: the model's own, else bytes)."""
    data_field: str = "text"
    """The text column of JSONL and Parquet data."""
    nproc_per_node: int = 1
    """Ranks per learner (a data-parallel group of processes, gloo on CPU)."""
    max_seconds: float = 0.0
    """Training wall-clock budget (0: none; 60 s when no step budget either)."""
    max_steps: int = 0
    """Inner steps per learner slot (0: none)."""
    total_tokens: int = 0
    """The job's token budget in merged tokens (the synchronizer's `total_tokens`; 0: none):
    the run ends once every learner exited 0 on hearing it was merged."""
    chaos: str = "none"
    chaos_unit: str = "seconds"
    """`steps`: the schedule's events fire at inner steps of their learner (needs
    `max_steps`, over which it is drawn; learner parts only, local/chaos.py)."""
    seed: int = 0
    h: int = 24
    fragments: int = 4
    tau: int = 2
    batch_size: int = 8
    inner_lr: float = 3e-3
    outer_lr: float = 1.0
    """eta. In minute-long runs (a few dozen outer rounds per fragment) outer momentum
    overshoots: eta 1, mu 0 gave the lowest eval loss at equal tokens of the settings tried
    (bench/RESULTS.md, "Quality: what closed most of the gap")."""
    outer_momentum: float = 0.0
    """mu; the synchronizer's own default (0.9) is the lineage's, for large-batch jobs."""
    eval_every: float = 5.0
    """Seconds between evaluations of the global model."""
    out: Path = field(default_factory=lambda: Path("runs") / time.strftime("local-%Y%m%d-%H%M%S"))
    schedule: Schedule | None = None
    """A ready chaos schedule; None derives one from `chaos` and `seed`."""
    hot_spares: int = 0
    """Pre-warmed spare learner processes standing by to replace killed ones (local/spare.py);
    0 restarts a killed learner as a fresh process."""
    spare_takeover: str = "after-delay"
    """When a killed learner's slot goes to a hot spare: `immediate` (hot spares, as the
    operator's `failurePolicy.hotSpares`: the schedule's long-tailed delay models a pod's
    rescheduling and image pull, which a started spare does not pay; without a ready spare
    the delay applies) or `after-delay` (the spare only saves the import once the delay is
    over; what the bench uses for every arm, so that arms differ only in the method)."""
    tls: bool = False
    """Serve the synchronizer over HTTPS (a CA of the run's own); learners verify it."""
    mtls: bool = False
    """Mutual TLS: also a client certificate per learner, required by the synchronizer.
    Implies `tls`."""
    learner_metrics: bool = False
    """Each learner slot serves Prometheus metrics on a free loopback port of its own,
    listed in <out>/metrics.json with the synchronizer's; their last scrapes are saved in
    <out>/metrics/ (local/scrapes.py)."""
    update_encoding: str = "bfloat16"
    """How learners send updates (wire/encodings.py: float32, bfloat16, int8, int4); the
    synchronizer is configured to accept that one alone."""
    broadcast_encoding: str = "bfloat16"
    """How the synchronizer serves merged fragments (wire/broadcast.py: bfloat16, float32,
    int8, int8-delta, int4-delta)."""
    sync_shards: int = 1
    """S, synchronizer shards, each a process with its own state dir and port."""
    tensorboard: Path | None = None
    """Write TensorBoard event files here as the run goes (local/tensorboard.py: eval loss,
    training loss per learner, goodput, merged-work ratio, bytes); needs tensorboardX."""

    def __post_init__(self) -> None:
        if self.mtls:
            self.tls = True
        if self.learners < 1:
            raise ValueError(f"learners must be >= 1, got {self.learners}")
        if not 1 <= self.quorum <= self.learners:
            raise ValueError(f"quorum must be in 1..learners ({self.learners}), got {self.quorum}")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if not 1 <= self.sync_shards <= self.fragments:
            raise ValueError(
                f"sync_shards must be in 1..fragments ({self.fragments}), got {self.sync_shards}"
            )
        if self.total_tokens < 0:
            raise ValueError(f"total_tokens must be >= 0, got {self.total_tokens}")
        if self.max_seconds <= 0 and self.max_steps <= 0 and self.total_tokens <= 0:
            self.max_seconds = 60.0
        if self.chaos_unit not in ("seconds", "steps"):
            raise ValueError(f"chaos_unit must be seconds or steps, got {self.chaos_unit!r}")
        if self.chaos_unit == "steps" and self.max_steps <= 0:
            raise ValueError("chaos in steps needs a step budget (max_steps)")
        if self.update_encoding not in ("float32", "bfloat16", "int8", "int4"):
            raise ValueError(
                f"update_encoding must be float32, bfloat16, int8 or int4, got "
                f"{self.update_encoding!r}"
            )
        if self.broadcast_encoding not in BROADCAST_ENCODINGS:
            raise ValueError(
                f"broadcast_encoding must be one of {', '.join(BROADCAST_ENCODINGS)}, got "
                f"{self.broadcast_encoding!r}"
            )
        if self.spare_takeover not in ("immediate", "after-delay"):
            raise ValueError(
                f"spare_takeover must be immediate or after-delay, got {self.spare_takeover!r}"
            )
