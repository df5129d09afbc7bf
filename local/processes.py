"""Child processes of `ddiloco local`: start, signal, and remember when each was up.

A `Child` is one slot (the synchronizer or one learner) whose process may be killed,
paused and restarted many times; it records those intervals for the goodput accounting
and the timeline plot. Children die with the launcher (PR_SET_PDEATHSIG on Linux).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: children may outlive a killed launcher
        pass


def ddiloco_command(*args: str) -> list[str]:
    """`ddiloco <args>` with this interpreter; -P keeps the working directory off sys.path."""
    return [sys.executable, "-P", "-m", "ddiloco.cli.main", *args]


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: list[float] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    pauses: list[tuple[float, float]] = field(default_factory=list)
    paused_since: float | None = None
    restart_at: float | None = None
    resume_at: float | None = None
    finished: bool = False

    def start(self, argv: list[str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self.proc = subprocess.Popen(
                argv or self.argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        self.starts.append(time.time())
        self.restart_at = None

    def adopt(self, proc: subprocess.Popen[bytes]) -> None:
        """Take over a process started elsewhere (a hot spare, local/spare.py) as this
        slot's next start."""
        self.proc = proc
        self.starts.append(time.time())
        self.restart_at = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            if self.paused_since is not None:
                self.resume()
            self.proc.kill()
            self.proc.wait()
            self.kills.append(time.time())

    def pause(self) -> None:
        if self.alive() and self.paused_since is None:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGSTOP)
            self.paused_since = time.time()

    def resume(self) -> None:
        if self.paused_since is not None:
            if self.alive():
                assert self.proc is not None
                self.proc.send_signal(signal.SIGCONT)
            self.pauses.append((self.paused_since, time.time()))
            self.paused_since = None
            self.resume_at = None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`."""
        self.resume()
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


def terminate_all(children: list[Child]) -> None:
    for c in children:
        c.resume()
        if c.alive():
            assert c.proc is not None
            c.proc.terminate()
    deadline = time.time() + 5.0
    for c in children:
        if c.proc is None:
            continue
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env_with(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env
