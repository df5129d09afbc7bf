"""`ddiloco learner --nproc-per-node N`: start the N ranks of one learner and supervise them.

    DDILOCO_TOKEN=t ddiloco learner --nproc-per-node 2 --sync-url http://127.0.0.1:8470 ...
    torchrun --nproc-per-node 2 -m ddiloco.cli.main learner --sync-url ...   # the same, by torchrun

The launcher imports no torch. It starts `ddiloco learner` with the same arguments N times,
each with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), which make it a rank of the group (learner/group.py) instead of a launcher: a
WORLD_SIZE in the environment always wins, so under torchrun nothing is spawned twice.

One learner, one fate. The ranks die with the launcher (PR_SET_PDEATHSIG), and when any rank
exits with an error or a signal the launcher sends SIGTERM to the others, SIGKILLs what is
left after `FAIL_GRACE_S`, and exits non-zero (the rank's code, 128 + the signal for a killed
one); the pod restarts or is replaced. Nothing half-merged can reach the synchronizer: only
rank 0 uploads, each update one HTTP body cut from a completed step, and a peer's death fails
the next collective of every inner step (the all-reduce, rank 0's plan broadcast) before
rank 0 can cut another.

SIGTERM (kubelet sends it to PID 1 only, the launcher) and SIGINT are forwarded to every rank
as SIGTERM; rank 0 then finishes its step, hands everything over, waits up to drain_s for the
uploads and all ranks exit 0 after the same step (diloco.py); the launcher waits for them as
long as they take (the pod's grace period bounds it) and exits 0. A second signal SIGKILLs the
ranks. The ranks run in their own session, so a terminal's Ctrl-C reaches only the launcher.
torchrun's agent also forwards SIGTERM to its workers, but SIGKILLs them after
TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by default: set it above drain_s plus one inner step) and
then exits non-zero itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Final

log = logging.getLogger(__name__)

FAIL_GRACE_S: Final = 10.0
"""After a rank failed: how long the others get to exit on SIGTERM before SIGKILL."""
_PR_SET_PDEATHSIG: Final = 1


def under_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True when the environment already places this process in a group (WORLD_SIZE set)."""
    env = os.environ if environ is None else environ
    return bool(env.get("WORLD_SIZE"))


def in_group(environ: Mapping[str, str] | None = None) -> bool:
    """True in a rank of a group of more than one (WORLD_SIZE > 1)."""
    env = os.environ if environ is None else environ
    return int(env.get("WORLD_SIZE") or 1) > 1


def init_logging(level: str = "INFO", learner_id: str = "") -> None:
    tag = f"learner {learner_id}"
    if in_group():
        tag += f" rank {os.environ.get('RANK', '?')}"
    logging.basicConfig(
        level=level, stream=sys.stderr, format=f"%(asctime)s {tag} %(levelname)s: %(message)s"
    )


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):  # not Linux: a killed launcher leaves its ranks be
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exit_code(returncode: int) -> int:
    """A shell's code for a child's Popen returncode (negative: killed by that signal)."""
    return 128 - returncode if returncode < 0 else returncode


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def launch(argv: Sequence[str], nproc: int, *, fail_grace_s: float = FAIL_GRACE_S) -> int:
    """Run `ddiloco learner argv` as `nproc` ranks until they all exit; the exit code."""
    if nproc < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc}")
    port = _free_port()
    command = [sys.executable, "-P", "-m", "ddiloco.cli.main", "learner", *argv]
    procs: list[subprocess.Popen[bytes]] = []
    signals: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        signals.append(signum)
        how = signal.SIGTERM if len(signals) == 1 else signal.SIGKILL
        log.warning("Got signal %d: sending %s to the ranks", signum, how.name)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(how)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for rank in range(nproc):
            env = {**os.environ, **rank_env(rank, nproc, port)}
            procs.append(
                subprocess.Popen(
                    command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            )
        log.info("Started %d ranks, pids %s", nproc, [p.pid for p in procs])
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c is not None and c != 0]
            if failed:  # killed by a signal first: more likely the cause than the others
                rank, code = min(failed, key=lambda rc: (rc[1] > 0, rc[0]))
                log.error(
                    "Rank %d exited with code %d: stopping the learner's other ranks",
                    rank,
                    exit_code(code),
                )
                _stop(procs, fail_grace_s)
                return exit_code(code) or 1
            if all(c == 0 for c in codes):
                log.info("All %d ranks exited 0", nproc)
                return 0
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
