"""A pre-warmed spare process, standing by to replace a killed learner (or data-parallel rank).

    spare = SparePool("ddiloco.learner.train", env, logs_dir, size=2)
    proc = spare.take(child.argv, child.log_path)   # a warm process, now running that argv

A spare does what a fresh process spends its first seconds on (import torch and the training
code, first optimizer step) before it is needed, then blocks reading one line from stdin: the
argv of the slot it takes over and the log file to write to. This is what a warm standby pod
with the image already pulled would do in a cluster. Once warm it writes its ready file
(`SparePool.ready()` counts those). Spares are started with the run and refilled right after
one is taken; their start-up competes for CPU with the running learners, which shows in their
step times. The bench reports how long spares stood by.

When the slot is handed over is the launcher's choice (local/launcher.py, `spare_takeover`):
`immediate` (`ddiloco local`'s default, what the operator's hot spares do) hands a killed slot
to a ready spare at once, since the long-tailed delay models a pod's rescheduling and image
pull, which a started spare does not pay; `after-delay` (the bench, for every arm alike)
still waits the schedule's delay and the slot counts as dead until then: the spare only
removes the import cost (3-8 s on a 2-core machine, up to 12 s when loaded) from the time
after it.

Run by the pool as `python -P -m ddiloco.local.spare <module to pre-import> [<ready file>]`.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ddiloco.local.processes import _die_with_parent


class SparePool:
    """State: the standing spares (processes with an open stdin) and counters: spares
    started, taken, and their summed standby seconds."""

    def __init__(self, module: str, env: dict[str, str], logs: Path, size: int = 1) -> None:
        if size < 1:
            raise ValueError(f"spare pool size must be >= 1, got {size}")
        self.module = module
        self.env = env
        self.logs = logs
        self.size = size
        self.spares: list[tuple[subprocess.Popen[bytes], float]] = []
        self.ready_files: dict[int, Path] = {}  # pid -> the file it writes once warm
        self.started = 0
        self.taken = 0
        self.standby_seconds = 0.0

    def fill(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        while len(self.spares) < self.size:
            ready = self.logs / f"spare-{self.started}.ready"
            ready.unlink(missing_ok=True)
            with open(self.logs / f"spare-{self.started}.log", "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-P", "-m", "ddiloco.local.spare", self.module, str(ready)],
                    env=self.env,
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,
                )
            self.spares.append((proc, time.time()))
            self.ready_files[proc.pid] = ready
            self.started += 1

    def _ready(self, proc: subprocess.Popen[bytes]) -> bool:
        file = self.ready_files.get(proc.pid)
        return proc.poll() is None and file is not None and file.exists()

    def ready(self) -> int:
        """Standing spares that finished warming up."""
        return sum(self._ready(proc) for proc, _ in self.spares)

    def take(
        self, argv: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes] | None:
        """Hand `argv` (a full `python -P -m module ...` command) to a standing spare, a warm
        one first; None when none is left (the caller starts a cold process). `env`: the
        variables the slot has beyond the pool's (its own credential), sent down the spare's
        stdin, so they show in no process listing. Refills the pool."""
        self.spares.sort(key=lambda item: not self._ready(item[0]))  # the warm ones first
        while self.spares:
            proc, since = self.spares.pop(0)
            if proc.poll() is not None:
                continue
            assert proc.stdin is not None
            log_path.parent.mkdir(parents=True, exist_ok=True)
            line = json.dumps({"argv": argv, "log": str(log_path), "env": env or {}}) + "\n"
            try:
                proc.stdin.write(line.encode())
                proc.stdin.close()
            except BrokenPipeError:
                continue
            self.taken += 1
            self.standby_seconds += time.time() - since
            self.fill()
            return proc
        self.fill()
        return None

    def close(self) -> None:
        for proc, since in self.spares:
            self.standby_seconds += time.time() - since
            if proc.stdin is not None:
                proc.stdin.close()  # EOF: the spare exits on its own
        for proc, _ in self.spares:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.spares = []


def main() -> int:
    t_start = time.time()
    importlib.import_module(sys.argv[1])  # the expensive part: torch and the training code
    import torch

    torch.set_num_threads(1)
    # First use of what every training step needs: the first AdamW imports torch._dynamo and
    # sympy (~3 s), the first backward starts autograd's machinery.
    w = torch.nn.Parameter(torch.ones(64, 64))
    opt = torch.optim.AdamW([w], lr=1e-3)
    (w @ w).sum().backward()
    opt.step()
    sys.stderr.write(f"spare: ready after {time.time() - t_start:.1f}s\n")
    sys.stderr.flush()
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(f"{time.time():.3f}\n")
    line = sys.stdin.readline()
    if not line:
        return 0  # the launcher closed the pool
    order = json.loads(line)
    os.environ.update(order["env"])
    fd = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    argv: list[str] = order["argv"]
    module = argv[argv.index("-m") + 1]
    rest = argv[argv.index("-m") + 2 :]
    sys.argv = [module, *rest]
    return int(importlib.import_module(module).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
