"""Every `ddiloco` subcommand refuses a bad argument or input with one line and exit 2.

Each case runs the real CLI (`python -m ddiloco.cli.main ...`) as a subprocess and checks:
exit code 2, a stderr line `ddiloco <cmd>: error: ...` that names the problem, and no
"Traceback". Our own checks print that line alone; argparse's (an unknown flag, a bad choice)
print their usage lines above it, which is argparse's convention and is accepted here. Most
cases fail before torch is imported (a second or two each); the model checks import it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

# (subcommand and arguments, extra environment, a fragment the error line must contain)
CASES: list[tuple[list[str], dict[str, str], str]] = [
    # ddiloco local: the four of the issue, and more
    (["local", "--data", "/nonexistent.txt"], {}, "/nonexistent.txt"),
    (["local", "--learners", "0"], {}, "learners must be >= 1"),
    (["local", "--quorum", "9"], {}, "quorum must be in 1..learners"),
    (["local", "--model", "huge"], {}, "unknown model preset 'huge'"),
    (["local", "--model-entry", "nocolon"], {}, "module:function"),
    (["local", "--nproc-per-node", "0"], {}, "nproc_per_node"),
    (["local", "--learners", "two"], {}, "invalid int value"),
    (["local", "--chaos", "bogus"], {}, "invalid choice"),
    # ddiloco synchronizer
    (["synchronizer", "--quorum", "0"], {"DDILOCO_TOKEN": "t"}, "quorum"),
    (["synchronizer", "--port", "99999"], {"DDILOCO_TOKEN": "t"}, "port"),
    (["synchronizer", "--tls-cert", "/nonexistent.crt"], {"DDILOCO_TOKEN": "t"}, "TLS"),
    (["synchronizer", "--state-dir", "/proc/nope/state"], {"DDILOCO_TOKEN": "t"}, "/proc/nope"),
    (["synchronizer"], {"DDILOCO_TOKEN_FILE": "/nonexistent-token"}, "nonexistent-token"),
    (["synchronizer", "--merge", "max"], {"DDILOCO_TOKEN": "t"}, "invalid choice"),
    # ddiloco learner
    (["learner", "--learner-id", "bad/id"], {"DDILOCO_TOKEN": "t"}, "learner_id"),
    (["learner", "-H", "0"], {"DDILOCO_TOKEN": "t"}, "h=0"),
    (["learner", "--sync-url", "nothing"], {"DDILOCO_TOKEN": "t"}, "--sync-url"),
    (["learner", "--data", "/nonexistent.txt"], {"DDILOCO_TOKEN": "t"}, "/nonexistent.txt"),
    (["learner"], {}, "no token"),
    (["learner", "--token-file", "/nonexistent-token"], {}, "nonexistent-token"),
    # ddiloco operator (bad settings; no cluster needed to refuse them)
    (["operator"], {"DDILOCO_OPERATOR_RESYNC_SECONDS": "abc"}, "resync_seconds"),
    (["operator", "--bogus"], {}, "unrecognized arguments"),
    # ddiloco simulate
    (["simulate", "run", "--learners", "0"], {}, "learners must be > 0"),
    (["simulate", "plan", "--chips", "-5"], {}, "chips must be > 0"),
    (["simulate", "calibrate", "/nonexistent.json"], {}, "/nonexistent.json"),
    (["simulate", "nosuch"], {}, "invalid choice"),
    # ddiloco export
    (["export", "--state-dir", "/nonexistent", "--out", "/tmp/x"], {}, "does not exist"),
    # ddiloco status
    (["status"], {}, "give a synchronizer URL or --job"),
    (["status", "ftp://x"], {"DDILOCO_TOKEN": "t"}, "http:// or https://"),
    (["status", "http://127.0.0.1:1"], {}, "no token"),
    (["status", "http://127.0.0.1:1", "--token-file", "/nonexistent"], {}, "/nonexistent"),
    (["status", "http://127.0.0.1:1", "--interval", "0"], {"DDILOCO_TOKEN": "t"}, "--interval"),
    (["status", "--job", "j", "--kubeconfig", "/nonexistent"], {}, "kubeconfig"),
]


def _env(extra: dict[str, str], tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_")}
    env.update({"PYTHONUNBUFFERED": "1", "HOME": str(tmp)}, **extra)
    return env


@pytest.mark.parametrize(
    ("argv", "extra", "needle"), CASES, ids=[" ".join(c[0]) + repr(sorted(c[1])) for c in CASES]
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], extra: dict[str, str], needle: str, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-P", "-m", "ddiloco.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,  # a run that started anyway would write here, not in the repo
        env=_env(extra, tmp_path),
    )
    took = time.monotonic() - t0
    prefix = f"ddiloco {argv[0]}: error: "
    errors = [line for line in done.stderr.splitlines() if line.startswith(prefix)]
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(errors) == 1, done.stderr
    assert needle in errors[0], errors[0]
    ours = not any(line.startswith("usage:") for line in done.stderr.splitlines())
    if ours:  # our own refusals: that line and nothing else on stderr
        assert done.stderr.strip().splitlines() == errors, done.stderr
    print(f"{' '.join(argv)}: {took:.2f}s")
