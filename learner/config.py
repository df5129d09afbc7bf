"""Learner knobs, in torchtitan's style: keyword-only fields, a docstring under each.

Every field can come from the environment (`DDILOCO_<FIELD>` upper-cased, as the operator
sets them in learner pods; `LearnerConfig.env_names()` lists them) and be overridden by
`ddiloco learner` flags. No torch here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import cache
from types import MappingProxyType, NoneType, UnionType
from typing import (
    TYPE_CHECKING,
    Any,
    Final,
    Literal,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

if TYPE_CHECKING:
    from ddiloco.synchronizer.auth import Tokens
    from ddiloco.synchronizer.tls import ClientTLS

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

_TRUE: Final = ("1", "true", "yes", "on")
_FALSE: Final = ("0", "false", "no", "off")


@dataclass(kw_only=True)
class LearnerConfig:
    # --- identity and synchronizer ---
    sync_url: str = "http://127.0.0.1:8470"
    """Base URL of the synchronizer: http:// (h2c) or https:// (TLS, HTTP/2 by ALPN)."""
    token: str = field(default="", repr=False)
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

    # --- Decoupled DiLoCo (the paper §3; README "How it fits together") ---
    h: int = 24
    """H: inner steps between two hand-overs of the same fragment."""
    num_fragments: int = 4
    """P: fragments the parameters are split into; one falls due every H/P steps."""
    adoption: Literal["overwrite", "rebase"] = "rebase"
    """What a learner does with a merged fragment that arrives. `overwrite` (the paper):
    theta_p <- Theta_p, dropping the steps it took on p since its last hand-over. `rebase`:
    theta_p <- Theta_p + (theta_p - theta_p at its last hand-over), keeping those steps (they
    go out with its next hand-over), so no step taken during the overlap tau is lost."""
    mix_alpha: float = 0.0
    """alpha, with `overwrite` only (refused with `rebase`, which never mixes):
    theta <- alpha*theta_local + (1-alpha)*Theta on arrival (Streaming DiLoCo); 0 overwrites."""
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
    drain_s: float = 30.0
    """At the end of training, how long queued uploads may take to reach the synchronizer
    (it may be restarting) before the learner exits with them undelivered."""
    log_path: str | None = None
    """Append one JSON line per step and per fragment event here."""
    log_every: int = 50
    """Print a step line every this many steps."""

    def __post_init__(self) -> None:
        for name, allowed in _choices().items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"invalid learner config: {name}={getattr(self, name)!r} "
                    f"(one of {', '.join(allowed)})"
                )
        checks = {
            "num_learners": self.num_learners >= 1,
            "learner_index": 0 <= self.learner_index < self.num_learners,
            "batch_size": self.batch_size >= 1,
            "h": self.h >= 1,
            "num_fragments": 1 <= self.num_fragments <= self.h,
            "mix_alpha": 0.0 <= self.mix_alpha < 1.0,
            "inner_lr": self.inner_lr > 0,
            "slow_factor": self.slow_factor >= 1.0,
            "max_steps": self.max_steps >= 0,
            "max_seconds": self.max_seconds >= 0,
            "drain_s": self.drain_s >= 0,
            "max_tokens": self.max_tokens >= 0,
        }
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise ValueError(
                "invalid learner config: set both client_cert_file and client_key_file "
                "(DDILOCO_CLIENT_CERT_FILE, DDILOCO_CLIENT_KEY_FILE) or neither"
            )
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            k = bad[0]
            raise ValueError(f"invalid learner config: {k}={getattr(self, k)!r}")
        if self.mix_alpha and self.adoption != "overwrite":
            # `rebase` adds the global progress to the local copy and never mixes (diloco.py)
            raise ValueError(
                f"invalid learner config: mix_alpha={self.mix_alpha!r} needs "
                f"adoption='overwrite' (adoption={self.adoption!r} does not mix)"
            )

    def token_source(self) -> Tokens:
        """What the learner authenticates with: `token` when set, else `token_file` (re-read
        as it changes). ValueError when there is neither, or the file holds no token."""
        from ddiloco.synchronizer.auth import StaticTokens, TokenFile

        if self.token:
            return StaticTokens(self.token)
        if self.token_file:
            return TokenFile(self.token_file)
        raise ValueError("no token: set DDILOCO_TOKEN or DDILOCO_TOKEN_FILE")

    def client_tls(self) -> ClientTLS:
        """The TLS files SyncClient uses for an https `sync_url`."""
        from ddiloco.synchronizer.tls import ClientTLS

        return ClientTLS(self.ca_file, self.client_cert_file, self.client_key_file)

    @classmethod
    def env_names(cls) -> dict[str, str]:
        """Field name -> the `DDILOCO_*` variable `from_env` reads it from."""
        return {f.name: ENV_PREFIX + ENV_ALIASES.get(f.name, f.name).upper() for f in fields(cls)}

    @classmethod
    def unread_env(cls, environ: Mapping[str, str]) -> list[str]:
        """`DDILOCO_*` names in `environ` that neither this class nor READ_ELSEWHERE reads."""
        known = set(cls.env_names().values()) | set(READ_ELSEWHERE)
        return sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, strict: bool = False, **overrides: Any
    ) -> LearnerConfig:
        """Fields from `DDILOCO_*` variables (`DDILOCO_H`, `DDILOCO_P` for num_fragments,
        `DDILOCO_MODEL`...; see `env_names()`), then `overrides` (None values ignored). An
        empty variable counts as unset; a value that does not parse as its field's type
        raises ValueError naming the variable. `strict` also refuses, by name, any
        `DDILOCO_*` variable that nothing reads (a misspelt or retired knob)."""
        env = os.environ if environ is None else environ
        if strict and (unread := cls.unread_env(env)):
            raise ValueError(
                f"unknown learner environment variable(s) {', '.join(unread)}: the learner "
                f"reads {', '.join(sorted(cls.env_names().values()))} and "
                f"{', '.join(READ_ELSEWHERE)}"
            )
        hints = _hints()
        values: dict[str, Any] = {}
        for name, var in cls.env_names().items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            values[name] = _parse(var, raw, hints[name])
        values |= {k: v for k, v in overrides.items() if v is not None}
        return cls(**values)


@cache
def _hints() -> dict[str, Any]:
    return get_type_hints(LearnerConfig)


@cache
def _choices() -> dict[str, tuple[str, ...]]:
    """The fields typed as a Literal, with the values they allow."""
    return {k: get_args(t) for k, t in _hints().items() if get_origin(t) is Literal}


def _parse(var: str, raw: str, hint: Any) -> Any:
    """`raw` as a value of type `hint` (int, float, bool, str, a Literal, or one of them | None)."""
    if get_origin(hint) in (Union, UnionType):
        (hint,) = (a for a in get_args(hint) if a is not NoneType)
    if get_origin(hint) is Literal:
        if raw not in get_args(hint):
            raise ValueError(f"{var}={raw!r}: one of {', '.join(get_args(hint))}")
        return raw
    if hint is bool:
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"{var}={raw!r}: not a boolean ({'/'.join(_TRUE + _FALSE)})")
        return word in _TRUE
    if hint in (int, float):
        try:
            value = hint(raw)
        except ValueError:
            raise ValueError(
                f"{var}={raw!r}: not {'an int' if hint is int else 'a number'}"
            ) from None
        if not math.isfinite(value):
            raise ValueError(f"{var}={raw!r}: not a finite number")
        return value
    if hint is str:
        return raw
    raise TypeError(f"{var}: no parser for fields of type {hint!r}")
