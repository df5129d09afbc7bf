"""Bearer tokens: a fixed one, or a file re-read when it changes (rotation without restarts).

    tokens = TokenFile("/var/run/ddiloco/token")   # a mounted Secret
    tokens.accepted()      # synchronizer: every non-empty line is a valid token
    tokens.current()       # learner: the first non-empty line is the one it sends
    token_matches(given, tokens.accepted())        # constant-time comparison

A rotation writes the new token as the first line and keeps the old one below it ("new\\nold")
until every learner has picked the new one up, then drops the old line. Kubernetes updates a
mounted Secret by swapping a symlink, so the file is `stat`ed (following links) on every check
and re-read when its identity, size or mtime changed, or when the last read is older than
`max_age_s` (a rewrite within one mtime tick). No torch here (the operator image imports it).
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)


def parse_tokens(text: str) -> list[str]:
    """The non-empty lines of a token file, stripped, in order."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def token_matches(given: str, accepted: Sequence[str]) -> bool:
    """True when `given` equals one of `accepted`. Each candidate is compared in constant time
    and all are compared, so the answer's timing says neither which one matched nor where a
    wrong one differs."""
    g = given.encode()
    ok = False
    for token in accepted:
        ok |= hmac.compare_digest(g, token.encode())
    return ok and bool(given)


def bearer_matches(authorization: str, tokens: Tokens) -> bool:
    """True when an Authorization header value is `Bearer <one of the accepted tokens>`
    (the main port's routes and the upload port check it alike)."""
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and token_matches(given.strip(), tokens.accepted())


class StaticTokens:
    """A token fixed for the life of the process (DDILOCO_TOKEN)."""

    def __init__(self, token: str) -> None:
        if not token.strip():
            raise ValueError("the token is empty")
        self._token = token.strip()

    def accepted(self) -> list[str]:
        return [self._token]

    def current(self) -> str:
        return self._token

    def refresh(self) -> bool:
        """Nothing to re-read; never changes."""
        return False


class TokenFile:
    """Tokens read from `path`, one per non-empty line, re-read when the file changes.

    If a re-read finds the file missing, unreadable or empty, the last good tokens stay in
    force (logged once per change): a half-finished Secret update must not lock every learner
    out. The first read must succeed (ValueError otherwise). Thread-safe."""

    def __init__(self, path: str | os.PathLike[str], max_age_s: float = 1.0) -> None:
        self.path = Path(path)
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._sig: tuple[int, int, int, int] | None = None
        self._read_at = 0.0
        self._tokens: list[str] = []
        self._warned = False
        if not self._reload(force=True):
            raise ValueError(f"token file {self.path} holds no token (or cannot be read)")

    def _signature(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows the symlink a mounted Secret is swapped through
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def _reload(self, force: bool = False) -> bool:
        """Re-read if the file changed (or `force`, or the last read is stale). True when the
        tokens in force changed."""
        sig = self._signature()
        now = time.monotonic()
        if not force and sig == self._sig and now - self._read_at < self.max_age_s:
            return False
        try:
            tokens = parse_tokens(self.path.read_text())
        except (OSError, UnicodeDecodeError) as e:
            tokens, why = [], f"{type(e).__name__}"
        else:
            why = "no non-empty line"
        self._read_at = now
        if not tokens:
            if not self._warned and self._tokens:
                log.warning("Token file %s unusable (%s); keeping the last tokens", self.path, why)
            self._warned = True
            return False
        self._warned = False
        self._sig = sig
        if tokens == self._tokens:
            return False
        first_load = not self._tokens
        self._tokens = tokens
        if not first_load:
            log.info("Token file %s changed: %d token(s) now accepted", self.path, len(tokens))
        return True

    def accepted(self) -> list[str]:
        """Every token in the file (the synchronizer accepts any of them)."""
        with self._lock:
            self._reload()
            return list(self._tokens)

    def current(self) -> str:
        """The first token (the one a learner sends)."""
        with self._lock:
            self._reload()
            return self._tokens[0]

    def refresh(self) -> bool:
        """Re-read now (a learner does this on a 401). True when the tokens changed."""
        with self._lock:
            return self._reload(force=True)


Tokens = StaticTokens | TokenFile
