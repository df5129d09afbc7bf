"""The data-parallel baselines, run like `ddiloco local`: M rank processes, one chaos schedule.

    run = DPRun(DPConfig(learners=4, elastic=False, max_seconds=60, schedule=schedule))
    report = run.run()          # dict with the keys of a `ddiloco local` report

Ranks are local/dp.py processes, one per learner slot, started with the same task, seed and
batch size as the learners. The launcher owns membership (the generation file) and applies
the schedule with the semantics of a synchronous job:

- synchronous (`elastic=False`): a killed rank stops the group; the survivors wait (their
  processes stay warm) until the replacement arrives after the event's delay, then all of
  them restart from the last checkpoint. A partition breaks the collective like a kill and
  heals when the link comes back. Scavenged slots cannot join a fixed-size job.
- elastic (`elastic=True`): a kill reforms the group without the dead rank at once (the
  reconfiguration pause is the rendezvous, checkpoint reload and lost steps), and again with
  it when the replacement arrives. Scavenged slots join and leave the same way.
- both: a SIGSTOPped rank stalls every all-reduce until it is resumed (a frozen rank looks
  like a slow one until a timeout far longer than our pauses). A synchronizer kill does not
  apply (there is none).

Goodput is counted by local/goodput.py exactly as for the learners: each
slot holds its allocation for the whole run, busy time is forward, backward and optimizer
time of steps that were not rolled back, outside SIGSTOPs. The global model's eval loss is
measured on the checkpoint file as it is written, by a thread like learner/evaluator.py's.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.local.chaos import ChaosEvent, Schedule, learner_ids, make_schedule
from ddiloco.local.goodput import busy_seconds, goodput, new_step_spans
from ddiloco.local.processes import Child, env_with, free_port, terminate_all
from ddiloco.local.report import read_jsonl
from ddiloco.local.spare import SparePool
from ddiloco.local.supervisor import Supervisor

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class DPConfig:
    learners: int = 4
    """M, rank processes (one per learner slot)."""
    elastic: bool = False
    """Shrink on a failure and regrow when the replacement arrives."""
    model: str = "tiny"
    data: str | None = None
    seed: int = 0
    batch_size: int = 8
    """Sequences per rank and step, as per learner step."""
    inner_lr: float = 3e-3
    max_seconds: float = 60.0
    """Wall-clock budget; with `max_steps`, the cap (the run ends at whichever comes first)."""
    max_steps: int = 0
    """Group steps, every slot's step budget as `LocalConfig.max_steps` (each rank draws
    `batch_size` sequences per step, so M ranks x N steps is the tokens of M learners x N
    inner steps); the last step is checkpointed and evaluated. 0: none."""
    chaos: str = "none"
    schedule: Schedule | None = None
    ckpt_every: int = 10
    """Steps between checkpoints (work since the last one is lost on a failure)."""
    hot_spares: int = 0
    """Pre-warmed processes standing by to replace a killed rank (local/spare.py)."""
    eval_every: float = 5.0
    out: Path = field(default_factory=lambda: Path("runs") / time.strftime("dp-%Y%m%d-%H%M%S"))

    def __post_init__(self) -> None:
        if self.learners < 1:
            raise ValueError(f"learners must be >= 1, got {self.learners}")
        if self.max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds}")
        if self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {self.max_steps}")
        if self.ckpt_every < 1:
            raise ValueError(f"ckpt_every must be >= 1, got {self.ckpt_every}")


class CheckpointEvaluator:
    """Eval loss of the checkpoint file over time. History: [(t, loss, step, tokens)]."""

    def __init__(self, cfg: DPConfig, ckpt: Path) -> None:
        import torch

        from ddiloco.learner.task import build_task

        torch.set_num_threads(1)
        self.torch = torch
        # the ranks' batch size, so that task.tokens_per_batch is one rank's step
        self.task = build_task(
            preset=cfg.model, data=cfg.data, seed=cfg.seed, batch_size=cfg.batch_size
        )
        self.ckpt = ckpt
        self.every_s = cfg.eval_every
        self.initial_loss = float(self.task.eval_loss(self.task.model))
        self.history: list[tuple[float, float, int, int]] = []
        self.seen: tuple[float, int] | None = None
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="dp-eval", daemon=True)

    def evaluate(self) -> None:
        try:
            st = self.ckpt.stat()
            if self.seen == (st.st_mtime, st.st_size):
                return
            state = self.torch.load(self.ckpt, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError):  # not written yet, or replaced under us
            return
        self.seen = (st.st_mtime, st.st_size)
        self.task.model.load_state_dict(state["model"])
        with self.torch.no_grad():
            loss = float(self.task.eval_loss(self.task.model))
        self.history.append((time.time(), loss, int(state["step"]), int(state["tokens"])))

    def _loop(self) -> None:
        while not self.stop_event.wait(self.every_s):
            self.evaluate()


class DPRun(Supervisor):
    """Owns the rank processes, the generation file and the run's clock."""

    def __init__(self, cfg: DPConfig) -> None:
        self.cfg = cfg
        schedule = cfg.schedule or make_schedule(
            cfg.chaos, learners=cfg.learners, seconds=cfg.max_seconds, seed=cfg.seed
        )
        super().__init__(cfg.out, schedule)  # out, schedule, steps_done, t0, applied, spares
        self.gen_file = self.out / "gen.json"
        self.ckpt = self.out / "ckpt.pt"
        self.ids = learner_ids(cfg.learners)
        env = env_with(OMP_NUM_THREADS="1")
        self.ranks = [
            Child(lid, self._argv(i, lid), env, self.out / "logs" / f"{lid}.log")
            for i, lid in enumerate(self.ids)
        ]
        self.spares = (
            SparePool("ddiloco.local.dp", env, self.out / "logs" / "spares", cfg.hot_spares)
            if cfg.hot_spares
            else None
        )
        self.members = [i for i, lid in enumerate(self.ids) if lid not in self.schedule.absent]
        self.joined: dict[int, float] = {}
        self.left: dict[int, float] = {}
        """Scavenging: when an absent slot joined and when a slot left for good (time.time())."""
        self.down: dict[int, float] = {}
        """Slot -> when its replacement (or reconnection) arrives."""
        self.gen = -1
        self.store: Any = None
        self.store_port = 0
        self.regroup_at: float | None = None
        self.evaluator: CheckpointEvaluator | None = None

    def _argv(self, slot: int, lid: str) -> list[str]:
        c = self.cfg
        argv = [
            *["--slot", str(slot), "--slots", str(c.learners)],
            *["--gen-file", str(self.gen_file), "--ckpt", str(self.ckpt)],
            *["--ckpt-every", str(c.ckpt_every), "--model", c.model, "--seed", str(c.seed)],
            *["--batch-size", str(c.batch_size), "--inner-lr", str(c.inner_lr)],
            *["--slow-factor", str(self.schedule.slow_factors.get(lid, 1.0))],
            *["--log-path", str(self.learner_log(lid))],
        ]
        if c.max_steps:
            argv += ["--max-steps", str(c.max_steps)]
        if c.data:
            argv += ["--data", c.data]
        return [sys.executable, "-P", "-m", "ddiloco.local.dp", *argv]

    def _store(self) -> int:
        """Host the rendezvous store here, as torchrun's agent does, for the whole run: a
        rank-0-hosted store dies with rank 0, and its peers' clients then back off for
        tens of seconds before they retry (measured: 24 s twice, and 50 s in one run)."""
        if self.store is None:
            import torch.distributed as dist

            port = free_port()
            self.store = dist.TCPStore(
                "127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True
            )
            self.store_port = port
        return self.store_port

    def _publish(self) -> None:
        from ddiloco.local.dp import write_generation

        up = [s for s in self.members if s not in self.down and not self.ranks[s].finished]
        self.gen += 1
        write_generation(self.gen_file, self.gen, self._store(), up)
        log.info("Generation %d: members %s", self.gen, up)

    def _fail(self, slot: int, now: float, back_in: float, kill: bool) -> None:
        child = self.ranks[slot]
        if kill:
            child.kill()
        self.down[slot] = max(self.down.get(slot, 0.0), now + back_in)
        if self.cfg.elastic:
            self._publish()  # reform at once without it

    def inject(self, ev: ChaosEvent, now: float) -> dict[str, Any] | None:
        """Kill, freeze or cut a rank, or change the membership, with the semantics of a
        synchronous or an elastic job (the module's docstring); None when it cannot apply."""
        slot = self.ids.index(ev.target) if ev.target in self.ids else -1
        child = self.ranks[slot] if slot >= 0 else None
        if ev.action == "kill_sync" or child is None:
            return None  # no synchronizer in data-parallel training
        if ev.action == "add":
            if not self.cfg.elastic or slot in self.members:
                return None  # a fixed-size job cannot use a scavenged slot
            self.members.append(slot)
            self.members.sort()
            self.joined[slot] = time.time()
            self._publish()  # before the start: see recover
            self.start_child(child)
        elif slot not in self.members or slot in self.down:
            return None
        elif ev.action == "remove":
            self.members.remove(slot)
            self.left[slot] = time.time()
            child.kill()
            if self.cfg.elastic:
                self._publish()
        elif ev.action == "kill":
            self._fail(slot, now, ev.delay, kill=True)
        elif ev.action == "partition":
            # gloo's full mesh breaks; the rank is replaced when its link is back
            self._fail(slot, now, ev.delay, kill=True)
        elif ev.action == "pause":
            child.pause()
            child.resume_at = now + ev.delay
        log.info("Chaos %s %s (%.1fs)", ev.action, ev.target, ev.delay)
        return {}

    def recover(self, now: float) -> None:
        """Resume the paused ranks; regroup with the replacements that arrived."""
        for child in self.ranks:
            if child.resume_at is not None and now >= child.resume_at:
                child.resume()
        back = [s for s, at in self.down.items() if now >= at]
        for slot in back:
            del self.down[slot]
        if back:
            # Publish, then start: a hot spare reads the generation file within milliseconds,
            # and one that still saw the old generation listing its slot would join that dead
            # group while its peers wait for it in the new one (seen once in CI).
            self._publish()
        for slot in back:
            if slot in self.members:
                self.start_child(self.ranks[slot])

    def _check_ranks(self, now: float) -> None:
        for slot in self.members:
            child = self.ranks[slot]
            if slot in self.down or child.finished or child.alive():
                continue
            if child.exit_code() == 0 and self._reached_budget(child):
                child.finished = True
                continue
            log.warning("Rank %s exited with %s; replacing it", child.name, child.exit_code())
            self._fail(slot, now, 1.0, kill=False)

    def _reached_budget(self, child: Child) -> bool:
        """Whether a rank that exited 0 stopped at the step budget (its last stop record)."""
        if not self.cfg.max_steps:
            return False
        stops = [r for r in read_jsonl(self.learner_log(child.name)) if r.get("event") == "stop"]
        return bool(stops) and int(stops[-1].get("step", 0)) >= self.cfg.max_steps

    def spent(self) -> bool:
        """With `max_steps`: every member rank stopped at the budget."""
        return bool(self.cfg.max_steps) and all(self.ranks[s].finished for s in self.members)

    def run(self) -> dict[str, Any]:
        (self.out / "schedule.json").write_text(self.schedule.to_json())
        try:
            if self.spares:
                self.spares.fill()
            self._publish()
            for slot in self.members:
                self.ranks[slot].start()
            self.evaluator = CheckpointEvaluator(self.cfg, self.ckpt)
            self.evaluator.thread.start()
            launch = time.time()
            self.wait_first_step(
                self.ranks, launch, f"no rank took a step within 300 s; see {self.out}"
            )
            while (now := self.elapsed()) < self.cfg.max_seconds and not self.spent():
                self.apply_chaos(now)
                self._check_ranks(now)
                time.sleep(0.05)
            self.t_end = time.time()
            terminate_all(self.ranks)
            self.evaluator.stop_event.set()
            self.evaluator.thread.join(timeout=30)
            self.evaluator.evaluate()
        finally:
            terminate_all(self.ranks)
            if self.spares:
                self.spares.close()
        report = build_dp_report(self)
        (self.out / "report.json").write_text(json.dumps(report, indent=2))
        return report


