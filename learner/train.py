"""One learner's training loop: inner AdamW steps, Decoupled DiLoCo wrapped around them.

    DDILOCO_TOKEN=t ddiloco learner --sync-url http://127.0.0.1:8470 --learner-id l0 --max-steps 500

Reads top to bottom like nanoGPT's train.py: build the task, the optimizer, then loop.
The loop never waits for the network (see diloco.py); it stops at its step or time
budget, or on SIGTERM, after letting queued uploads go out. Its "stop" record carries the
token ledger per fragment (`ledger_record`): computed, delivered, refused, left unsent.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, TextIO

import torch

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.diloco import DecoupledDiLoCo
from ddiloco.learner.task import build_task

log = logging.getLogger(__name__)


class StepLog:
    """JSON lines of steps and fragment events, or nothing (a null object) without a path."""

    def __init__(self, path: str | None) -> None:
        self.file: TextIO | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def lr_at(step: int, cfg: LearnerConfig) -> float:
    """Linear warm-up then constant: learners may run for an unknown time (no cosine end)."""
    if step < cfg.warmup_steps:
        return cfg.inner_lr * (step + 1) / cfg.warmup_steps
    return cfg.inner_lr


def ledger_record(diloco: DecoupledDiLoCo) -> list[dict[str, Any]]:
    """One row per fragment: the learner's counters (`DecoupledDiLoCo.ledger`) beside the
    outbox's (`Outbox.ledger`), so that for tokens (and steps)
        computed = accepted + duplicate + refused + queued + not_handed_over
                   + dropped_by_overwrite,
    `queued` being what was still unanswered when the learner stopped; `balanced` checks it."""
    rows = []
    outbox = diloco.streamer.ledger()
    for p, mine in diloco.ledger().items():
        row: dict[str, Any] = {"fragment": p, **mine, **outbox[p]}
        row["balanced"] = all(
            row[f"computed_{u}"]
            == sum(row[f"{k}_{u}"] for k in ("accepted", "duplicate", "refused", "queued"))
            + row[f"not_handed_over_{u}"]
            + row[f"dropped_by_overwrite_{u}"]
            for u in ("steps", "tokens")
        )
        rows.append(row)
    return rows


def train(cfg: LearnerConfig) -> dict[str, Any]:
    device = pick_device(cfg.device)
    if device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    task = build_task(
        preset=cfg.model,
        data=cfg.data,
        model_entry=cfg.model_entry,
        learner_index=cfg.learner_index,
        num_learners=cfg.num_learners,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        device=str(device),
    )
    model = task.model
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.inner_lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95)
    )
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    )
    steplog = StepLog(cfg.log_path)
    stopping = False

    def on_term(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    log.info("Learner %s starting: device=%s config=%s", cfg.learner_id, device, cfg)
    with DecoupledDiLoCo(model, cfg, embedding=task.embedding_params) as diloco:
        t_start = time.monotonic()
        steplog.write(
            {"event": "start", "t": time.time(), "incarnation": diloco.streamer.incarnation}
        )
        model.train()
        while not stopping:
            if cfg.max_steps and diloco.step >= cfg.max_steps:
                break
            if cfg.max_seconds and time.monotonic() - t_start >= cfg.max_seconds:
                break
            if cfg.max_tokens and diloco.tokens_total >= cfg.max_tokens:
                break
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(diloco.step, cfg)
            x, y = next(task.batches)
            with autocast:
                loss = task.loss_fn(model, x, y)
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            lossf = float(loss.detach())
            if not math.isfinite(lossf):
                raise FloatingPointError(f"inner loss became {lossf} at step {diloco.step}")
            dt = time.perf_counter() - t0
            if cfg.slow_factor > 1.0:  # chaos: a slower accelerator
                time.sleep(dt * (cfg.slow_factor - 1.0))
                dt = time.perf_counter() - t0
            diloco.after_step(task.tokens_per_batch, dt, lossf)
            steplog.write(
                {"t": time.time(), "step": diloco.step, "dt": round(dt, 6), "loss": round(lossf, 4)}
            )
            for event in diloco.drain_events():
                steplog.write({"t": time.time(), **event})
            if cfg.log_every and diloco.step % cfg.log_every == 0:
                tps = task.tokens_per_batch / (diloco.step_ema or dt)
                lag = sum(
                    max(0, v - b)
                    for v, b in zip(diloco.streamer.versions, diloco.base_version, strict=False)
                )
                log.info(
                    "step %6d | loss %.4f | %7.0f tok/s | versions behind %d",
                    diloco.step,
                    lossf,
                    tps,
                    lag,
                )
    # after the exit: the outbox has drained (for up to its drain time) and its ledger is final
    summary = {
        "learner_id": cfg.learner_id,
        "steps": diloco.step,
        "tokens": diloco.tokens_total,
        "compute_seconds": round(diloco.compute_seconds, 3),
        **diloco.stats,
        "bytes_up": diloco.streamer.bytes_up,
        "bytes_down": diloco.streamer.bytes_down,
        "ledger": ledger_record(diloco),
    }
    steplog.write({"event": "stop", "t": time.time(), **summary})
    steplog.close()
    brief = {k: v for k, v in summary.items() if k != "ledger"}
    unsent = sum(r["queued_tokens"] + r["refused_tokens"] for r in summary["ledger"])
    log.info("Learner %s stopped: %s; tokens refused or unsent: %d", cfg.learner_id, brief, unsent)
    return summary


def init_logging(level: str = "INFO", learner_id: str = "") -> None:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s learner {learner_id} %(levelname)s: %(message)s",
    )
