"""Keep credentials out of the operator's log, whatever prints them.

    redact.install()                 # once at startup (cli.py, Runtime): every log record is scrubbed
    redact.register(token)           # a value that must never be printed
    redact.scrub("Bearer abc ...")   # -> "Bearer <redacted> ..."

Exceptions quote what they were given: http.client refuses a header with a newline as
`Invalid header value b'Bearer <token>\\n'`, and kopf logs a handler's exception with its
message on every retry. Catching each such path is not enough on its own, so a log record
factory scrubs every record where it is made, its message and its formatted traceback, before
any handler (stderr, kopf's event poster) sees it: the values registered here (the operator's
own token, each kubeconfig Secret's token and key, each job's bearer token) and anything after
`Bearer `/`Basic ` become `<redacted>`.
"""

from __future__ import annotations

import logging
import re
import threading
import traceback
from typing import Any, Final

REDACTED: Final = "<redacted>"
MIN_LEN: Final = 6  # shorter values would blank ordinary words; no credential is that short
_AUTH = re.compile(r"(?i)\b(bearer|basic)(\s+|%20)[^\s'\",;}\]]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")

_lock = threading.Lock()
_values: set[str] = set()
_ordered: list[str] = []  # longest first, so a value containing another goes whole
_installed = False


def register(value: object) -> None:
    """Never print `value`: nor the form repr() gives it, nor its pieces between control
    characters (a token with a stray newline is quoted as `...\\n` or cut there)."""
    if not isinstance(value, str | bytes):
        return
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    forms = {text, text.strip(), repr(text)[1:-1], *_CONTROL.split(text)}
    new = {f for f in forms if len(f) >= MIN_LEN} - _values
    if not new:
        return
    with _lock:
        _values.update(new)
        _ordered[:] = sorted(_values, key=len, reverse=True)


def scrub(text: str) -> str:
    for value in _ordered:
        if value in text:
            text = text.replace(value, REDACTED)
    return _AUTH.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)


def _scrub_record(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # a broken format string: let logging report it as it would
        return
    clean = scrub(message)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[0] is not None:
        text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        record.exc_text = scrub(text)  # Formatter.format uses exc_text when it is set
    if record.stack_info:
        record.stack_info = scrub(record.stack_info)


def install() -> None:
    """Scrub every log record of the process from now on (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        _scrub_record(record)
        return record

    logging.setLogRecordFactory(factory)


def register_client(configuration: Any) -> None:
    """Register the credentials of a kubernetes client Configuration, and those it will
    refresh to (in-cluster tokens are re-read from their file every minute)."""
    for value in (configuration.api_key or {}).values():
        register(value)
        register(str(value).removeprefix("Bearer ").strip())
    if getattr(configuration, "password", None):
        register(configuration.password)
    hook = getattr(configuration, "refresh_api_key_hook", None)
    if hook is not None and not getattr(hook, "_ddiloco_registers", False):

        def refresh(cfg: Any) -> None:
            hook(cfg)
            for value in (cfg.api_key or {}).values():
                register(str(value).removeprefix("Bearer ").strip())

        refresh._ddiloco_registers = True  # type: ignore[attr-defined]
        configuration.refresh_api_key_hook = refresh
