"""Learner knobs, in torchtitan's style: a docstring under each field, validated by pydantic.

Every field can come from the environment (`DDILOCO_<FIELD>` upper-cased, as the operator
sets them in learner pods; `LearnerConfig.env_names()` lists them) and be overridden by
`ddiloco learner` flags. A value that does not parse as its field (`DDILOCO_ADOPTION=rebse`,
`DDILOCO_H=12.0`, `DDILOCO_GRAD_CLIP=nan`) is refused, naming the variable, never taken as
the default. No torch here.

    cfg = LearnerConfig.from_env(strict=True, learner_id="l0")   # os.environ, then overrides
    cfg = LearnerConfig(h=12, num_fragments=3)                   # fields only, for tests
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

from pydantic import BeforeValidator, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from ddiloco.learner.uploads import upload_overrides

if TYPE_CHECKING:
    from ddiloco.wire.auth import Tokens
    from ddiloco.wire.tls import ClientTLS

ENV_PREFIX: Final = "DDILOCO_"
ENV_ALIASES: Final[Mapping[str, str]] = MappingProxyType({"h": "H", "num_fragments": "P"})
"""Fields whose variable is the paper's symbol (`DDILOCO_H`, `DDILOCO_P`), not the field name."""

READ_ELSEWHERE: Final[Mapping[str, str]] = MappingProxyType(
    {
        "DDILOCO_LOG_LEVEL": "`ddiloco learner` (learner/cli.py): the default of --log-level",
    }
)
"""The `DDILOCO_*` names a learner process may carry that LearnerConfig does not read, each
with the code that does. `from_env(strict=True)` accepts these and refuses every other unread
`DDILOCO_*` name; this is the one list of them, so add a name only with the code reading it."""


def _whole_number(value: Any) -> Any:
    """An int field takes an int or the text of one: "12" but not "12.0" or "1e3" (pydantic
    alone would take "12.0" as 12, and a float knob set as an int knob is a typo to refuse)."""
    if isinstance(value, str):
        text = value.strip()
        if not text.lstrip("+-").isdigit():
            raise ValueError(f"not an integer: {value!r}")
        return int(text)
    return value


Int = Annotated[int, BeforeValidator(_whole_number)]

_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("learner_environ", default=None)
"""The environment `from_env` reads (os.environ when None)."""


