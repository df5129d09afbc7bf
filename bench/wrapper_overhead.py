"""Inner-step time with the streaming wrapper against plain training, interleaved in one run.

    .venv/bin/python bench/wrapper_overhead.py --model tiny --rounds 20 --json /tmp/overhead.json
    .venv/bin/python bench/wrapper_overhead.py --model small -H 24 -P 4 --batch-size 8

Two copies of the same task (`build_task`: same preset, seed, initial weights and batch
sequence), each with its own AdamW. `plain` is the bare loop: batch, forward, backward, clip,
`opt.step()`, `zero_grad`. `wrapped` is the same loop with `DecoupledDiLoCo` around it, joined
to a real `ddiloco synchronizer` process on loopback (the job's only learner, so every
hand-over merges at once and comes back to be adopted: the wrapper does all of its work).
After a warm-up of 2H steps each, each arm runs `--rounds` spans of H steps (each span holds
one hand-over of every fragment) in blocks of `--block` steps (default H), the blocks of both
arms shuffled into one seeded random order. (A fixed alternation aliases with the wrapper's
period: stepping p w w p p w ..., every hand-over fell on the same parity, and the
background upload it starts always slowed the plain step after it.) The time of an
inner step is the wall clock of the whole iteration, wrapper included, on the loop's thread;
drift of the machine (other jobs, thermal) falls on both arms alike, step by step.
Overhead = mean wrapped step time / mean plain step time - 1, with its standard error over
the spans; the mark is under 3%. Also printed: the time of `opt.step()` (with the wrapper's
hook, or its `after_step` call) in each arm, whose difference is the wrapper's own work on
the loop's thread, a figure the noise of a loaded machine moves far less.

The wrapper's two network threads (heartbeats, downloads, uploads) run beside the loop, and
contend with it for the GIL and the cores: the inner step after a hand-over is slower, in
either arm, whichever runs then. In blocks of H steps (the default) that cost falls into the
wrapped arm's own block (all but the spill of a block's last hand-over into the next block),
which is what a learner pays. With `--block 1` the steps of the two arms are shuffled one by
one and the cost falls on both alike: the comparison then measures only the wrapper's work
on the loop's thread, with better drift cancellation. Either way the threads' CPU seconds
(from /proc) are printed apart, over the wrapped arm's step time. `--aa` runs two plain arms
instead (the harness's own bias: it should read 0 within its error). `--threads` sets
torch's intra-op threads (1 on the 2-core CI machine, leaving a core to the synchronizer
and the wrapper's threads).

Works with either wrapper API: `DecoupledDiLoCo(model, optimizer, cfg, ...)` with an optimizer
post-hook (the loop calls nothing), or the older `DecoupledDiLoCo(model, cfg, ...)` whose
`after_step` the loop calls; the run prints which. bench/gpu_learner.py reuses this on CUDA.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import math
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.diloco import DecoupledDiLoCo
from ddiloco.learner.sync_client import SyncClient
from ddiloco.learner.task import Task, build_task
from ddiloco.local.processes import Child, ddiloco_command, env_with, free_port, terminate_all

TOKEN = "bench-overhead"


def start_synchronizer(out: Path, timeout_s: float = 60.0) -> tuple[Child, str]:
    """A real `ddiloco synchronizer` on a free loopback port, state and log under `out`."""
    port = free_port()
    child = Child(
        "synchronizer",
        ddiloco_command("synchronizer", "--port", str(port), "--state-dir", str(out / "state")),
        env_with(DDILOCO_TOKEN=TOKEN),
        out / "sync.log",
    )
    child.start()
    url = f"http://127.0.0.1:{port}"
    probe, deadline = SyncClient(url, TOKEN, timeout=2), time.monotonic() + timeout_s
    while not probe.healthy():
        if not child.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the synchronizer did not come up: {child.log_path}")
        time.sleep(0.1)
    return child, url


def thread_cpu_seconds(prefix: str = "ddiloco-") -> float:
    """CPU seconds used so far by this process's threads named `prefix*` (the wrapper's
    network threads, learner/streaming.py), from /proc (0 where there is none)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for t in threading.enumerate():
        if not t.name.startswith(prefix) or t.native_id is None:
            continue
        try:
            stat = Path(f"/proc/self/task/{t.native_id}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by process `pid` (user + system, from /proc; 0 if gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hooks_optimizer() -> bool:
    """True when the wrapper takes the optimizer and works from its post-step hook."""
    return "optimizer" in inspect.signature(DecoupledDiLoCo.__init__).parameters


class Trainer:
    """One arm: a task, its optimizer and, for `wrapped`, the wrapper around them."""

    def __init__(
        self,
        name: str,
        task: Task,
        lr: float,
        autocast: AbstractContextManager[Any] | None = None,
        cfg: LearnerConfig | None = None,
    ) -> None:
        self.name, self.task = name, task
        self.opt = torch.optim.AdamW(
            task.model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95)
        )
        self.autocast = autocast or nullcontext()
        self.diloco: Any = None
        self.calls_after_step = False
        if cfg is not None:
            if hooks_optimizer():
                self.diloco = _new_wrapper(task, self.opt, cfg)
            else:
                self.diloco = DecoupledDiLoCo(task.model, cfg, embedding=task.embedding_params)
                self.calls_after_step = True
            self.diloco.__enter__()  # joins the synchronizer, takes the global copy
        self.cuda = next(task.model.parameters()).device.type == "cuda"
        self.times: list[float] = []
        self.hook_times: list[float] = []
        """Per step: seconds in `opt.step()` (with the post-hook wrapper: the hook's work
        too) plus the `after_step` call (older wrapper): the wrapper's share of the loop's
        thread is this arm's figure minus the plain arm's."""

    def step(self) -> float:
        """One inner step, wrapper included; its wall-clock seconds."""
        t0 = time.perf_counter()
        x, y = next(self.task.batches)
        with self.autocast:
            loss = self.task.loss_fn(self.task.model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.task.model.parameters(), 1.0)
        lossf = float(loss.detach())  # a sync point on CUDA, so the next span is the step's
        if self.diloco is not None and hasattr(self.diloco, "report_loss"):
            self.diloco.report_loss(lossf)  # as train.py does: the heartbeat's loss
        t_opt = time.perf_counter()
        self.opt.step()
        if self.calls_after_step:
            self.diloco.after_step(self.task.tokens_per_batch, time.perf_counter() - t0, lossf)
        if self.cuda:
            torch.cuda.synchronize()
        self.hook_times.append(time.perf_counter() - t_opt)
        self.opt.zero_grad(set_to_none=True)
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def block(self, n: int, trace: list[tuple[str, float, bool]] | None = None) -> float:
        """`n` inner steps; their mean seconds (each step kept in `times`, and in `trace` as
        (arm, seconds, whether it handed a fragment over) in the order they ran)."""
        ts = []
        for _ in range(n):
            before = self.handovers()
            ts.append(self.step())
            if trace is not None:
                trace.append((self.name, ts[-1], self.handovers() > before))
        self.times.extend(ts)
        return statistics.fmean(ts)

    def handovers(self) -> int:
        """Hand-overs so far (0 for a plain arm), read without building `stats()`."""
        if self.diloco is None:
            return 0
        counts = getattr(self.diloco, "counts", None)
        if isinstance(counts, dict):
            return int(counts.get("handovers", 0))
        return int(self.stats().get("handovers", 0))

    def stats(self) -> dict[str, Any]:
        if self.diloco is None:
            return {}
        stats = self.diloco.stats
        return dict(stats() if callable(stats) else stats)

    def close(self) -> None:
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)


