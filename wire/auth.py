"""Bearer tokens and who they speak for: the job key, and credentials derived from it.

    tokens = TokenFile("/var/run/ddiloco/token")   # a mounted Secret
    tokens.accepted()      # synchronizer: every non-empty line is a valid job key
    tokens.current()       # a client: the first non-empty line is the one it sends
    learner_token(key, "a-0")                      # "learner:a-0:<mac>": a-0's credential
    authenticate("Bearer learner:a-0:...", tokens) # -> Principal("learner", "a-0") or None

Who speaks for whom. The job key (DDILOCO_TOKEN, the operator's `<job>-token` Secret) is the
root credential: the synchronizer, the operator and an administrator's `ddiloco status` hold
it, and it speaks for any learner (whoever holds it can mint any learner's credential). A
learner slot holds only its own credential, `learner:<id>:<mac>`, the HMAC-SHA256 of its id
under the key, so it can speak only for `<id>`: a join, heartbeat or update for another id is
refused (403). A hot spare holds `spare:<pod>:<mac>`, which reads only its own assignment;
the assignment hands it its slot's learner credential. An evaluator (`ddiloco evaluate`) holds
`evaluator:<name>:<mac>`: it reads the status, the model and the global fragments and posts
evaluations of them, and nothing else (no join, heartbeat, init or update). The check needs no state beyond the
key (nothing a restart could erase): the synchronizer recomputes the MAC for the id the token
names, for every key line it accepts, in constant time.

A rotation writes the new token as the first line and keeps the old one below it ("new\\nold")
until every learner has picked the new one up, then drops the old line. Kubernetes updates a
mounted Secret by swapping a symlink, so the file is `stat`ed (following links) on every check
and re-read when its identity, size or mtime changed, or when the last read is older than
`max_age_s` (a rewrite within one mtime tick). No torch here (the operator image imports it).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

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


Kind = Literal["job", "learner", "spare", "evaluator"]
Derived = Literal["learner", "spare", "evaluator"]
"""The kinds of credential derived from the job key."""
_DERIVED: Final = re.compile(
    r"^(learner|spare|evaluator):([A-Za-z0-9._-]{1,253}):([A-Za-z0-9_-]{43})$"
)


@dataclass(frozen=True)
class Principal:
    """Who a request's credential speaks for: the job key (`job`), one learner slot
    (`learner`, `name` = its learner id), one hot spare pod (`spare`, `name` = the pod) or
    one evaluator (`evaluator`, `name` = its name)."""

    kind: Kind
    name: str = ""

    def speaks_for(self, learner_id: str) -> bool:
        """May this credential join, heartbeat and update as `learner_id`?"""
        return self.kind == "job" or (self.kind == "learner" and self.name == learner_id)

    def trains(self) -> bool:
        """May this credential change the model (init, updates)? The job key and learner
        slots may; a spare (no slot yet) and an evaluator (a reader) may not."""
        return self.kind in ("job", "learner")

    def evaluates(self) -> bool:
        """May this credential post evaluations of the global model? The job key and an
        evaluator may; a learner or spare may not."""
        return self.kind in ("job", "evaluator")

    def __str__(self) -> str:
        return "the job key" if self.kind == "job" else f"{self.kind} {self.name}"


JOB: Final = Principal("job")


def _mac(key: str, kind: str, name: str) -> str:
    digest = hmac.new(key.encode(), f"ddiloco/{kind}/{name}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def derive_token(key: str, kind: Derived, name: str) -> str:
    """The credential of learner `name` (or spare pod, or evaluator `name`) under the job
    key `key`."""
    if not _DERIVED.match(f"{kind}:{name}:{'A' * 43}"):
        raise ValueError(f"not a {kind} name a credential can carry: {name!r}")
    return f"{kind}:{name}:{_mac(key, kind, name)}"


def learner_token(key: str, learner_id: str) -> str:
    """Learner `learner_id`'s credential: it speaks for that id alone."""
    return derive_token(key, "learner", learner_id)


def spare_token(key: str, pod: str) -> str:
    """Hot spare pod `pod`'s credential: it reads that pod's assignment alone."""
    return derive_token(key, "spare", pod)


def evaluator_token(key: str, name: str) -> str:
    """Evaluator `name`'s credential: it reads the global model and posts evaluations."""
    return derive_token(key, "evaluator", name)


def derived_lines(keys: Sequence[str], kind: Derived, name: str) -> str:
    """A credential file's content for `name`: one line per job key, in the keys' order, so a
    key rotation ("new\nold") rotates every derived credential the same way."""
    return "\n".join(derive_token(k, kind, name) for k in keys)


def identify(given: str, keys: Sequence[str]) -> Principal | None:
    """The principal a bearer token speaks for under the accepted job keys, or None. Every
    candidate is compared in constant time, and all are compared."""
    if not given:
        return None
    match = _DERIVED.match(given)
    if match is None:
        return JOB if token_matches(given, keys) else None
    kind, name, mac = match.groups()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(mac.encode(), _mac(key, kind, name).encode())
    return Principal(kind, name) if ok else None  # type: ignore[arg-type]


def authenticate(authorization: str, tokens: Tokens) -> Principal | None:
    """The principal of an Authorization header value `Bearer <token>` (the main port's
    routes and the upload port check it alike), or None when it is missing or wrong."""
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return identify(given.strip(), tokens.accepted())


def bearer_matches(authorization: str, tokens: Tokens) -> bool:
    """True when an Authorization header value carries any valid credential of the job."""
    return authenticate(authorization, tokens) is not None


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


class GrantedTokens:
    """A credential handed over at run time (`token`), then the file's once it is refused.

    A promoted hot spare speaks with the slot's credential its assignment handed it; the
    operator rewrites the spare's own credential file to the slot's credential (one line per
    key). Should a key rotation end after the grant, the grant is refused (401): from then on
    the file's first line is sent, re-read as it changes."""

    def __init__(self, token: str, path: str | os.PathLike[str]) -> None:
        self._granted = StaticTokens(token)
        self._file = TokenFile(path)
        self._switched = False

    def accepted(self) -> list[str]:
        return [self.current()]

    def current(self) -> str:
        return self._file.current() if self._switched else self._granted.current()

    def refresh(self) -> bool:
        """Called on a 401: move to the file (re-read now). True when the token changed."""
        if not self._switched:
            self._switched = True
            return self._file.refresh() or self._file.current() != self._granted.current()
        return self._file.refresh()


Tokens = StaticTokens | TokenFile | GrantedTokens