class _MappingEnv(EnvSettingsSource):
    """pydantic-settings' environment source, reading a given mapping instead of os.environ."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._mapping = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {
            k.lower(): v
            for k, v in self._mapping.items()
            if k.startswith(ENV_PREFIX) and not (self.env_ignore_empty and v == "")
        }


@contextmanager
def _reading(environ: Mapping[str, str] | None) -> Iterator[None]:
    token = _ENVIRON.set(environ)
    try:
        yield
    finally:
        _ENVIRON.reset(token)


class LearnerConfig(BaseSettings):
    """What one learner runs with. Keyword arguments win over the environment."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,
        extra="forbid",
        populate_by_name=True,
        allow_inf_nan=False,
        validate_default=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        environ = _ENVIRON.get()
        if environ is None:  # a plain LearnerConfig(...): its arguments and defaults only
            return (init_settings,)
        return (init_settings, _MappingEnv(settings_cls, environ))

    # --- identity and synchronizer ---
    sync_url: str = "http://127.0.0.1:8470"
    """Base URL of the synchronizer: http:// (h2c) or https:// (TLS, HTTP/2 by ALPN). A
    sharded synchronizer: a comma-separated list of its S shard URLs, in shard order
    (`sync_urls`; synchronizer/shards.py)."""
    token: str = Field("", repr=False)
    """Per-job bearer token (a Secret in Kubernetes); never logged."""
    token_file: str | None = None
    """A file holding the token instead (a mounted Secret): its first non-empty line is sent,
    and the file is re-read when it changes and on a 401 before retrying (token rotation)."""
    ca_file: str | None = None
    """PEM CA to verify an https synchronizer against (the system trust store without it)."""
    client_cert_file: str | None = None
    """PEM client certificate for mutual TLS (with `client_key_file`)."""
    client_key_file: str | None = None
    """PEM private key of `client_cert_file`."""
    learner_id: str = "learner-0"
    """Stable id of this learner slot; a replacement with the same id takes its place."""
    learner_index: Int = Field(0, ge=0)
    """Index of this learner among `num_learners`: picks its data part."""
    num_learners: Int = Field(1, ge=1)
    """M, the number of learner slots (for data parting only)."""

    # --- model and data ---
    model: str = "tiny"
    """Model preset (learner/model.py PRESETS) or `hf:PATH`, a local Hugging Face config or
    model directory (its safetensors weights, if any, are the initial model: learner/hf.py)."""
    model_entry: str | None = None
    """`module:function` returning a Task: bring your own model and data."""
    data: str | None = None
    """Corpus: None = the Python standard library's sources; a text file, folder or uint16 .bin."""
    tokenizer: str | None = None
    """A local tokenizer (a directory or tokenizer.json) for `data`; None: the model's own (an
    `hf:` model directory's), else byte-level tokens."""
    data_field: str = "text"
    """The text column of JSONL and Parquet data."""
    batch_size: Int = Field(8, ge=1)
    """Sequences per micro-batch, per rank."""
    grad_accum: Int = Field(1, ge=1, le=4096)
    """Micro-batches per inner step (gradient accumulation): a step trains
    `grad_accum * batch_size` sequences per rank, each micro-batch a draw of the slot's
    stream (learner/corpus.py), with one optimizer step and one gradient all-reduce."""
    seq_len: Int | None = Field(None, ge=1)
    """Tokens per training sequence; None: the model's context length (a GPT preset's
    block_size, an hf config's max_position_embeddings). Refused above that length."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute precision of the forward pass: bf16 autocast (parameters, gradients and the
    optimizer stay float32) or fp32. `auto`: bf16 on CUDA, fp32 on CPU."""
    seed: Int = 0
    """Seed of the initial model (identical on every learner) and of this learner's batches."""
    init_from: str | None = None
    """A model directory the job's model starts from instead of its seeded init: a previous
    job's `ddiloco export` or a Hugging Face snapshot (safetensors only; learner/weights.py).
    Every learner loads it; the first to join uploads it as the job's initial model. Refused
    at startup, with the first mismatch named, when it is not the job's model."""

    # --- inner optimizer (AdamW) and its schedule (learner/schedule.py) ---
    inner_lr: float = Field(3e-3, gt=0.0)
    """Peak inner learning rate."""
    weight_decay: float = Field(0.1, ge=0.0)
    """AdamW's decoupled weight decay."""
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    """AdamW's first-moment decay."""
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    """AdamW's second-moment decay."""
    warmup_steps: Int = Field(20, ge=1)
    """Linear warm-up of the inner learning rate, in the slot's inner steps."""
    lr_schedule: Literal["constant", "cosine", "wsd"] = "constant"
    """After warm-up: `constant`, or a decay over the job's budget (its merged tokens against
    its total, else max_steps or max_tokens): `cosine` to `min_lr_ratio` of the peak, or
    `wsd`, the peak until the last `decay_fraction` of the budget, then linearly down."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Where a decay ends, as a fraction of the peak rate."""
    decay_fraction: float = Field(0.2, gt=0.0, le=1.0)
    """The last fraction of the budget over which `wsd` decays."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Clip the gradient norm to this (0 disables)."""

    # --- Decoupled DiLoCo (the paper §3; README "How it fits together") ---
    h: Int = Field(24, ge=1, validation_alias="DDILOCO_H")
    """H: inner steps between two hand-overs of the same fragment."""
    num_fragments: Int = Field(4, ge=1, validation_alias="DDILOCO_P")
    """P: fragments the parameters are split into; one falls due every H/P steps."""
    adoption: Literal["overwrite", "rebase"] = "rebase"
    """What a learner does with a merged fragment that arrives. `overwrite` (the paper):
    theta_p <- Theta_p, dropping the steps it took on p since its last hand-over. `rebase`:
    theta_p <- Theta_p + (theta_p - theta_p at its last hand-over), keeping those steps (they
    go out with its next hand-over), so no step taken during the overlap tau is lost."""
    mix_alpha: float = Field(0.0, ge=0.0, lt=1.0)
    """alpha, with `overwrite` only (refused with `rebase`, which never mixes):
    theta <- alpha*theta_local + (1-alpha)*Theta on arrival (Streaming DiLoCo); 0 overwrites."""
    update_encoding: Literal["float32", "bfloat16", "int8", "int4"] = "bfloat16"
    """How deltas go up to the synchronizer (wire/encodings.py): float32, bfloat16, or
    blockwise absmax int8 / int4 codes with a float32 scale per `update_block` values (about
    1/2 and 1/4 of bfloat16's bytes). What rounding or quantization drops is carried into the
    fragment's next hand-over (the anchor moves by what was sent). The synchronizer must
    accept it (DDILOCO_UPDATE_ENCODINGS): the learner checks at join and stops if not."""
    update_block: Int = Field(128, ge=2, le=1 << 16, multiple_of=2)
    """Values per scale of the int8 / int4 encodings (even). 128: halving it buys a smaller
    quantization error for more bytes, doubling it the reverse, and error feedback sends
    what one hand-over drops with the next (bench/RESULTS.md, "Block size")."""
    upload_http2: bool = False
    """Send fragment uploads over HTTP/2 (h2c) to the main port instead of HTTP/1.1 to the
    upload port (`upload_url`). Control
    calls (long-poll heartbeats, downloads) always use HTTP/2. uvicorn's zttp advertises a fixed
    64 KiB receive window, which halves bulk upload throughput against HTTP/1.1 on the same
    server (bench/RESULTS.md, "TLS: upload throughput")."""
    upload_url: str = ""
    """Where fragment uploads go. "" (default): each shard's upload port, which it names at
    join (synchronizer/upload_port.py: HTTP/1.1 read straight into the update's buffer), on the host
    of its `sync_url`, falling back to `sync_url` for a while when that port cannot be
    reached; "off": always `sync_url`; else a comma-separated URL per shard, in shard order
    (a relay in front of the upload port, as `ddiloco local`'s network cuts use)."""

    # --- budget and runtime ---
    max_steps: Int = Field(0, ge=0)
    """Stop after this many inner steps (0: no step limit)."""
    max_seconds: float = Field(0.0, ge=0.0)
    """Stop after this many seconds of training (0: no time limit)."""
    max_tokens: Int = Field(0, ge=0)
    """Stop after this many tokens of inner steps (0: no token limit)."""
    device: str = "auto"
    """`auto` picks cuda when present (bf16 autocast), else cpu."""
    nproc_per_node: Int = Field(1, ge=1, le=256)
    """Ranks in this learner's data-parallel group, one per device: `ddiloco learner` starts
    them (under torchrun, the launcher's WORLD_SIZE is the group instead). To the
    synchronizer the group is one learner."""
    parallel: Literal["ddp", "fsdp2"] = "ddp"
    """How the ranks of a group train together: DDP (every rank holds the model) or FSDP2
    (`fully_shard`: parameters sharded over the ranks, for a model one device cannot hold)."""
    threads: Int = Field(1, ge=1)
    """torch intra-op threads on CPU."""
    slow_factor: float = Field(1.0, ge=1.0)
    """Chaos: each inner step takes this many times longer (a slower accelerator)."""
    poll_s: float = Field(0.5, gt=0.0, le=5.0)
    """Heartbeats are long polls: the synchronizer answers at once when a fragment merged
    or a round opened, else after this long (so also the longest heartbeat period)."""
    drain_s: float = Field(30.0, ge=0.0)
    """At the end of training, how long queued uploads may take to reach the synchronizer
    (it may be restarting) before the learner exits with them undelivered."""
    log_path: str | None = None
    """Append one JSON line per step and per fragment event here."""
    log_every: Int = Field(50, ge=0)
    """Print a step line every this many steps."""
    metrics_port: Int | None = Field(None, ge=1, le=65535)
    """Serve Prometheus metrics (learner/metrics.py, docs/operations.md "Metrics") on this
    port at /metrics; None: off. In a group only rank 0 serves. Pods: 9400, port name "metrics"."""
    metrics_host: str = "0.0.0.0"
    """Address the metrics port binds (`ddiloco local` binds 127.0.0.1)."""

    @field_validator("sync_url")
    @classmethod
    def _shard_urls(cls, value: str) -> str:
        urls = [u.strip() for u in value.split(",")]
        if not all(urls):
            raise ValueError(f"an empty URL in the list of synchronizer shards {value!r}")
        return ",".join(urls)

    @property
    def sync_urls(self) -> list[str]:
        """The synchronizer's shard URLs in shard order (one: an unsharded synchronizer)."""
        return [u.rstrip("/") for u in self.sync_url.split(",")]

    @model_validator(mode="after")
    def _consistent(self) -> LearnerConfig:
        if self.learner_index >= self.num_learners:
            raise ValueError(
                f"invalid learner config: learner_index={self.learner_index} must be below "
                f"num_learners={self.num_learners}"
            )
        if self.num_fragments > self.h:
            raise ValueError(
                f"invalid learner config: num_fragments={self.num_fragments} (P) must be at "
                f"most h={self.h} (H)"
            )
        upload_overrides(self.upload_url, len(self.sync_urls))  # one URL per shard, or none
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise ValueError(
                "invalid learner config: set both client_cert_file and client_key_file "
                "(DDILOCO_CLIENT_CERT_FILE, DDILOCO_CLIENT_KEY_FILE) or neither"
            )
        if self.mix_alpha and self.adoption != "overwrite":
            # `rebase` adds the global progress to the local copy and never mixes (diloco.py)
            raise ValueError(
                f"invalid learner config: mix_alpha={self.mix_alpha!r} needs "
                f"adoption='overwrite' (adoption={self.adoption!r} does not mix)"
            )
        return self

    def token_source(self) -> Tokens:
        """What the learner authenticates with: `token` when set, else `token_file` (re-read
        as it changes); with both, `token` until it is refused, then the file's (a promoted
        hot spare: the credential its assignment handed it, then the one the operator keeps
        in its file). ValueError when there is neither, or the file holds no token."""
        from ddiloco.wire.auth import GrantedTokens, StaticTokens, TokenFile

        if self.token and self.token_file:
            return GrantedTokens(self.token, self.token_file)
        if self.token:
            return StaticTokens(self.token)
        if self.token_file:
            return TokenFile(self.token_file)
        raise ValueError("no token: set DDILOCO_TOKEN or DDILOCO_TOKEN_FILE")

    def client_tls(self) -> ClientTLS:
        """The TLS files SyncClient uses for an https `sync_url`."""
        from ddiloco.wire.tls import ClientTLS

        return ClientTLS(self.ca_file, self.client_cert_file, self.client_key_file)

    @classmethod
    def env_names(cls) -> dict[str, str]:
        """Field name -> the `DDILOCO_*` variable `from_env` reads it from."""
        return {name: ENV_PREFIX + ENV_ALIASES.get(name, name).upper() for name in cls.model_fields}

    @classmethod
    def unread_env(cls, environ: Mapping[str, str]) -> list[str]:
        """`DDILOCO_*` names in `environ` that neither this class nor READ_ELSEWHERE reads."""
        known = set(cls.env_names().values()) | set(READ_ELSEWHERE)
        return sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, strict: bool = False, **overrides: Any
    ) -> LearnerConfig:
        """Fields from `DDILOCO_*` variables of `environ` (default os.environ; `DDILOCO_H`,
        `DDILOCO_P` for num_fragments, `DDILOCO_MODEL`...; see `env_names()`), then
        `overrides` (None values ignored). An empty variable counts as unset; a value that
        does not parse as its field raises ValueError naming the variable. `strict` also
        refuses, by name, any `DDILOCO_*` variable that nothing reads (a misspelt or retired
        knob)."""
        import os

        env = dict(os.environ if environ is None else environ)
        if strict and (unread := cls.unread_env(env)):
            raise ValueError(
                f"unknown learner environment variable(s) {', '.join(unread)}: the learner "
                f"reads {', '.join(sorted(cls.env_names().values()))} and "
                f"{', '.join(READ_ELSEWHERE)}"
            )
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            with _reading(env):
                return cls(**given)
        except ValidationError as e:
            raise ValueError(_explain(e, env, given, cls.env_names())) from None


def _explain(
    e: ValidationError, env: Mapping[str, str], given: Mapping[str, Any], names: dict[str, str]
) -> str:
    """One line per problem, naming the variable (or the flag's field) the bad value came from."""
    lines = []
    for err in e.errors():
        msg = str(err["msg"]).removeprefix("Value error, ")
        field = str(err["loc"][0]) if err["loc"] else ""
        field = next((f for f, var in names.items() if var.lower() == field.lower()), field)
        var = names.get(field, "")
        if field and field not in given and var in env:
            lines.append(f"{var}={env[var]!r}: {msg}")
        elif field:
            lines.append(f"invalid learner config: {field}={given.get(field)!r}: {msg}")
        else:
            lines.append(msg)
    return "; ".join(lines)