def _new_wrapper(task: Task, opt: torch.optim.Optimizer, cfg: LearnerConfig) -> Any:
    """The post-hook wrapper, given what its signature asks for (tokens per step, ...)."""
    params = inspect.signature(DecoupledDiLoCo.__init__).parameters
    kw: dict[str, Any] = {}
    if "embedding" in params:
        kw["embedding"] = task.embedding_params
    for name in ("tokens_per_step", "tokens_per_batch", "tokens"):
        if name in params:
            kw[name] = task.tokens_per_batch
    return DecoupledDiLoCo(task.model, opt, cfg, **kw)


def interleaved(
    plain: Trainer,
    wrapped: Trainer,
    rounds: int,
    h: int,
    warmup: int,
    block: int = 1,
    seed: int = 0,
    sync_pid: int | None = None,
) -> dict[str, Any]:
    """Warm both arms up, then `rounds` x H steps each, in blocks of `block` steps run in a
    seeded random order; the figures."""
    for arm in (plain, wrapped):
        for _ in range(warmup):
            arm.step()
        arm.times.clear()
        arm.hook_times.clear()
    steps = rounds * h
    cpu0 = thread_cpu_seconds()
    sync0 = process_cpu_seconds(sync_pid) if sync_pid else 0.0
    blocks = [
        (arm, min(block, steps - i)) for arm in (plain, wrapped) for i in range(0, steps, block)
    ]
    random.Random(seed).shuffle(blocks)
    trace: list[tuple[str, float, bool]] = []
    for arm, n in blocks:
        arm.block(n, trace)
    background = thread_cpu_seconds() - cpu0
    sync_cpu = process_cpu_seconds(sync_pid) - sync0 if sync_pid else 0.0
    p, w = plain.times, wrapped.times
    # one figure per H consecutive steps of each arm (every fragment handed over once in it)
    ratios = [sum(w[k : k + h]) / sum(p[k : k + h]) - 1.0 for k in range(0, steps, h)]
    p_mean, w_mean = statistics.fmean(p), statistics.fmean(w)
    after = [t for prev, (_, t, _) in itertools.pairwise(trace) if prev[2]]
    others = [t for prev, (_, t, _) in itertools.pairwise(trace) if not prev[2]]
    tpb = plain.task.tokens_per_batch
    sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    return {
        "rounds": rounds,
        "steps_per_arm": steps,
        "alternation_steps": block,
        "plain_step_ms": 1e3 * p_mean,
        "wrapped_step_ms": 1e3 * w_mean,
        "plain_median_ms": 1e3 * statistics.median(p),
        "wrapped_median_ms": 1e3 * statistics.median(w),
        "plain_tokens_per_s": tpb / p_mean,
        "wrapped_tokens_per_s": tpb / w_mean,
        "overhead": w_mean / p_mean - 1.0,
        "overhead_se": sd / math.sqrt(len(ratios)),
        "overhead_median_round": statistics.median(ratios),
        "overhead_of_medians": statistics.median(w) / statistics.median(p) - 1.0,
        "per_round_overhead": ratios,
        "plain_opt_step_ms": 1e3 * statistics.fmean(plain.hook_times),
        "wrapped_opt_step_ms": 1e3 * statistics.fmean(wrapped.hook_times),
        "wrapper_loop_share": (
            statistics.fmean(wrapped.hook_times) - statistics.fmean(plain.hook_times)
        )
        / p_mean,
        "after_handover_ms": 1e3 * statistics.fmean(after) if after else None,
        "after_handover_steps": len(after),
        "other_steps_ms": 1e3 * statistics.fmean(others) if others else None,
        "background_cpu_s": background,
        "background_cpu_share": background / sum(w),
        "synchronizer_cpu_s": sync_cpu,
        "wrapper_api": "optimizer post-hook" if hooks_optimizer() else "after_step call",
        "wrapper_stats": wrapped.stats(),
    }


