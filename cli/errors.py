"""One-line errors at the CLI boundary: `ddiloco <cmd>: error: ...` and an exit code, no traceback.

    from ddiloco.cli.errors import usage_errors, fail

    with usage_errors("ddiloco local"):          # ValueError, pydantic's ValidationError,
        cfg = LocalConfig(learners=args.learners)  # a missing file: one line, exit 2
    fail("ddiloco status", "job default/x not found")          # exit 2 (UsageError)
    fail("ddiloco status", "cannot reach https://x", code=1)   # exit 1 (a runtime failure)

Exit codes, the same for every subcommand (README, "The CLI"):

* 0: done.
* 1: the command was well formed but failed while it ran (a synchronizer that cannot be
  reached, a run whose learners never started, an apiserver that is down). Run it again later.
* 2: the command was given something wrong (an unknown flag, a bad value, a file that does not
  exist, a token the synchronizer refuses, a job that does not exist). Change the command.
  argparse's own errors are exit 2 too, with its usage line above the `error:` line.

`usage_errors` wraps only the part of a command that reads its arguments and inputs: an error
raised later, mid-run, is a bug or a runtime failure and must not be mistaken for bad input.
This module imports nothing heavy (no torch, no pydantic unless it is already loaded).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

USAGE: int = 2
"""Exit code for a bad argument or input."""
RUNTIME: int = 1
"""Exit code for a well-formed command that failed while it ran."""
_MAX_LINE = 500


class UsageError(Exception):
    """Raised by a command for input it refuses; `usage_errors` prints it as the error line."""


class RuntimeFailure(Exception):
    """A well-formed command that failed while running; printed as one line, exit 1."""


def _clip(text: str) -> str:
    line = " ".join(text.split())  # one line, whatever the message held
    return line if len(line) <= _MAX_LINE else line[: _MAX_LINE - 3] + "..."


def _validation_line(exc: Any) -> str:
    """pydantic's ValidationError as `field: message (got value); ...`."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(x) for x in err.get("loc") or ())
        msg = str(err.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        given = err.get("input")
        shown = ""
        secret = any(w in loc.lower() for w in ("token", "secret", "key", "password"))
        if secret:  # a credential is never echoed, even a malformed one
            shown = " (value not shown)"
        elif loc and isinstance(given, (str, int, float, bool)) and len(repr(given)) <= 80:
            shown = f" (got {given!r})"
        parts.append(f"{loc}: {msg}{shown}" if loc else msg)
    return "; ".join(parts) or str(exc)


def one_line(exc: BaseException) -> str:
    """The error as one line: pydantic's field errors joined, else the exception's message
    (its type's name when it has none), an OSError's file name included."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(exc, pydantic.ValidationError):
        return _clip(_validation_line(exc))
    if isinstance(exc, OSError) and exc.strerror:  # "[Errno 2] ...: 'x'" reads as a log line
        where = f": {exc.filename}" if exc.filename else ""
        return _clip(f"{exc.strerror}{where}")
    text = str(exc)
    if isinstance(exc, KeyError) and exc.args:  # str(KeyError) is the key's repr alone
        text = f"missing {exc.args[0]!r}"
    return _clip(text or type(exc).__name__)


def fail(prog: str, message: str | BaseException, code: int = USAGE) -> NoReturn:
    """Print `<prog>: error: <message>` on stderr and exit with `code`."""
    text = one_line(message) if isinstance(message, BaseException) else _clip(message)
    sys.stderr.write(f"{prog}: error: {text}\n")
    sys.stderr.flush()
    raise SystemExit(code)


@contextmanager
def usage_errors(prog: str, *extra: type[BaseException]) -> Iterator[None]:
    """Inside: a ValueError (pydantic's ValidationError is one), an OSError (a missing or
    unreadable file), a `UsageError` or one of `extra` exits 2 with one line; a
    `RuntimeFailure` exits 1."""
    try:
        yield
    except RuntimeFailure as e:
        fail(prog, e, RUNTIME)
    except (UsageError, ValueError, OSError) as e:
        fail(prog, e, USAGE)
    except extra as e:
        fail(prog, e, USAGE)
