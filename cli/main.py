"""The `ddiloco` command: one entry point, one subcommand per component.

    ddiloco local --learners 3 --max-seconds 60     # the whole system on this machine
    ddiloco synchronizer --state-dir /tmp/s          # the merge service (HTTP/2)
    ddiloco learner --sync-url http://127.0.0.1:8470 --learner-id l0
    ddiloco operator                                 # the Kubernetes operator (kopf)
    ddiloco simulate paper-table                     # the discrete-event simulator
    ddiloco export --state-dir /tmp/s --out model/   # the trained model, as safetensors
    ddiloco status http://127.0.0.1:8470             # a live view of a running job
    ddiloco credential l0                            # learner l0's credential (from the key)
    ddiloco evaluate --sync-url URL --every-seconds 300   # the global model's eval loss

Each subcommand lives with its component and is imported only when it runs, so
`ddiloco operator` never pays for torch and `ddiloco learner` never imports kopf.
"""

from __future__ import annotations

import importlib
import sys
from typing import Final

# subcommand -> (module, one-line help). The module exposes `main(argv) -> int`.
SUBCOMMANDS: Final[dict[str, tuple[str, str]]] = {
    "local": ("ddiloco.local.cli", "run a synchronizer and M learners on this machine"),
    "synchronizer": ("ddiloco.synchronizer.server", "serve the synchronizer over HTTP/2"),
    "learner": ("ddiloco.learner.cli", "run one learner against a synchronizer"),
    "prepare": ("ddiloco.cli.prepare", "tokenize a corpus once into chunks learners read lazily"),
    "operator": ("ddiloco.operator.cli", "run the Kubernetes operator"),
    "simulate": ("ddiloco.simulator.cli", "simulate the method at fleet scale"),
    "export": ("ddiloco.cli.export", "write a job's global model out as safetensors"),
    "status": ("ddiloco.cli.status", "show a running job: fragments, learners, goodput"),
    "credential": ("ddiloco.cli.credential", "print a learner's own credential from the job key"),
    "evaluate": ("ddiloco.learner.evaluate", "measure the global model's held-out loss as it runs"),
}


def usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = ["usage: ddiloco <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`ddiloco <command> --help` lists a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(usage() + "\n")
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        sys.stderr.write(f"ddiloco: unknown command {name!r}\n\n{usage()}\n")
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
