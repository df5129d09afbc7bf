"""One rank of the data-parallel baselines: the learner's model, data and inner optimizer, with
gradients all-reduced every step over torch.distributed (gloo on loopback).

    python -P -m ddiloco.local.dp --slot 1 --slots 4 --gen-file run/gen.json --ckpt run/ckpt.pt \
        --log-path run/learners/learner-1.jsonl

Started by local/dp_run.py, one process per learner slot; bench/goodput.py compares it with
Decoupled DiLoCo under the same chaos (the bench's baseline: "a plain data-parallel baseline with
the same chaos schedule"). Same task (learner/task.py: model, shard `slot` of `slots`, batch
seed), same AdamW, warm-up and clipping as a learner (learner/config.py defaults).

Membership comes from the launcher as generations in `--gen-file`, JSON
`{"gen": g, "port": p, "members": [slot, ...]}`; p is the launcher's rendezvous store
(hosted by the launcher for the whole run, so no rank's death takes it down). A rank waits for a generation that lists
it, forms the gloo group (rank = its place in `members`), loads the latest checkpoint (the
group's step and tokens, model and optimizer) and trains until the collective fails (a peer
was SIGKILLed: gloo reports the closed connection), or a newer generation appears (the
elastic baseline shrinks or regrows), or SIGTERM. Then it waits for the next generation.
Surviving ranks stay warm; only a replaced slot starts a new process. A SIGSTOPped peer
stalls the all-reduce, and so everyone, until it is resumed, as in real synchronous training.
Member 0 writes the checkpoint every `--ckpt-every` steps; work after it is lost on a
failure and redone, which the step log marks with `{"event": "start", "resume_step": s}`.
With `--max-steps N` the group stops at step N: member 0 checkpoints it, every rank exits 0.

Step records are the learner's (`t`, `step`, `dt`, `loss`) plus `comm` (seconds inside the
all-reduce, waiting included) and `bytes` (what a ring all-reduce moves for this rank).
`dt` is compute only: forward, backward, optimizer step and the slow-factor sleep; the
all-reduce is where a rank waits for the others, and goodput (local/goodput.py) counts barrier waits
against goodput.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.schedule import budget_progress, learning_rate
from ddiloco.learner.task import build_task
from ddiloco.learner.train import StepLog

log = logging.getLogger(__name__)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ddiloco.local.dp", description=__doc__)
    # --- membership ---
    ap.add_argument("--slot", type=int, required=True, help="this rank's learner slot")
    ap.add_argument("--slots", type=int, required=True, help="M, learner slots (data parts)")
    ap.add_argument("--gen-file", type=Path, required=True, help="generations from the launcher")
    ap.add_argument("--ckpt", type=Path, required=True, help="the group's checkpoint file")
    ap.add_argument("--ckpt-every", type=int, default=10, help="steps between checkpoints")
    ap.add_argument("--timeout", type=float, default=900.0, help="gloo collective timeout, s")
    ap.add_argument(
        "--max-steps", type=int, default=0, help="stop at this group step (0: at SIGTERM only)"
    )
    # --- task and optimizer (the learner's) ---
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--data")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inner-lr", type=float, default=3e-3)
    ap.add_argument("--slow-factor", type=float, default=1.0, help="chaos: slower accelerator")
    ap.add_argument("--log-path", help="append JSON lines of steps and events here")
    return ap.parse_args(argv)


def read_generation(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):  # not written yet, or being replaced
        return None


def write_generation(path: Path, gen: int, port: int, members: list[int]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gen": gen, "port": port, "members": members}))
    os.replace(tmp, path)


def save_checkpoint(path: Path, model: torch.nn.Module, opt: Any, step: int, tokens: int) -> None:
    tmp = path.with_suffix(".tmp")
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "tokens": tokens}
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model: torch.nn.Module, opt: Any) -> tuple[int, int]:
    """(step, tokens) of the checkpoint, loaded into model and opt; (0, 0) without one."""
    if not path.exists():
        return 0, 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return int(state["step"]), int(state["tokens"])


class Rank:
    """State: the task, optimizer, the group's step and tokens, the generation it is in."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg = LearnerConfig(inner_lr=args.inner_lr)  # the learner's optimizer defaults
        self.task = build_task(
            preset=args.model,
            data=args.data,
            learner_index=args.slot,
            num_learners=args.slots,
            batch_size=args.batch_size,
            seed=args.seed,
        )
        self.model = self.task.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(
            self.params, lr=args.inner_lr, weight_decay=self.cfg.weight_decay, betas=(0.9, 0.95)
        )
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params)
        self.steplog = StepLog(args.log_path)
        self.stopping = False
        self.gen = -1
        self.step = 0
        self.tokens = 0
        self.batches_drawn = 0

    def wait_generation(self) -> dict[str, Any] | None:
        """The next generation that lists this slot; None on SIGTERM."""
        while not self.stopping:
            g = read_generation(self.args.gen_file)
            if g is not None and g["gen"] > self.gen and self.args.slot in g["members"]:
                return g
            if g is not None and g["gen"] > self.gen:
                self.gen = g["gen"]  # a generation without us (elastic shrink): wait
            time.sleep(0.05)
        return None

    def newer_generation(self) -> bool:
        g = read_generation(self.args.gen_file)
        return g is not None and g["gen"] > self.gen

    def join(self, g: dict[str, Any]) -> None:
        log.warning("Joining generation %d (members %s)", g["gen"], g["members"])
        if dist.is_initialized():
            dist.destroy_process_group()
        self.gen = g["gen"]
        members: list[int] = g["members"]
        self.rank, self.world = members.index(self.args.slot), len(members)
        timeout = timedelta(seconds=self.args.timeout)
        # the launcher hosts the store for the whole run; each generation its own key space.
        # A rank in another network namespace (bench/wan_study.py) reaches it by address.
        host = os.environ.get("DDILOCO_DP_STORE_HOST", "127.0.0.1")
        store = dist.TCPStore(host, g["port"], is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"gen{self.gen}/", store),
            rank=self.rank,
            world_size=self.world,
            timeout=timeout,
        )
        log.warning("Generation %d formed: rank %d of %d", self.gen, self.rank, self.world)
        self.step, self.tokens = load_checkpoint(self.args.ckpt, self.model, self.opt)
        while self.batches_drawn < self.step:  # a new process picks up the data where it was
            next(self.task.batches)
            self.batches_drawn += 1
        self.steplog.write(
            {
                "event": "start",
                "t": time.time(),
                "resume_step": self.step,
                "gen": self.gen,
                "world": self.world,
            }
        )

    def _progress(self) -> float | None:
        """Where a decaying LR schedule stands: this process's own budget (no job's)."""
        return budget_progress(
            self.cfg, job_total_tokens=self.tokens, job_tokens_merged=0, steps=self.step, tokens=0
        )

    def train_step(self) -> None:
        t0 = time.perf_counter()
        for group in self.opt.param_groups:
            group["lr"] = learning_rate(self.cfg, self.step, self._progress())
        x, y = next(self.task.batches)
        self.batches_drawn += 1
        loss = self.task.loss_fn(self.model, x, y)
        loss.backward()
        t1 = time.perf_counter()
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])  # type: ignore[union-attr]
        dist.all_reduce(flat)
        flat /= self.world
        t2 = time.perf_counter()
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
            offset += n
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dt = (t1 - t0) + (time.perf_counter() - t2)
        if self.args.slow_factor > 1.0:  # chaos: a slower accelerator
            time.sleep(dt * (self.args.slow_factor - 1.0))
            dt *= self.args.slow_factor
        self.step += 1
        self.tokens += self.world * self.task.tokens_per_batch
        self.steplog.write(
            {
                "t": time.time(),
                "step": self.step,
                "dt": round(dt, 6),
                "comm": round(t2 - t1, 6),
                "bytes": int(2 * (self.world - 1) / self.world * self.nbytes),
                "world": self.world,
                "loss": round(float(loss.detach()), 4),
            }
        )
        if self.rank == 0 and self.step % self.args.ckpt_every == 0:
            save_checkpoint(self.args.ckpt, self.model, self.opt, self.step, self.tokens)

    def spent(self) -> bool:
        """Whether the group reached `--max-steps` (every rank of a group at the same step)."""
        return bool(self.args.max_steps) and self.step >= self.args.max_steps

    def finish(self) -> None:
        """The step budget is spent: member 0 checkpoints the last step (the model the
        launcher evaluates), then every rank stops and exits 0."""
        if self.rank == 0 and self.step % self.args.ckpt_every:
            save_checkpoint(self.args.ckpt, self.model, self.opt, self.step, self.tokens)
        self.stopping = True

    def run(self) -> None:
        while not self.stopping:
            g = self.wait_generation()
            if g is None:
                break
            try:
                self.join(g)
                while not self.stopping and not self.newer_generation() and not self.spent():
                    self.train_step()
                if self.spent():
                    self.finish()
            except (RuntimeError, ValueError) as e:  # gloo: a peer went away
                log.warning("Group of generation %d failed: %s", self.gen, str(e)[:200])
                self.opt.zero_grad(set_to_none=True)
        self.steplog.write({"event": "stop", "t": time.time(), "step": self.step})
        self.steplog.close()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(
        level="WARNING", stream=sys.stderr, format=f"%(asctime)s dp {args.slot} %(message)s"
    )
    torch.set_num_threads(1)
    rank = Rank(args)

    def on_term(signum: int, _frame: object) -> None:
        rank.stopping = True

    signal.signal(signal.SIGTERM, on_term)
    rank.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