def learner_config(url: str, h: int, fragments: int, **extra: Any) -> LearnerConfig:
    return LearnerConfig.from_env(
        {},
        sync_url=url,
        token=TOKEN,
        learner_id="overhead",
        h=h,
        num_fragments=fragments,
        drain_s=10.0,
        log_every=0,
        **extra,
    )


def run(
    make_task: Callable[[], Task],
    *,
    h: int,
    fragments: int,
    rounds: int,
    block: int = 0,
    lr: float = 3e-3,
    out: Path | None = None,
    autocast: Callable[[], AbstractContextManager[Any]] | None = None,
    aa: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """The whole measurement: a synchronizer, both arms, `rounds` x H steps each, in shuffled
    blocks of `block` steps (0: H)."""
    out = out or Path(tempfile.mkdtemp(prefix="overhead-"))
    sync, url = start_synchronizer(out)
    trainers: list[Trainer] = []
    try:
        plain = Trainer("plain", make_task(), lr, autocast() if autocast else None)
        trainers.append(plain)
        wrapped = Trainer(
            "wrapped",
            make_task(),
            lr,
            autocast() if autocast else None,
            cfg=None if aa else learner_config(url, h, fragments),
        )
        trainers.append(wrapped)
        pid = sync.proc.pid if sync.proc is not None else None
        res = interleaved(plain, wrapped, rounds, h, 2 * h, block or h, seed, pid)
        if aa:
            res["wrapper_api"] = "none: A/A calibration, both arms plain"
        return res
    finally:
        for t in trainers:
            t.close()
        terminate_all([sync])


def report(res: dict[str, Any]) -> None:
    print(
        f"wrapper API: {res['wrapper_api']}; {res['steps_per_arm']} steps per arm, in "
        f"shuffled blocks of {res['alternation_steps']}"
    )
    rounds = "  ".join(f"{100 * r:+.1f}" for r in res["per_round_overhead"])
    print(f"  per H steps, wrapped / plain - 1 (%): {rounds}")
    print(
        f"plain   {res['plain_step_ms']:8.2f} ms/step (median {res['plain_median_ms']:.2f}), "
        f"{res['plain_tokens_per_s']:,.0f} tokens/s\n"
        f"wrapped {res['wrapped_step_ms']:8.2f} ms/step (median {res['wrapped_median_ms']:.2f}), "
        f"{res['wrapped_tokens_per_s']:,.0f} tokens/s\n"
        f"wrapper: {res['wrapper_stats']}\n"
        f"opt.step (+ wrapper) {res['plain_opt_step_ms']:.3f} ms plain, "
        f"{res['wrapped_opt_step_ms']:.3f} ms wrapped: the wrapper's work on the loop's thread "
        f"is {100 * res['wrapper_loop_share']:.2f}% of a plain step\n"
        f"the wrapper's network threads used {res['background_cpu_s']:.2f} CPU s, "
        f"{100 * res['background_cpu_share']:.2f}% of the wrapped arm's step time (another core's "
        f"work where one is free); the synchronizer process {res['synchronizer_cpu_s']:.2f} CPU s"
    )
    if res["after_handover_ms"] is not None:
        print(
            f"the step after a hand-over (either arm): {res['after_handover_ms']:.2f} ms over "
            f"{res['after_handover_steps']} steps, against {res['other_steps_ms']:.2f} ms for the "
            "others"
        )
    verdict = "met" if res["overhead"] < 0.03 else "missed"
    print(
        f"overhead {100 * res['overhead']:+.2f}% +- {100 * res['overhead_se']:.2f}% (standard "
        f"error over the {len(res['per_round_overhead'])} spans of H steps; median span "
        f"{100 * res['overhead_median_round']:+.2f}%, of step medians "
        f"{100 * res['overhead_of_medians']:+.2f}%); mark < 3%: {verdict}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="a preset of learner/model.py (or hf:...)")
    ap.add_argument("-H", "--h", type=int, default=24)
    ap.add_argument("-P", "--fragments", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20, help="spans of H steps per arm")
    ap.add_argument("--block", type=int, default=0, help="steps per block (default H)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--aa", action="store_true", help="both arms plain: the harness's bias")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    res = run(
        lambda: build_task(preset=args.model, batch_size=args.batch_size, seed=args.seed),
        h=args.h,
        fragments=args.fragments,
        rounds=args.rounds,
        block=args.block or args.h,
        out=args.out,
        aa=args.aa,
        seed=args.seed,
    )
    res |= {"model": args.model, "batch_size": args.batch_size, "threads": args.threads}
    res |= {"aa": args.aa}
    report(res)
    print(f"wall {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
