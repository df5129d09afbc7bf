"""`ddiloco credential`: a learner's (or a hot spare's, or an evaluator's) own credential,
minted from the job key.

    export DDILOCO_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe())')  # the key
    DDILOCO_TOKEN=$(ddiloco credential l0) ddiloco learner --learner-id l0 ...
    ddiloco credential --token-file key --spare job-a-spare-0 > spare-token   # a spare's
    ddiloco credential --evaluator eval > eval-token   # `ddiloco evaluate`'s: reads, evaluates

The job key (DDILOCO_TOKEN, or every line of `--token-file` / DDILOCO_TOKEN_FILE, newest
first) stays with the synchronizer, the operator and whoever administers the job; a learner
is given only what this prints, which speaks for its own learner id and nothing else
(wire/auth.py). With a key file of several lines (a rotation) it prints one line per
key, in the same order: the learner's credential file for the rotation. The operator and
`ddiloco local` mint the same credentials themselves; this is for running the parts by hand.
Errors are one line, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from ddiloco.cli.errors import usage_errors
from ddiloco.wire.auth import TokenFile, derived_lines

PROG = "ddiloco credential"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "name", help="the learner id (with --spare the spare pod's name, --evaluator any name)"
    )
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--spare", action="store_true", help="a hot spare pod's credential")
    kind.add_argument(
        "--evaluator", action="store_true", help="an evaluator's credential (ddiloco evaluate)"
    )
    ap.add_argument(
        "--token-file", help="the job key's file (else DDILOCO_TOKEN_FILE, else DDILOCO_TOKEN)"
    )
    args = ap.parse_args(argv)
    with usage_errors(PROG):
        path = args.token_file or os.environ.get("DDILOCO_TOKEN_FILE")
        if path:
            keys = TokenFile(path).accepted()
        elif os.environ.get("DDILOCO_TOKEN", "").strip():
            keys = [os.environ["DDILOCO_TOKEN"].strip()]
        else:
            raise ValueError("no job key: set DDILOCO_TOKEN or DDILOCO_TOKEN_FILE (--token-file)")
        kind = "spare" if args.spare else "evaluator" if args.evaluator else "learner"
        text = derived_lines(keys, kind, args.name)
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
