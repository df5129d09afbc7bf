"""Settings of the synchronizer, read from the environment (prefix `DDILOCO_`).

    DDILOCO_TOKEN=s3cret DDILOCO_STATE_DIR=/var/lib/ddiloco DDILOCO_QUORUM=1 ddiloco synchronizer

TLS, so that traffic that leaves the cluster is encrypted: DDILOCO_TLS_CERT_FILE and
DDILOCO_TLS_KEY_FILE (both or neither) serve HTTPS, ALPN h2 and http/1.1 on the one port;
DDILOCO_TLS_CLIENT_CA_FILE also requires a client certificate signed by that CA (mutual TLS).
Tokens: DDILOCO_TOKEN, or DDILOCO_TOKEN_FILE whose every non-empty line is accepted and which is
re-read when it changes (rotation, auth.py).

Two groups. `SyncSettings`: the service and the method (quorum, grace window, merge rule and
weights, outer optimizer, staleness, guards), with the paper's symbol where it has one (README
"How it fits together"). `TuningSettings` (`SyncSettings.tuning`): how fast the same results are
reached (threads, pieces, upload slots, the fragment files' lag, buffer priming); no tuning knob
changes what a merge computes. Both read `DDILOCO_<NAME>` (one namespace: a tuning knob is
`DDILOCO_SNAPSHOT_LAG`, not a nested name), and `SyncSettings(snapshot_lag=0)` files a tuning
knob given by name under `tuning`. `get_settings()` is cached; tests build `SyncSettings(...)`
directly.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ddiloco.wire.auth import StaticTokens, TokenFile, Tokens
from ddiloco.wire.protocol import (
    DEFAULT_BROADCAST_ENCODING,
    BroadcastEncoding,
    MergeRule,
    UpdateEncoding,
)

DEFAULT_PORT = 8470


class TuningSettings(BaseSettings):
    """Performance knobs of the synchronizer: each changes how fast it works, never what it
    computes or keeps (the merge's bits, the crash guarantees). The defaults suit any core
    count; bench/RESULTS.md ("Figures behind the code") has the measurements behind them.

    - `cpu_slots` (0: the usable cores less one, at least 1): uploads that run their passes
      over the bytes (decode, norm, checksum, their term of the round's sum) at once. The
      merge takes no slot, so it shares the cores with this many uploads, not with every
      connection.
    - `merge_first` (on): while a merge computes, the upload port's body reads wait at their
      next chunk (at most 1 s; locks.py `MergeGate`), so the merge gets the cores.
    - `prime_buffers` (on): when the layout is adopted (at init, at a restart before
      serving), make and touch the buffers the first merges and uploads take (prefault.py),
      so that the first merge of each fragment is not the slowest.
    - `snapshot_lag` (8): merges a fragment's file may trail the version served. A merge is
      durable once its journal record is (storage/journal.py; a restart redoes it from the
      pending log), and the file is written in the background; the state volume holds up to
      this many rounds of updates per fragment beside the files, and a restart redoes up to
      this many merges. 0: each merge writes its file before its version is served.
    - `snapshot_every` (0: half of `snapshot_lag`, at least 1; at most `snapshot_lag`): merges
      between the background writer's files of a fragment (the latest state each time).
    - `torch_threads` (0: a quarter of the cores, at least 1): threads one tensor operation
      may use (`torch.set_num_threads`); the synchronizer runs many operations at once.
    - `merge_threads` (0: the usable cores over `torch_threads`; 1: none): pieces a merge's
      passes over a large tensor are split into, each on a thread (parallel_passes.py; the
      same bits as one piece).
    """

    model_config = SettingsConfigDict(env_prefix="DDILOCO_", extra="ignore")

    cpu_slots: int = Field(0, ge=0, le=4096)
    merge_first: bool = True
    prime_buffers: bool = True
    snapshot_lag: int = Field(8, ge=0, le=64)
    snapshot_every: int = Field(0, ge=0, le=64)
    torch_threads: int = Field(0, ge=0, le=1024)
    merge_threads: int = Field(0, ge=0, le=64)

    def op_threads(self) -> int:
        """`torch_threads`, or its default: a quarter of the cores, at least one."""
        return self.torch_threads or max(1, (os.cpu_count() or 1) // 4)

    def merge_ways(self) -> int:
        """`merge_threads`, or its default: the usable cores over `op_threads`, at least 1."""
        if self.merge_threads:
            return self.merge_threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return max(1, (cores or os.cpu_count() or 1) // self.op_threads())

    def upload_slots(self) -> int:
        """`cpu_slots`, or its default: the usable cores less one, at least one."""
        if self.cpu_slots:
            return self.cpu_slots
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return max(1, (cores or os.cpu_count() or 1) - 1)

    def snapshot_period(self) -> int:
        """Merges between the background writer's files of a fragment (`snapshot_every`)."""
        return self.snapshot_every or max(1, self.snapshot_lag // 2)

    @model_validator(mode="after")
    def _snapshot_every(self) -> TuningSettings:
        if self.snapshot_lag and self.snapshot_every > self.snapshot_lag:
            raise ValueError(
                f"DDILOCO_SNAPSHOT_EVERY={self.snapshot_every} exceeds DDILOCO_SNAPSHOT_LAG="
                f"{self.snapshot_lag}: a fragment's file would trail more than the lag before "
                "the writer wrote it; give at most the lag (0: half of it)"
            )
        return self


TUNING = frozenset(TuningSettings.model_fields)
"""The tuning knobs' names: `SyncSettings(**{name: value})` files them under `tuning`."""


class SyncSettings(BaseSettings):
    """Synchronizer knobs. Invalid values are refused at startup with the field's name."""

    model_config = SettingsConfigDict(env_prefix="DDILOCO_", extra="ignore")

    # --- service ---
    host: str = "127.0.0.1"
    """Address to bind; 0.0.0.0 in a pod."""
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    """TCP port; HTTP/2 cleartext (h2c, prior knowledge) and HTTP/1.1 on the same port, or
    with TLS on, HTTPS with ALPN h2 and http/1.1."""
    upload_port: int | None = Field(None, ge=0, le=65535)
    """A second port that serves only update uploads (POST /v1/fragments/{p}/updates, HTTP/1.1
    or HTTPS with the same certificate, client CA and tokens): a thread per connection reads
    each body straight into its buffer, far cheaper than through the ASGI server (upload_port.py).
    Learners learn it at join and fall back to `port` when they cannot reach it. None: off;
    0: any free port (tests)."""
    token: SecretStr | None = None
    """Per-job bearer token every learner call must carry (the operator puts it in a Secret)."""
    token_file: Path | None = None
    """Alternative to `token`: a file of tokens (a mounted Secret), one per non-empty line, all
    accepted; re-read when it changes, so a token rotates without a restart ("new\\nold" while
    learners move over, then "new")."""
    tls_cert_file: Path | None = None
    """PEM server certificate (chain); with `tls_key_file`, serve HTTPS instead of h2c."""
    tls_key_file: Path | None = None
    """PEM private key of `tls_cert_file`."""
    tls_client_ca_file: Path | None = None
    """PEM CA: require a client certificate it signed (mutual TLS). Needs TLS on."""
    state_dir: Path = Path("ddiloco-state")
    """Where global fragments, outer momentum, versions, pending updates and the learner
    ledger persist."""
    max_init_bytes: int = Field(16 << 30, ge=1 << 10)
    """The largest initial-model upload accepted, before the layout is known (413 above).
    Update bodies are capped by their fragment's size in float32, from the layout."""
    body_timeout_s: float = Field(30.0, gt=0.0)
    """A request body that sends nothing for this long is refused (408)."""
    shard: int = Field(0, ge=0)
    """This synchronizer's shard index (`DDILOCO_SHARD`), 0 <= shard < shards. A shard owns
    the fragments `protocol.shard_map(layout, shards)` gives it: it stores, merges and serves
    only those, with its own state directory; the others are refused (421, naming the owner)."""
    shards: int = Field(1, ge=1)
    """S, the job's synchronizer shards (`DDILOCO_SHARDS`); 1: one synchronizer for all."""
    tuning: TuningSettings = Field(default_factory=TuningSettings)
    """The performance knobs (`TuningSettings`), read from their own `DDILOCO_` names."""
    metrics: bool = True
    """Serve Prometheus metrics on GET /metrics (docs/operations.md "Metrics"). False
    (`DDILOCO_METRICS=0`): every instrument is a no-op and /metrics answers 404."""

    # --- checkpoints outside the job, and a job started from one (checkpoints.py) ---
    checkpoint_dest: str | None = Field(None, min_length=1, max_length=1024)
    """Where periodic checkpoints go (`DDILOCO_CHECKPOINT_DEST`): a local directory (a volume
    that outlives the job) or an fsspec URL (s3://bucket/prefix; credentials from the
    environment, as s3fs reads them). None: no checkpoints."""
    checkpoint_every_versions: int = Field(0, ge=0)
    """Write a checkpoint once the global version (the sum of the fragments') moved this
    much since the last attempt; 0: not by versions."""
    checkpoint_every_seconds: float = Field(0.0, ge=0.0)
    """Write a checkpoint this many seconds after the last attempt, if anything was merged
    since; 0: not by time."""
    checkpoint_keep: int = Field(3, ge=1)
    """The newest checkpoints kept under `checkpoint_dest`; older ones are deleted."""
    init_from: str | None = Field(None, min_length=1, max_length=1024)
    """`DDILOCO_INIT_FROM` (`--init-from`): on a fresh state dir, start the global model from
    this checkpoint (Theta, outer momentum, versions), checkpoint destination (its
    `latest`) or plain model directory (Theta; its layout from the first learner); a path or
    an fsspec URL. Ignored once the state dir is initialized."""

    # --- rounds (quorum and the adaptive grace window, the paper's Eq. 3) ---
    quorum: int = Field(1, ge=1)
    """K: merge a fragment as soon as this many learners contributed to it."""
    grace: bool = True
    """Adaptive grace window after the quorum (Eq. 3); False merges at the quorum."""
    grace_gamma: float = Field(0.5, gt=0.0, lt=1.0)
    """gamma: the share of the overlap's slack the grace window may spend."""
    grace_cap_steps: float = Field(1.0, ge=0.0)
    """Upper bound of the grace window, in inner steps of the slowest live learner."""
    grace_default_s: float = Field(0.5, ge=0.0)
    """Grace window used before any step-time estimate exists, in seconds."""
    tau: int = Field(2, ge=1)
    """tau: inner steps a learner keeps training before it needs the merged copy back."""
    ema_alpha: float = Field(0.2, gt=0.0, le=1.0)
    """Weight of the newest sample in the moving averages of xi_step, xi_quorum, xi_sync."""
    liveness_s: float = Field(10.0, gt=0.0)
    """A learner silent for this long is treated as gone (weight 0, not waited for)."""
    grace_step_ratio: float = Field(4.0, ge=1.0)
    """A live learner's step time enters xi_step (and so the grace window and its cap) at
    most this multiple of the median step time of the other live learners: one learner
    reporting an hour-long step cannot hold every round open for an hour. A learner this
    much slower than the others is merged when it makes a round, not waited for."""

    # --- learners (what the synchronizer keeps per learner id) ---
    max_learners: int = Field(1024, ge=1, le=1 << 20)
    """The most learner records kept: the job's slots plus a margin for renamed ones (the
    operator sets it from the job). A join of a new learner id beyond it is refused (409),
    unless a retired record holding nothing (no data position, no work) can make room."""
    retire_after_s: float = Field(3600.0, gt=0.0)
    """A learner unheard for this long (and at least `liveness_s`; since this process
    started, for one not heard since) is retired: left out of status and metrics. Its
    record stays in the ledger (its incarnation count and data position survive), and it
    is listed again as soon as it speaks."""
    max_tokens_per_step: int = Field(1 << 24, ge=1, le=(1 << 53) - 1)
    """The most tokens one inner step of a learner may claim (16 Mi: a 4,096-sequence
    batch of 4,096 tokens over the whole learner). A learner's updates are bounded by the
    tokens per step it declared at join, and by this; a join declaring more is refused."""

    # --- the job's budget (synchronizer/budget.py) ---
    total_tokens: int = Field(0, ge=0, le=(1 << 63) - 1)
    """Train the job on this many tokens, counted as merged (`Status.tokens_merged`: the
    tokens behind merged contributions, averaged over fragments); 0: no budget. Once they
    are merged the job is finished: status says so, heartbeats answer `finished` and the
    learners hand over what they hold and exit 0. Derived from the fragments' durable
    counts, so a restarted synchronizer is finished too. Updates arriving after that are
    still accepted and merged (real work, already computed). With shards, each shard
    counts its own fragments and a learner stops when any shard says finished."""

    # --- merge (token weighting, radial-directional averaging, outer Nesterov) ---
    merge: MergeRule = "rda"
    """How non-embedding fragments combine outer gradients (`rda` or the weighted `mean`);
    embedding fragments always take the weighted mean."""
    rda_granularity: Literal["tensor", "fragment"] = "tensor"
    """Radial-directional averaging per tensor (default) or over the whole fragment."""
    weighting: Literal["tokens2_per_step", "tokens", "uniform"] = "tokens2_per_step"
    """Contribution weight: tokens^2/steps (paper), tokens, or 1."""
    merge_scale: Literal["contributors", "live"] = "live"
    """What a merge's progress is averaged over. `live` (default): the contributors'
    average times min(1, the merge's tokens / the token mass the whole live set hands over
    per period), so K = 1 moves Theta like averaging over every learner. `contributors`:
    the contributions present in the merge only (the paper's rule; since late work is
    merged too, with K = 1 and one contributor per merge Theta then moves by the *sum* of
    the learners' deltas over a period). docs/design.md "The merge scale" has the measurements
    behind the default."""
    outer_lr: float = Field(0.7, gt=0.0)
    """eta: outer learning rate."""
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """mu: outer momentum."""
    nesterov: bool = True
    """Nesterov momentum (paper); False gives heavy-ball."""
    max_staleness: int = Field(4, ge=0)
    """Accept an update based on up to this many versions before the current one. Its
    progress is the outer gradient (Delta_m = -delta_m, the delayed pseudo-gradient of
    asynchronous Local-SGD) applied to the current Theta, so a learner that missed a round
    has its work merged into the next one instead of thrown away. 0: only updates based on
    the current version are accepted (the paper's strict rule)."""
    counter_cap_steps: int = Field(96, ge=1)
    """Cap on the steps (and proportionally tokens) a contribution may claim (a few H)."""
    max_update_ratio: float = Field(2.0, gt=0.0)
    """Refuse an update whose norm exceeds this multiple of the global fragment's own norm.
    Needs no history, so it holds on a fresh or restarted synchronizer."""
    max_norm_ratio: float = Field(100.0, gt=1.0)
    """Refuse an update whose norm exceeds this multiple of the recent median norm (kept in
    the fragment file, so it too survives a restart)."""
    broadcast_encoding: BroadcastEncoding = DEFAULT_BROADCAST_ENCODING
    """How merged fragments are served to learners (wire/broadcast.py): `bfloat16` (the
    default: learners rebase on Theta rounded to bfloat16, level with `float32` at equal
    tokens, at half its bytes), `float32`, `int8` (blockwise absmax codes of Theta, a float32
    scale per 128 values), `int8-delta` or `int4-delta` (the difference from the served copy
    the learner holds, quantized so that its error is carried into the next one: a learner
    that follows every merge holds what the synchronizer serves bit for bit, within half a
    quantization step of Theta; one that missed a version, or after a restart, gets it whole
    in float32). The delta encodings keep a float32 copy of each fragment's served copy
    beside Theta."""
    update_encodings: Annotated[list[UpdateEncoding], NoDecode] = Field(
        default_factory=lambda: ["float32", "bfloat16"], min_length=1
    )
    """The update encodings accepted from learners (wire/encodings.py): float32, bfloat16,
    int8, int4; `DDILOCO_UPDATE_ENCODINGS=int4,bfloat16` (a comma list, or JSON). An update in
    any other is refused (415) before anything is written; a learner learns the list at join
    and stops with one line if its own is not in it."""

    @model_validator(mode="before")
    @classmethod
    def _file_tuning(cls, values: object) -> object:
        """Tuning knobs given by name (`SyncSettings(snapshot_lag=0)`, the CLI's flags) go
        into `tuning`, the rest of it read from the environment as usual."""
        if not isinstance(values, dict) or not TUNING & values.keys():
            return values
        rest = {k: v for k, v in values.items() if k not in TUNING}
        given = rest.pop("tuning", None)
        knobs = given.model_dump() if isinstance(given, TuningSettings) else dict(given or {})
        knobs |= {k: v for k, v in values.items() if k in TUNING}
        return rest | {"tuning": TuningSettings(**knobs)}

    @field_validator("update_encodings", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        """`int4,bfloat16` (the environment's comma list) or `["int4", "bfloat16"]` (JSON)."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [v.strip() for v in text.split(",") if v.strip()]
        return value

    @model_validator(mode="after")
    def _token_source(self) -> SyncSettings:
        if self.token is None and self.token_file is None:
            raise ValueError(
                "set DDILOCO_TOKEN or DDILOCO_TOKEN_FILE: every learner call is authenticated"
            )
        return self

    @model_validator(mode="after")
    def _shard_index(self) -> SyncSettings:
        if not 0 <= self.shard < self.shards:
            raise ValueError(
                f"DDILOCO_SHARD={self.shard} is out of range for DDILOCO_SHARDS={self.shards}: "
                f"give 0 <= shard < shards"
            )
        return self

    @model_validator(mode="after")
    def _checkpoints(self) -> SyncSettings:
        if self.checkpoint_dest and not (
            self.checkpoint_every_versions or self.checkpoint_every_seconds
        ):
            raise ValueError(
                "DDILOCO_CHECKPOINT_DEST is set but neither DDILOCO_CHECKPOINT_EVERY_VERSIONS "
                "nor DDILOCO_CHECKPOINT_EVERY_SECONDS: set one or both"
            )
        if self.shards > 1 and (self.checkpoint_dest or self.init_from):
            raise ValueError(
                "checkpoints (DDILOCO_CHECKPOINT_DEST) and DDILOCO_INIT_FROM are not supported "
                f"with DDILOCO_SHARDS={self.shards}: a checkpoint holds every fragment, a shard "
                "only its own; run one synchronizer to checkpoint or resume"
            )
        return self

    @model_validator(mode="after")
    def _tls_files(self) -> SyncSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("set both DDILOCO_TLS_CERT_FILE and DDILOCO_TLS_KEY_FILE, or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError(
                "DDILOCO_TLS_CLIENT_CA_FILE (mutual TLS) needs DDILOCO_TLS_CERT_FILE and "
                "DDILOCO_TLS_KEY_FILE"
            )
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    def tokens(self) -> Tokens:
        """The accepted tokens: fixed (`token`) or read from `token_file` as it changes."""
        if self.token is not None:
            return StaticTokens(self.token.get_secret_value())
        assert self.token_file is not None
        return TokenFile(self.token_file)

    def bearer_token(self) -> str:
        """The (first) token in force now."""
        return self.tokens().current()


@lru_cache
def get_settings() -> SyncSettings:
    return SyncSettings()