def build_dp_report(run: DPRun) -> dict[str, Any]:
    """The report of a data-parallel run, with the keys of local/report.py's that apply."""
    cfg, t0, t1 = run.cfg, run.t0, run.t_end
    wall = t1 - t0
    tpb = run.evaluator.task.tokens_per_batch if run.evaluator else 0
    slots = []
    all_steps = kept_steps = 0
    bytes_total = 0
    worlds: list[int] = []
    comm: list[float] = []
    for slot, child in enumerate(run.ranks):
        # a scavenged slot is held only while it belongs to the job; one that never joined
        # (a fixed-size job cannot take it) holds nothing
        held_from = max(t0, run.joined.get(slot, t0))
        held_to = min(t1, run.left.get(slot, t1))
        if child.name in run.schedule.absent and slot not in run.joined:
            held_to = held_from
        held = max(0.0, held_to - held_from)
        records = [r for r in read_jsonl(run.learner_log(child.name)) if r.get("t", 0) <= t1 + 1]
        steps = [r for r in records if "dt" in r and "step" in r and r["t"] >= t0]
        kept = new_step_spans(records)
        busy = busy_seconds(kept, (held_from, held_to), child.pauses)
        paused = sum(min(b, t1) - a for a, b in child.pauses if a < t1)
        all_steps += len(steps)
        n_kept = sum(1 for a, b in kept if b >= t0)
        kept_steps += n_kept
        bytes_total += sum(int(r.get("bytes", 0)) for r in steps)
        worlds += [int(r.get("world", 1)) for r in steps]
        comm += [float(r.get("comm", 0.0)) for r in steps]
        slots.append(
            {
                "id": child.name,
                "steps": len(steps),
                "steps_kept": n_kept,
                "tokens": n_kept * tpb,
                "compute_seconds": round(busy, 3),
                "paused_seconds": round(paused, 3),
                "held_seconds": round(held, 3),
                "restarts": max(0, len(child.starts) - 1),
                "goodput": round(busy / held, 4) if held > 0 else 0.0,
            }
        )
    history = run.evaluator.history if run.evaluator else []
    return {
        "method": "elastic_dp" if cfg.elastic else "sync_dp",
        "goodput": round(
            goodput([s["compute_seconds"] for s in slots], [s["held_seconds"] for s in slots]), 4
        ),
        "merged_work_ratio": round(kept_steps / all_steps, 4) if all_steps else 0.0,
        "eval_loss_initial": run.evaluator.initial_loss if run.evaluator else None,
        "eval_loss_final": history[-1][1] if history else None,
        "tokens_computed": kept_steps * tpb,
        "tokens_all": all_steps * tpb,
        "bytes_up": bytes_total,
        "bytes_down": 0,
        # each byte a rank sends is received by one peer: bytes_up is the wire total
        "wall_seconds": round(wall, 3),
        "mean_contributors": round(statistics.fmean(worlds), 3) if worlds else 0.0,
        "mean_staleness": 0.0,
        "comm_seconds_mean": round(statistics.fmean(comm), 5) if comm else 0.0,
        "generations": run.gen + 1,
        "learner_restarts": sum(s["restarts"] for s in slots),
        "eval_history": [
            (round(t - t0, 3), round(loss, 5), step, tok) for t, loss, step, tok in history
        ],
        "chaos_applied": run.applied,
        "spares": {
            "taken": run.spares.taken,
            "started": run.spares.started,
            "standby_seconds": round(run.spares.standby_seconds, 3),
        }
        if run.spares
        else None,
        "config": {**asdict(cfg), "out": str(cfg.out), "schedule": None},
        "learners": slots,
    }
