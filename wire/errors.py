"""Why the synchronizer refuses a request: one closed set of reasons, each with its HTTP status.

    raise SyncError(Refusal.STALE, "update of fragment 2 is based on version 3, ...")

Every refusal is a 4xx whose JSON body is `{"error": <reason>, "detail": <why>}`; a learner's
client turns it into `SyncRefused(status, kind, detail)`. Nothing refused changes any state.
"""

from __future__ import annotations

from enum import StrEnum


class Refusal(StrEnum):
    UNAUTHORIZED = "unauthorized"
    """No bearer token, or the wrong one (401)."""
    FORBIDDEN = "forbidden"
    """A valid credential that does not speak for what the request claims: another learner's
    id, or a route that is not its holder's (403)."""
    UNKNOWN_LEARNER = "unknown_learner"
    """The learner id never joined (404): POST /v1/join first."""
    NOT_INITIALIZED = "not_initialized"
    """No global model yet (409): the first learner uploads it."""
    STALE = "stale"
    """The update's base version is unknown or more than max_staleness merges old (409)."""
    CONFLICT = "conflict"
    """A different layout than the job's (409)."""
    TOO_LARGE = "too_large"
    """The body is larger than the route can ever need (413), refused before it is read."""
    TIMEOUT = "timeout"
    """The body stopped arriving (408)."""
    INVALID = "invalid"
    """Malformed, non-finite, wrong shape, implausible norm, or failed validation (422)."""
    ENCODING = "unsupported_encoding"
    """An update in an encoding this synchronizer was not configured for (415:
    `DDILOCO_UPDATE_ENCODINGS`); the detail names both."""
    WRONG_SHARD = "wrong_shard"
    """The fragment is owned by another synchronizer shard (421 Misdirected Request); the
    detail names the owner."""


HTTP_STATUS: dict[Refusal, int] = {
    Refusal.UNAUTHORIZED: 401,
    Refusal.FORBIDDEN: 403,
    Refusal.UNKNOWN_LEARNER: 404,
    Refusal.NOT_INITIALIZED: 409,
    Refusal.STALE: 409,
    Refusal.CONFLICT: 409,
    Refusal.TOO_LARGE: 413,
    Refusal.TIMEOUT: 408,
    Refusal.INVALID: 422,
    Refusal.ENCODING: 415,
    Refusal.WRONG_SHARD: 421,
}


class SyncError(Exception):
    """A refused request; `kind` says why, the message says how to fix it."""

    def __init__(self, kind: Refusal, message: str) -> None:
        super().__init__(message)
        self.kind = Refusal(kind)

    @property
    def status(self) -> int:
        return HTTP_STATUS[self.kind]


class PayloadError(SyncError):
    """A payload that cannot be accepted (malformed, wrong shape or dtype, non-finite)."""

    def __init__(self, message: str) -> None:
        super().__init__(Refusal.INVALID, message)
